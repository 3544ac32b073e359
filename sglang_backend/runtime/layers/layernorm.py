"""RMSNorm, optionally with the residual add before it (``forward(x, residual)``), as one Triton kernel on the GPU
when the batch's kernel options turn fused ops on, else HF's reference arithmetic in torch."""

from __future__ import annotations

import torch
from torch import nn

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
        if residual is None:
            return self._reference(x)
        residual = residual + x
        return self._reference(residual), residual

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
