"""Reasoning separation: a reasoning model's ``<think>...</think>`` apart from its answer.

Parsers (``--reasoning-parser``, ``PARSERS``):

* ``deepseek-r1``: the chat template opens ``<think>`` in the prompt, so the output starts inside the reasoning:
  everything before ``</think>`` is reasoning (a leading ``<think>`` is dropped too); no ``</think>`` at all
  means the whole output is reasoning (cut off while thinking).
* ``qwen3``: reasoning only when the output starts with ``<think>`` (Qwen3 thinks unless the request sets
  ``chat_template_kwargs={"enable_thinking": false}``, whose template pre-fills an empty think block).

:func:`split_reasoning` splits a whole text; :class:`ReasoningStreamParser` splits deltas, holding back text that
may be the start of a tag. Both are plain (no server state): the DSL's ``separate_reasoning`` reuses them.
"""

from __future__ import annotations

from ..managers.detokenizer_manager import partial_stop_suffix_len

PARSERS = ("none", "deepseek-r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {PARSERS}, got {name!r}")
    return name


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole output: reasoning is None when the output has none."""
    p = ReasoningStreamParser(parser)
    parts = [p.feed(text), p.finish()]
    reasoning = "".join(r for r, _ in parts)
    content = "".join(c for _, c in parts)
    return (reasoning.strip() or None) if p.had_reasoning else None, content


class ReasoningStreamParser:
    """``feed(delta) -> (reasoning_delta, content_delta)``; ``finish()`` flushes what was held back. With the
    ``none`` parser everything is content."""

    def __init__(self, parser: str):
        self.parser = check_parser(parser)
        # "start": before the first non-space output; "think": inside reasoning; "content": after it
        self.state = "think" if parser == "deepseek-r1" else ("start" if parser == "qwen3" else "content")
        self.had_reasoning = parser == "deepseek-r1"
        self.had_text = False  # deepseek-r1: whether the output went past a possible leading <think>
        self.after_close = False  # the answer's leading whitespace (after </think>) is layout, not content
        self.reasoning_started = False  # reasoning text sent (its leading whitespace is layout)
        self.buf = ""

    def _step(self, final: bool) -> tuple[str, str, bool]:
        """One move of the state machine over ``buf``: (reasoning, content, moved on)."""
        if self.state == "content":
            if self.after_close:
                self.buf = self.buf.lstrip()
                self.after_close = not self.buf
            out, self.buf = self.buf, ""
            return "", out, False
        stripped = self.buf.lstrip()
        if self.state == "start" or (self.state == "think" and not self.had_text):
            if stripped.startswith(OPEN):
                self.buf, self.state, self.had_reasoning = stripped[len(OPEN):], "think", True
                self.had_text = True
                return "", "", True
            if not final and (not stripped or OPEN.startswith(stripped)):
                return "", "", False  # may still become <think>
            if self.state == "start":
                self.state = "content"
                return "", "", True
            self.had_text = True
        return self._think_step(final)

    def _think_step(self, final: bool) -> tuple[str, str, bool]:
        """Inside reasoning: text up to ``</think>``; whitespace around the reasoning is layout (held back at
        its end until more reasoning follows)."""
        if not self.reasoning_started:
            self.buf = self.buf.lstrip()
        at = self.buf.find(CLOSE)
        if at >= 0:
            out, self.buf, self.state = self.buf[:at].rstrip(), self.buf[at + len(CLOSE):], "content"
            self.after_close = True
            return out, "", True
        keep = 0 if final else partial_stop_suffix_len(self.buf, [CLOSE])
        out = self.buf[:len(self.buf) - keep]
        out = out.rstrip() if final else out[:len(out.rstrip())]
        self.buf = "" if final else self.buf[len(out):]
        self.reasoning_started = self.reasoning_started or bool(out)
        return out, "", False

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        return self._drain(final=False)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        moved = True
        while moved and self.buf:
            r, c, moved = self._step(final)
            reasoning.append(r)
            content.append(c)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)
