"""Gated MLP activations: SiLU-and-mul (one Triton kernel on the GPU with fused ops, else torch's reference) and
Gemma's GELU(tanh)-and-mul (torch)."""

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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2N] (gate | up) -> [T, N] = gelu_tanh(gate) * up (Gemma's GeGLU; HF's "gelu_pytorch_tanh"). Torch
    only: two elementwise kernels on the GPU, rounded as HF's separate ops are."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
