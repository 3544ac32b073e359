"""Model loading: path resolution (aliases, HF dirs, GGUF files, hub ids), configs, weights,
tokenizers, the embedded models (the default SmolLM2, Gemma 3 270M), and tiny dummy models for tests."""

from .embedded import (
    DEFAULT_MODEL,
    GEMMA3_MODEL,
    cache_root,
    default_model_path,
    embedded_gguf_path,
    gemma3_model_path,
    models_cache_dir,
)
from .gguf import convert_gguf_to_hf
from .loader import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    build_dummy_tokenizer,
    check_supported,
    dummy_config,
    gguf_block_types,
    iterate_weights,
    load_config,
    load_hf_reference,
    load_tokenizer,
    resolve_model_path,
    save_dummy_hf_model,
)

__all__ = [
    "DEFAULT_MODEL",
    "GEMMA3_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "build_dummy_tokenizer",
    "cache_root",
    "check_supported",
    "convert_gguf_to_hf",
    "default_model_path",
    "dummy_config",
    "embedded_gguf_path",
    "gemma3_model_path",
    "gguf_block_types",
    "iterate_weights",
    "load_hf_reference",
    "load_config",
    "load_tokenizer",
    "models_cache_dir",
    "resolve_model_path",
    "save_dummy_hf_model",
]
