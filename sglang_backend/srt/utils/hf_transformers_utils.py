"""Alias of upstream's ``sglang.srt.utils.hf_transformers_utils`` (where newer upstream keeps ``get_tokenizer``)."""

from __future__ import annotations

from ..hf_transformers_utils import get_tokenizer

__all__ = ["get_tokenizer"]
