"""SiLU-and-mul of the gated MLP: one Triton kernel on the GPU with fused ops, else torch's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernel_options import KernelOptions

try:  # optional: triton (the fused GPU kernels)
    from .attention.triton_ops import fused_ops
except ImportError:
    fused_ops = None


def silu_and_mul(x: torch.Tensor, opts: KernelOptions | None = None) -> torch.Tensor:
    """[T, 2N] (gate | up) -> [T, N] = silu(gate) * up."""
    if opts is not None and opts.fused_ops:
        return fused_ops.silu_and_mul(x, pdl=opts.pdl)
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
