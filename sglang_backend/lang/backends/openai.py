"""DSL backend over any OpenAI-compatible ``/v1`` server (ours included), with API speculative execution.

Speculative execution (``@function(num_api_spec_tokens=N)``, completion models): the first ``gen``
over-generates N tokens without its stop; the following constant text and ``gen``s are matched against that
speculated text, so a multi-field template often costs one API call instead of one per field. When the
model strays from the template, the speculation is dropped and a fresh call is made. Chat models: an assistant
turn's texts and gens are matched against one chat completion at the end of the turn (lang/speculative.py).

``select`` (completion models) and ``image`` (chat models) are supported too; see those methods.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..chat_template import get_chat_template, guess_chat_template
from ..choices import ChoicesDecision
from ..ir import SglSamplingParams, SglVideo
from .base import BaseBackend, image_data_url


@dataclass
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    api_calls: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.api_calls = 0


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
        self.token_usage = TokenUsage()

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
        self.token_usage.api_calls += 1
        if usage is not None:
            self.token_usage.prompt_tokens += usage.prompt_tokens
            self.token_usage.completion_tokens += usage.completion_tokens

    def generate(self, s, sampling_params: SglSamplingParams) -> tuple[str, dict]:
        kwargs = self._request_kwargs(sampling_params)
        if self.is_chat_model:
            prefix = self.chat_template.get_prefix_and_suffix("assistant")[0]
            if not s.text_.endswith(prefix):
                raise RuntimeError("with an OpenAI chat model, gen() must come right after assistant begins "
                                   "(the API continues whole messages, not arbitrary text)")
            resp = self.client.chat.completions.create(model=self.model_name, messages=s.messages_, **kwargs)
            text = resp.choices[0].message.content or ""
        else:
            resp = self.client.completions.create(model=self.model_name, prompt=s.text_, **kwargs)
            text = resp.choices[0].text
        self._account(resp.usage)
        meta = {"finish_reason": resp.choices[0].finish_reason,
                "prompt_tokens": getattr(resp.usage, "prompt_tokens", None),
                "completion_tokens": getattr(resp.usage, "completion_tokens", None)}
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
        """Completion models: greedy decoding restricted to the choices, as upstream's (which steers each token
        with logit_bias and a client-side tokenizer); here one request constrained by ``regex`` (servers that take
        it, such as ours), so no tokenizer is needed. ``choices_method`` needs prompt logprobs, which the API
        does not return: it is ignored, as upstream's OpenAI backend does."""
        if self.is_chat_model:
            raise NotImplementedError("select() with an OpenAI chat model is not supported (as upstream): use a "
                                      "completion model (is_chat_model=False) or a runtime backend")
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
