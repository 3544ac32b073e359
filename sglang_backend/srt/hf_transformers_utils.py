"""Alias of upstream's ``sglang.srt.hf_transformers_utils.get_tokenizer`` (programs load the server model's
tokenizer with it, from ``RuntimeEndpoint.get_model_name()``)."""

from __future__ import annotations

from ..runtime.model_loader.loader import load_tokenizer


def get_tokenizer(tokenizer_name: str, *args, **kwargs):
    """sglang_backend.runtime.model_loader.loader.load_tokenizer; upstream's extra positional options
    (tokenizer_mode, ...) are accepted and ignored, keyword options go to ``AutoTokenizer.from_pretrained``."""
    kwargs.pop("tokenizer_mode", None)
    return load_tokenizer(tokenizer_name, **kwargs)
