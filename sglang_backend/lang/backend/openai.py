"""Alias of upstream's ``sglang.lang.backend.openai``."""

from ..backends.openai import OpenAI, TokenUsage

__all__ = ["OpenAI", "TokenUsage"]
