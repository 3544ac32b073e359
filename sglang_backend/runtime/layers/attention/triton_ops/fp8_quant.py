"""Per-row (per-token) FP8 quantization of activations: one program per row finds the row's amax, then writes
``e4m3(x / s)`` with ``s = amax * fp32(1/448)``, as ``layers.fp8.quantize_rows_reference`` (IEEE division of x
by s, so the two agree bit for bit)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # constexpr: a kernel may read module globals only in this form
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # the scale is amax * fp32(1/448), as torch divides by a scalar
MIN_SCALE = tl.constexpr(1e-12 / 448.0)


@triton.jit
def _quantize_rows_kernel(X, Y, S, K, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    s = tl.maximum(tl.max(amax, 0) * INV_FP8_MAX, MIN_SCALE)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.full(x.shape, 0.0, tl.float32) + s), -FP8_MAX), FP8_MAX)
        tl.store(Y + row * stride_y + k0 + offs, q.to(Y.dtype.element_ty), mask=mask)
    tl.store(S + row, s)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (rows contiguous) -> (float8_e4m3fn [M, K], fp32 scales [M, 1])."""
    assert x.dim() == 2 and x.stride(-1) == 1
    M, K = x.shape
    y = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        block = min(triton.next_power_of_2(K), 2048)
        _quantize_rows_kernel[(M,)](x, y, s, K, x.stride(0), y.stride(0), BLOCK=block,
                                    num_warps=4 if block <= 1024 else 8)
    return y, s
