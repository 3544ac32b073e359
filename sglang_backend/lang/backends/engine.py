"""DSL backend over the in-process Engine (no HTTP in between)."""

from __future__ import annotations

from ..chat_template import get_chat_template, guess_chat_template
from .base import NativeAPIBackend

_ENGINE_ARGS = ("text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                "return_text_in_logprobs", "image_data", "session_id")


class EngineBackend(NativeAPIBackend):
    def __init__(self, engine=None, chat_template: str | None = None, fork_hints: bool = True, **engine_kwargs):
        self.fork_hints = fork_hints  # False: no prefix hints before forks, selects and run_batch (ablation)
        if engine is None:
            from ...runtime.engine import Engine  # deferred: the DSL imports without torch until a backend runs

            engine = Engine(**engine_kwargs)
        self.engine = engine
        if getattr(engine, "mm_processor", None) is not None:
            self.image_token = engine.mm_processor.image_token
        self.chat_template = (get_chat_template(chat_template) if chat_template else
                              guess_chat_template(getattr(engine.tokenizer, "chat_template", None), engine.model_dir))

    def get_model_name(self) -> str:
        """The engine's model directory (upstream's name, as RuntimeEndpoint.get_model_name)."""
        return str(self.engine.model_dir)

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def _kwargs(self, payload: dict) -> dict:
        unknown = set(payload) - set(_ENGINE_ARGS) - {"stream"}
        if unknown:
            raise ValueError(f"unsupported request fields {sorted(unknown)}")
        kwargs = {k: v for k, v in payload.items() if k in _ENGINE_ARGS}
        if "text" in kwargs:
            kwargs["prompt"] = kwargs.pop("text")
        return kwargs

    def _send(self, payload: dict):
        return self.engine.generate(**self._kwargs(payload))

    def _send_stream(self, payload: dict):
        return self.engine.generate(**self._kwargs(payload), stream=True)

    def end_session(self, session_id: str) -> bool:
        return self.engine.end_session(session_id)

    def shutdown(self) -> None:
        self.engine.shutdown()
