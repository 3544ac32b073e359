"""Backend interface of the DSL, and the shared logic for backends that speak our native generate API
(the in-process Engine and a server's /generate): text in, text + meta out; select from prompt logprobs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

from ..chat_template import ChatTemplate, guess_chat_template
from ..choices import ChoicesDecision, choice_entries, decide, token_length_normalized
from ..ir import SglSamplingParams, SglVideo


def image_data_url(item):
    """Local files and in-memory images as PNG data URLs (a server does not read the client's files); strings that
    are not local files (data URLs, http URLs, base64) pass through."""
    if isinstance(item, str) and not os.path.isfile(item):
        return item
    from ...runtime.multimodal.image import encode_image_data_url, load_image  # deferred: imports PIL

    return encode_image_data_url(load_image(item, allow_local_media=True))


@dataclass
class TokenUsage:
    """Tokens a backend's calls used (upstream's ``backend.token_usage``, which its speculative-execution examples
    reset and print): prompt and completion tokens as the server counted them, and the number of calls."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    api_calls: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.api_calls = 0

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.api_calls += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens


class BaseBackend:
    supports_stream = True
    fork_hints = True  # send the shared prefix before fork branches / run_batch (ablation switch)

    @property
    def token_usage(self) -> TokenUsage:
        usage = self.__dict__.get("_token_usage")
        if usage is None:
            usage = self.__dict__["_token_usage"] = TokenUsage()
        return usage

    @property
    def endpoint(self):
        """The backend requests go to, an attribute as upstream's ``Runtime.endpoint`` (``runtime.endpoint.
        chat_template = ...``, ``default_backend.endpoint.get_model_name()``): every backend here is its own."""
        return self

    def get_chat_template(self) -> ChatTemplate:
        return getattr(self, "chat_template", None) or guess_chat_template(None, None)

    def cache_prefix(self, prefix_str: str) -> None:
        pass

    def pin_prefix(self, prefix_str: str, session_id: str) -> None:
        """Prefills the prefix and keeps its KV pinned as ``session_id`` until ``unpin_prefix`` (no-op here: a
        backend without KV control)."""

    def unpin_prefix(self, session_id: str) -> None:
        """Ends the session ``pin_prefix`` opened: its KV becomes evictable."""

    def generate(self, s, sampling_params: SglSamplingParams) -> tuple[str, dict]:
        raise NotImplementedError

    def generate_stream(self, s, sampling_params: SglSamplingParams) -> Iterator[tuple[str, dict]]:
        text, meta = self.generate(s, sampling_params)
        yield text, meta

    def generate_n(self, s, sampling_params: SglSamplingParams, n: int) -> tuple[list[str], list[dict]]:
        outs = [self.generate(s, sampling_params) for _ in range(n)]
        return [t for t, _ in outs], [m for _, m in outs]

    def select(self, s, choices: list[str], temperature: float, choices_method) -> ChoicesDecision:
        raise NotImplementedError

    def append_image(self, s, expr) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not take images")

    def shutdown(self) -> None:
        pass


class NativeAPIBackend(BaseBackend):
    """Subclasses implement ``_send(payload) -> dict | list[dict]`` (our /generate request and response
    shapes), ``_send_stream(payload) -> iterator of dicts`` and ``tokenize(text)``; ``_call`` and ``_stream`` send
    through them and count the tokens each request used (``token_usage``)."""

    image_token = "<image>"  # the LLaVA placeholder; the runtime maps it to the model's image token

    def append_image(self, s, expr) -> None:
        """``image(x)`` adds one placeholder; ``video(path, n)`` adds n, one per evenly sampled frame."""
        if isinstance(expr, SglVideo):
            from ...runtime.multimodal.video import load_video_frames  # deferred: the runtime imports torch

            frames = load_video_frames(expr.path, expr.num_frames)
        else:
            frames = [expr.path]
        s.images_.extend(frames)
        s._append(self.image_token * len(frames))

    def _encode_images(self, images: list) -> list:
        return images  # in-process: paths, bytes and PIL images go as they are

    def _image_fields(self, s, n: int | None = None) -> dict:
        if not s.images_:
            return {}
        images = self._encode_images(list(s.images_))
        return {"image_data": images if n is None else [images] * n}

    def _send(self, payload: dict):
        raise NotImplementedError

    def _send_stream(self, payload: dict):
        raise NotImplementedError

    def _count(self, out: dict) -> None:
        meta = out.get("meta_info", {})
        self.token_usage.add(meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0))

    def _call(self, payload: dict):
        out = self._send(payload)
        for one in out if isinstance(out, list) else [out]:
            self._count(one)
        return out

    def _stream(self, payload: dict):
        for chunk in self._send_stream(payload):
            if chunk.get("meta_info", {}).get("finish_reason") is not None:
                self._count(chunk)  # the last chunk's meta_info has the request's totals
            yield chunk

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    @staticmethod
    def _logprob_fields(p: SglSamplingParams) -> dict:
        fields = {}
        if p.return_logprob:
            fields["return_logprob"] = True
            if p.logprob_start_len is not None:
                fields["logprob_start_len"] = p.logprob_start_len
            if p.top_logprobs_num:
                fields["top_logprobs_num"] = p.top_logprobs_num
            if p.return_text_in_logprobs:
                fields["return_text_in_logprobs"] = True
        return fields

    def cache_prefix(self, prefix_str: str, session_id: str | None = None) -> None:
        # A prefix with image placeholders needs its images; without them the hint is skipped (the first
        # branch then caches the shared prefix, image included, for the others).
        if prefix_str and self.image_token not in prefix_str:
            self._call({"text": prefix_str, "sampling_params": {"max_new_tokens": 0},
                        **({"session_id": session_id} if session_id else {})})

    def pin_prefix(self, prefix_str: str, session_id: str) -> None:
        self.cache_prefix(prefix_str, session_id)  # a finished request of a session leaves its KV pinned

    def unpin_prefix(self, session_id: str) -> None:
        self.end_session(session_id)

    def end_session(self, session_id: str) -> bool:
        raise NotImplementedError

    def generate(self, s, sampling_params: SglSamplingParams) -> tuple[str, dict]:
        out = self._call({"text": s.text_, "sampling_params": sampling_params.to_runtime_params(),
                          **self._logprob_fields(sampling_params), **self._image_fields(s)})
        return out["text"], out["meta_info"]

    def generate_n(self, s, sampling_params: SglSamplingParams, n: int):
        outs = self._call({"text": [s.text_] * n, "sampling_params": sampling_params.to_runtime_params(),
                           **self._logprob_fields(sampling_params), **self._image_fields(s, n)})
        return [o["text"] for o in outs], [o["meta_info"] for o in outs]

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        meta = None
        for chunk in self._stream({"text": s.text_, "sampling_params": sampling_params.to_runtime_params(),
                                   "stream": True, **self._logprob_fields(sampling_params), **self._image_fields(s)}):
            meta = chunk["meta_info"]
            if chunk["text"]:
                yield chunk["text"], meta
        if meta is not None:
            yield "", meta

    def select(self, s, choices: list[str], temperature: float, choices_method) -> ChoicesDecision:
        choices_method = choices_method or token_length_normalized
        if s.images_:
            raise NotImplementedError("select() after image()/video() is not supported (it scores prompt "
                                      "logprobs, which requests with images do not return); use gen with a regex")
        prefix_ids = self.tokenize(s.text_)
        # Prefill the shared prefix once; every choice then extends it from the cache.
        if self.fork_hints:
            self.cache_prefix(s.text_)
        # Score from two tokens before the end of the prefix: the prefix's last token may fuse with the
        # choice's first characters (token healing), and then it belongs to the choice.
        start = max(len(prefix_ids) - 2, 0)
        outs = self._call({"text": [s.text_ + c for c in choices], "sampling_params": {"max_new_tokens": 0},
                           "return_logprob": True, "logprob_start_len": start, "return_text_in_logprobs": True})
        input_token_logprobs = [choice_entries(o["meta_info"]["input_token_logprobs"], prefix_ids, start,
                                               lambda e: e[1]) for o in outs]
        output_token_logprobs = [o["meta_info"].get("output_token_logprobs", []) for o in outs]
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            ids = [[e[1] for e in option] for option in input_token_logprobs]
            unc = self._call({"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                              "logprob_start_len": 0, "return_text_in_logprobs": True})
            unconditional = [o["meta_info"]["input_token_logprobs"] for o in unc]
        return decide(choices_method, choices, input_token_logprobs, output_token_logprobs, unconditional)
