"""One attention layer over the paged KV pool: rotary on the new tokens' q and k, their K/V into the pool, then
the batch's attention backend.

With fused kernels on (the batch's kernel options, CUDA) rotary and the KV store are one Triton kernel, in place
on the qkv projection's output, when the backend lets the model store K/V itself
(``AttentionBackend.supports_fused_kv_store``); else rotary alone and the backend stores. On the CPU with the native
kernels (``native_cpu``) the same happens in one C call (``native/rope_store.c``). At batch 1 with the
``fused_rope`` GEMV mode the qkv GEMV does both in its epilogue (``rope_store``; the layer is then told
``rotated``).

``sliding_window`` W (None: global attention) makes the layer local: the query at position i sees the keys at
positions i - W < j <= i, the last W tokens including itself (HF's rule: ``kv_idx > q_idx - sliding_window``).
Every backend enforces it (torch_native: the mask; triton: the kernels skip and mask keys outside it; flashinfer:
``window_left = W - 1``). The KV pool and the radix cache still keep every token's K/V in every layer.
``logit_cap`` (None: none): attention scores become ``cap * tanh(scores / cap)`` (Gemma 2 style softcapping;
torch_native and flashinfer).
"""

from __future__ import annotations

import torch
from torch import nn

from . import native
from .kernel_options import DEFAULT_OPTIONS
from .rotary_embedding import RopeBatch, apply_rotary

try:  # optional: triton (the fused GPU kernels)
    from .attention.triton_ops.fused_ops import rope_and_store_kv
    from .attention.triton_ops.gemv import RopeStore
except ImportError:
    rope_and_store_kv = RopeStore = None


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 sliding_window: int | None = None, logit_cap: float | None = None):
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap or None
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim

    def forward(self, q, k, v, forward_batch, save_kv: bool = True):
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv)

    def _native_rope_store(self, qkv: torch.Tensor, rope: RopeBatch, out_cache_loc=None, k_buf=None, v_buf=None):
        """The CPU's C kernel: q and k rotated in place in ``qkv``; with the buffers, k and v stored too."""
        if not qkv.is_contiguous() or qkv.dtype != torch.float32:
            raise TypeError("the native rotary kernel takes a contiguous float32 qkv")
        positions = rope.positions.to(torch.int64).contiguous()
        loc = out_cache_loc.to(torch.int64).contiguous() if out_cache_loc is not None else None
        native.kernels().rope_store_kv(qkv.data_ptr(), qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim,
                                       positions.data_ptr(), rope.table.data_ptr(),
                                       None if loc is None else loc.data_ptr(),
                                       None if k_buf is None else k_buf.data_ptr(),
                                       None if v_buf is None else v_buf.data_ptr(), torch.get_num_threads())

    def _kv_store(self, fb) -> tuple:
        """Where the fused kernels write this layer's new K/V: (slots, K buffer, V buffer)."""
        pool = fb.token_to_kv_pool
        return fb.out_cache_loc, pool.get_key_buffer(self.layer_id), pool.get_value_buffer(self.layer_id)

    def rope_store(self, rope: RopeBatch, fb):
        """For the qkv GEMV of one token: rotary + KV store in its epilogue (gemv.RopeStore), or None where the
        backend stores K/V itself."""
        if not fb.attn_backend.supports_fused_kv_store:
            return None
        return RopeStore(rope.positions, rope.table, self.num_heads, self.num_kv_heads, self.head_dim,
                         *self._kv_store(fb))

    def forward_qkv(self, qkv: torch.Tensor, rope: RopeBatch, fb, rotated: bool = False,
                    qk_norm: tuple | None = None) -> torch.Tensor:
        """qkv: [T, q_size + 2 * kv_size], the fused projection's output -> attention output [T, q_size].
        ``qk_norm`` (fused rotary only): per-head q/k RMSNorm (q weight, k weight, eps) inside the rotary kernel."""
        if rope.table is None:  # the reference: torch rotary, the backend stores K/V
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(q.reshape(-1, self.num_heads, self.head_dim), rope.cos, rope.sin).reshape(-1, self.q_size)
            k = apply_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), rope.cos, rope.sin).reshape(-1, self.kv_size)
            return self(q, k, v, fb)
        store = fb.attn_backend.supports_fused_kv_store
        if not rotated:
            opts = fb.kernel_options or DEFAULT_OPTIONS
            if opts.native_cpu:
                self._native_rope_store(qkv, rope, *(self._kv_store(fb) if store else ()))
            else:
                rope_and_store_kv(qkv, rope.positions, rope.table, self.num_heads, self.num_kv_heads, self.head_dim,
                                  *(self._kv_store(fb) if store else ()), qk_norm=qk_norm, pdl=opts.pdl)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self(q, k, v, fb, save_kv=not store)
