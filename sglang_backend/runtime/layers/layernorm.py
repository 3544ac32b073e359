"""RMSNorm, optionally with the residual add before it (``forward(x, residual)``), as one Triton kernel on the GPU
when the batch's kernel options turn fused ops on, one C kernel on the CPU when they turn ``native_cpu`` on (float32),
else HF's reference arithmetic in torch; and Gemma's ``(1 + w)``
variant (``GemmaRMSNorm``, torch only); ``head_rmsnorm`` normalises each head of q and k (Qwen3)."""

from __future__ import annotations

import torch
from torch import nn

from . import native
from .kernel_options import KernelOptions

try:  # optional: triton (the fused GPU kernels)
    from .attention.triton_ops import fused_ops
except ImportError:
    fused_ops = None


class RMSNorm(nn.Module):
    """Same arithmetic as HF's LlamaRMSNorm (normalise in fp32, cast back, then scale) so outputs match."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, opts: KernelOptions | None = None):
        """``norm(x)``; with ``residual``: ``residual = residual + x`` and returns ``(norm(residual), residual)``
        (the fused kernel updates ``residual`` in place, rounded to its dtype as ``residual + x`` is)."""
        if opts is not None and opts.fused_ops:
            if residual is None:
                return fused_ops.rmsnorm(x, self.weight, self.eps, pdl=opts.pdl)
            return fused_ops.fused_add_rmsnorm(x, residual, self.weight, self.eps, pdl=opts.pdl), residual
        if opts is not None and opts.native_cpu and x.dtype == torch.float32:
            return self._native(x, residual)
        if residual is None:
            return self._reference(x)
        residual = residual + x
        return self._reference(residual), residual

    def _native(self, x: torch.Tensor, residual: torch.Tensor | None):
        x = x.contiguous()
        if residual is not None:  # a new tensor, as the reference's residual + x (the kernel adds in place)
            residual = residual.clone(memory_format=torch.contiguous_format)
        out = torch.empty_like(x)
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        native.kernels().rmsnorm(x.data_ptr(), None if residual is None else residual.data_ptr(), self.weight.data_ptr(),
                                 rows, x.shape[-1], self.eps, out.data_ptr(), torch.get_num_threads())
        return out if residual is None else (out, residual)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from one (``x_normed * (1 + w)``, zeros are the identity) and
    the scaling happens in fp32 before the one cast back, as HF's Gemma3RMSNorm does (Llama's casts first).
    Always the torch reference: the fused Llama kernels round differently."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def head_rmsnorm(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int,
                 head_dim: int, opts: KernelOptions | None = None) -> torch.Tensor:
    """Each head of q and of k in the fused projection's output [T, (H + 2 Hkv) * D] RMS-normalised (weights over
    head_dim, shared by the heads), v unchanged: in place in one kernel with fused ops, else the torch reference."""
    if opts is not None and opts.fused_ops:
        return fused_ops.head_rmsnorm_(qkv, q_norm.weight, k_norm.weight, num_heads, num_kv_heads, head_dim,
                                       q_norm.eps, pdl=opts.pdl)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q_norm(q.reshape(-1, head_dim)).reshape(q.shape)
    k = k_norm(k.reshape(-1, head_dim)).reshape(k.shape)
    return torch.cat([q, k, v], dim=-1)
