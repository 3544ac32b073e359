"""sglang_backend: fast LM programs (RadixAttention, cache-aware scheduling, constrained decoding, a DSL)."""

from .runtime.sampling_params import SamplingParams
from .runtime.server_args import ServerArgs

__version__ = "0.1.0"


def __getattr__(name):
    # Heavy imports (torch, transformers) only when the engine is used.
    if name == "Engine":
        from .runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang_backend' has no attribute {name!r}")


__all__ = ["Engine", "SamplingParams", "ServerArgs"]
