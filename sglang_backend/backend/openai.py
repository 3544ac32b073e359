"""Alias of upstream's older ``sglang.backend.openai`` (today ``sglang.lang.backend.openai``)."""

from ..lang.backend.openai import OpenAI, TokenUsage

__all__ = ["OpenAI", "TokenUsage"]
