"""sglang_backend: fast LM programs (RadixAttention, cache-aware scheduling, constrained decoding, a DSL).

The DSL keeps upstream SGLang's names: ``import sglang_backend as sgl`` runs programs written for
``import sglang as sgl``.
"""

import importlib

from .lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    commit_lazy_operations,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from .lang.global_config import global_config
from .lang.choices import greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized
from .runtime.sampling_params import SamplingParams
from .runtime.server_args import ServerArgs

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("sglang_backend.runtime.engine", "Engine"),
    "EngineBackend": ("sglang_backend.lang.backends.engine", "EngineBackend"),
    "RuntimeEndpoint": ("sglang_backend.lang.backends.runtime_endpoint", "RuntimeEndpoint"),
    "Runtime": ("sglang_backend.lang.backends.runtime_endpoint", "Runtime"),
    "OpenAI": ("sglang_backend.lang.backends.openai", "OpenAI"),
}


def __getattr__(name):
    # Heavy imports (torch, transformers, requests) only when used.
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'sglang_backend' has no attribute {name!r}")


__all__ = [
    "Engine", "EngineBackend", "OpenAI", "Runtime", "RuntimeEndpoint", "SamplingParams", "ServerArgs",
    "assistant", "assistant_begin", "assistant_end", "commit_lazy_operations", "flush_cache", "function", "gen",
    "gen_int", "gen_string", "get_default_backend", "get_server_info", "global_config", "greedy_token_selection",
    "image", "select", "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]
