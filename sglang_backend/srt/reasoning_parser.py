"""Alias of upstream's ``sglang.srt.reasoning_parser`` (newer upstream: ``sglang.srt.parser.reasoning_parser``):
``ReasoningParser``, which ``separate_reasoning`` builds per call from this module (so a program or test that
patches ``sglang.srt.reasoning_parser.ReasoningParser`` changes the parser the interpreter uses, as upstream's)."""

from ..lang.reasoning import ReasoningParser

__all__ = ["ReasoningParser"]
