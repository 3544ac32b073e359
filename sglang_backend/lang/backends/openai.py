"""DSL backend over any OpenAI-compatible ``/v1`` server (ours included), with API speculative execution.

Speculative execution (``@function(num_api_spec_tokens=N)``, completion models): the first ``gen``
over-generates N tokens without its stop; the following constant text and ``gen``s are matched against that
speculated text, so a multi-field template often costs one API call instead of one per field. When the
model strays from the template, the speculation is dropped and a fresh call is made. Chat models: an assistant
turn's texts and gens are matched against one chat completion at the end of the turn (lang/speculative.py).

``select`` (completion models) and ``image`` (chat models) are supported too, and ``gen(return_logprob=True)``
with ``top_logprobs_num``; see those methods.
"""

from __future__ import annotations

import re

from ..chat_template import get_chat_template, guess_chat_template
from ..choices import ChoicesDecision, choice_entries, decide, token_length_normalized
from ..ir import SglSamplingParams, SglVideo
from .base import BaseBackend, TokenUsage, image_data_url  # noqa: F401 - TokenUsage: upstream's path



class OpenAI(BaseBackend):
    supports_api_spec = True
    fork_hints = False  # a remote API has no prefix-hint call

    def __init__(self, model_name: str, is_chat_model: bool | None = None, chat_template: str | None = None,
                 base_url: str | None = None, api_key: str | None = None, **client_kwargs):
        import openai  # optional dependency: only this backend needs it

        self.model_name = model_name
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", **client_kwargs)
        if is_chat_model is None:
            is_chat_model = not any(k in model_name for k in ("instruct", "davinci", "babbage"))
        self.is_chat_model = is_chat_model
        self.chat_template = get_chat_template(chat_template) if chat_template else guess_chat_template(None, model_name)

    def get_model_name(self) -> str:
        return self.model_name

    def _request_kwargs(self, sp: SglSamplingParams) -> dict:
        kwargs = {"max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p}
        if sp.stop:
            kwargs["stop"] = sp.stop
        if sp.frequency_penalty:
            kwargs["frequency_penalty"] = sp.frequency_penalty
        if sp.presence_penalty:
            kwargs["presence_penalty"] = sp.presence_penalty
        extra = {}
        for name in ("top_k", "min_p"):
            value = getattr(sp, name)
            if value not in (None, -1, 0.0):
                extra[name] = value
        if sp.ignore_eos:
            extra["ignore_eos"] = True
        if sp.min_new_tokens:
            extra["min_tokens"] = sp.min_new_tokens
        runtime = sp.to_runtime_params()
        for name in ("regex", "json_schema"):
            if name in runtime:
                extra[name] = runtime[name]
        if extra:
            kwargs["extra_body"] = extra
        return {k: v for k, v in kwargs.items() if v is not None}

    def _account(self, usage) -> None:
        self.token_usage.add(usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0)

    def generate(self, s, sampling_params: SglSamplingParams) -> tuple[str, dict]:
        kwargs = self._request_kwargs(sampling_params)
        # return_logprob: the API's logprobs, in the runtime backends' meta_info shape (ids are not sent by the
        # API: None). max_tokens=0 asks for the next token's top logprobs (upstream's cot_decoding): the API
        # cannot return them without a token, so one is generated and dropped.
        want_logprobs = bool(sampling_params.return_logprob)
        top_k = min(sampling_params.top_logprobs_num or 0, 20)
        next_token_only = want_logprobs and sampling_params.max_new_tokens == 0
        if next_token_only:
            kwargs["max_tokens"] = 1
        if self.is_chat_model:
            prefix = self.chat_template.get_prefix_and_suffix("assistant")[0]
            if not s.text_.endswith(prefix):
                raise RuntimeError("with an OpenAI chat model, gen() must come right after assistant begins "
                                   "(the API continues whole messages, not arbitrary text)")
            if want_logprobs:
                kwargs.update(logprobs=True, top_logprobs=top_k)
            resp = self.client.chat.completions.create(model=self.model_name, messages=s.messages_, **kwargs)
            text = resp.choices[0].message.content or ""
        else:
            if want_logprobs:
                kwargs["logprobs"] = top_k
            resp = self.client.completions.create(model=self.model_name, prompt=s.text_, **kwargs)
            text = resp.choices[0].text
        self._account(resp.usage)
        meta = {"finish_reason": resp.choices[0].finish_reason,
                "prompt_tokens": getattr(resp.usage, "prompt_tokens", None),
                "completion_tokens": getattr(resp.usage, "completion_tokens", None)}
        if want_logprobs:
            tokens, tops = api_logprobs(resp.choices[0].logprobs, self.is_chat_model)
            meta["output_token_logprobs"], meta["output_top_logprobs"] = tokens, tops
            if next_token_only:
                text, meta["completion_tokens"], meta["output_token_logprobs"] = "", 0, []
                meta["output_top_logprobs"] = tops[:1]
        return text, meta

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        kwargs = self._request_kwargs(sampling_params)
        if self.is_chat_model:
            stream = self.client.chat.completions.create(model=self.model_name, messages=s.messages_, stream=True,
                                                         stream_options={"include_usage": True}, **kwargs)
        else:
            stream = self.client.completions.create(model=self.model_name, prompt=s.text_, stream=True,
                                                    stream_options={"include_usage": True}, **kwargs)
        meta = {}
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = (choice.delta.content or "") if self.is_chat_model else choice.text
            if choice.finish_reason:
                meta["finish_reason"] = choice.finish_reason
            if piece:
                yield piece, meta
        self._account(usage)
        yield "", meta

    def append_image(self, s, expr) -> None:
        """``image(x)`` in a chat model's message: sent as an ``image_url`` part (a PNG data URL; local files
        are read here, on the program's side) after the message's text, in OpenAI's vision format."""
        if not self.is_chat_model:
            raise NotImplementedError("images through the OpenAI backend need a chat model (message parts)")
        if isinstance(expr, SglVideo):
            raise NotImplementedError("video() through the OpenAI backend is not supported; use image() per frame")
        if s.cur_role is None:
            raise ValueError("image() through the OpenAI backend must be inside a role, e.g. sgl.user(sgl.image(...))")
        s.cur_images.append(image_data_url(expr.path))

    def select(self, s, choices, temperature, choices_method):
        """Completion models. Where the server scores prompts (``echo`` with ``logprobs``, as OpenAI's completion
        API, vLLM and ours do), as the runtime backends select: each choice's tokens after the prefix scored in
        one request, decided by ``choices_method`` (token-length normalised by default), with the same
        meta_info (``input_token_logprobs`` per choice, ``normalized_prompt_logprobs``; token ids None: the
        API sends texts). Otherwise greedy decoding restricted to the choices (upstream's way, which steers
        each token with logit_bias and a client-side tokenizer; here one request constrained by ``regex``)."""
        if self.is_chat_model:
            raise NotImplementedError("select() with an OpenAI chat model is not supported (as upstream): use a "
                                      "completion model (is_chat_model=False) or a runtime backend")
        scored = self._score_choices(s.text_, choices)
        if scored is None:
            return self._select_by_regex(s, choices, temperature)
        choices_method = choices_method or token_length_normalized
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            unconditional = self._score_texts(["".join(e[2] for e in option) for option in scored])
            if unconditional is None:
                raise RuntimeError("select(): the server did not score the choices alone (echo with logprobs)")
        return decide(choices_method, choices, scored, [[] for _ in choices], unconditional)

    def _score_texts(self, texts: list[str]) -> list[list[tuple]] | None:
        """Each text's tokens as (logprob, None, token text), the first logprob None, from one echo request; None
        if the server does not return prompt logprobs."""
        import openai  # the client's errors

        try:
            resp = self.client.completions.create(model=self.model_name, prompt=texts, max_tokens=0, echo=True,
                                                  logprobs=0, temperature=0)
        except openai.BadRequestError:
            return None  # a server that refuses max_tokens=0 or echo with logprobs
        self._account(resp.usage)
        out = [None] * len(texts)
        for choice in resp.choices:
            lp = choice.logprobs
            if lp is None or not lp.tokens or "".join(lp.tokens) != texts[choice.index]:
                return None
            out[choice.index] = list(zip(lp.token_logprobs, [None] * len(lp.tokens), lp.tokens))
        return out if all(o is not None for o in out) else None

    def _score_choices(self, prefix: str, choices: list[str]) -> list[list[tuple]] | None:
        """Each choice's scored tokens after ``prefix`` (None: the server does not score prompts). From two
        tokens before the prefix's end on, as the runtime backends: the prefix's last token may fuse with the
        choice's first characters (token healing), and then it belongs to the choice."""
        texts = self._score_texts([prefix] + [prefix + c for c in choices])
        if texts is None:
            return None
        prefix_tokens = [e[2] for e in texts[0]]
        start = max(len(prefix_tokens) - 2, 0)
        return [choice_entries(entries[start:], prefix_tokens, start, lambda e: e[2]) for entries in texts[1:]]

    def _select_by_regex(self, s, choices, temperature) -> ChoicesDecision:
        pattern = "(" + "|".join(re.escape(c) for c in choices) + ")"
        # A token is at least one byte: 4 tokens a character covers any UTF-8 choice.
        max_tokens = 4 * max(len(c) for c in choices) + 1
        resp = self.client.completions.create(model=self.model_name, prompt=s.text_, max_tokens=max_tokens,
                                              temperature=temperature, extra_body={"regex": pattern})
        self._account(resp.usage)
        text = resp.choices[0].text
        if text not in choices:
            raise RuntimeError(f"select(): the server returned {text!r}, not one of the choices (does it honour "
                               "the regex extension?)")
        return ChoicesDecision(text, {"scores": [int(c == text) for c in choices]})


def api_logprobs(logprobs, chat: bool) -> tuple[list[tuple], list[list[tuple]]]:
    """The API's logprobs of a choice as the runtime backends' ``output_token_logprobs`` and
    ``output_top_logprobs``: (logprob, token id, token text) entries, ids None (the API sends texts)."""
    if logprobs is None:
        return [], []
    if chat:
        items = [(e.logprob, e.token, [(t.logprob, t.token) for t in (e.top_logprobs or [])])
                 for e in (logprobs.content or [])]
    else:
        tops = logprobs.top_logprobs or [None] * len(logprobs.tokens)
        items = [(lp, tok, sorted(((v, t) for t, v in (top or {}).items()), reverse=True))
                 for lp, tok, top in zip(logprobs.token_logprobs, logprobs.tokens, tops)]
    tokens = [(lp, None, tok) for lp, tok, _ in items]
    top_lists = [[(v, None, t) for v, t in top] for _, _, top in items]
    return tokens, top_lists
