"""``separate_reasoning``'s splitter: the server's reasoning parser (``--reasoning-parser``), reused as is, under
the model-type names upstream programs pass (``model_type="deepseek-r1"``, ``"qwen3"``, ...)."""

from __future__ import annotations

from ..runtime.entrypoints.reasoning import PARSERS, ReasoningStreamParser, split_reasoning

# Upstream model types that write <think>...</think> like one of our parsers: "starts inside the reasoning"
# (deepseek-r1) or "reasoning only after a leading <think>" (qwen3).
MODEL_TYPE_ALIASES = {
    "deepseek-v3": "qwen3",
    "qwen3-thinking": "deepseek-r1",
    "glm45": "qwen3",
    "step3": "deepseek-r1",
}


def parser_for(model_type: str | None) -> str:
    if not model_type:
        raise ValueError("separate_reasoning needs model_type (e.g. \"deepseek-r1\" or \"qwen3\")")
    name = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if name not in PARSERS:
        known = sorted(set(PARSERS) | set(MODEL_TYPE_ALIASES))
        raise ValueError(f"separate_reasoning: unknown model_type {model_type!r} (known: {known})")
    return name


def separate(text: str, model_type: str | None) -> tuple[str, str]:
    """``(reasoning, answer)``; reasoning is "" when the text has none (as upstream's parse_non_stream)."""
    reasoning, content = split_reasoning(text, parser_for(model_type))
    return reasoning or "", content


class ReasoningParser:
    """Upstream's ``ReasoningParser(model_type)`` shape over the server's parsers: ``parse_non_stream(text)`` ->
    ``(reasoning, normal_text)`` (reasoning "" when there is none); ``parse_stream_chunk(delta)`` -> the two
    deltas of a streamed output. An unknown or missing model type is a ValueError, as upstream's."""

    def __init__(self, model_type: str | None, stream_reasoning: bool = True):
        self.model_type = model_type
        self.parser = parser_for(model_type)
        self._stream = ReasoningStreamParser(self.parser)

    def parse_non_stream(self, full_text: str) -> tuple[str, str]:
        return separate(full_text, self.model_type)

    def parse_stream_chunk(self, chunk_text: str) -> tuple[str, str]:
        return self._stream.feed(chunk_text)
