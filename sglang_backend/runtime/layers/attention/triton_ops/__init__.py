"""Triton kernels for the GPU path: paged attention (extend, decode) and the fused per-layer ops of the
Llama-family decoder (RMSNorm with residual add, rotary + KV store, SiLU-and-mul).

Importing this package needs ``triton``; nothing here runs on the CPU except under ``TRITON_INTERPRET=1``.
"""

from .decode_attention import decode_attention_fwd
from .extend_attention import extend_attention_fwd
from .fused_ops import fused_add_rmsnorm, rmsnorm, rope_and_store_kv, silu_and_mul, store_kv

__all__ = [
    "decode_attention_fwd",
    "extend_attention_fwd",
    "fused_add_rmsnorm",
    "rmsnorm",
    "rope_and_store_kv",
    "silu_and_mul",
    "store_kv",
]
