"""Matrix-vector product for one-token batches: y[1, N] = x[1, K] @ W[N, K]^T (an ``nn.Linear`` weight).

At batch 1 a decode step is nothing but reading the weights once; this kernel streams W in [BLOCK_N, BLOCK_K]
tiles (rows contiguous along K, so every load is coalesced), keeps per-lane fp32 partial sums and reduces once
at the end. Used by the fused executor for single-row inputs when it beats cuBLAS on the device (see
benchmarks/bench_gpu.py --only gemv_sweep).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(X + offs_k, mask=mask_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


# (BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMV_CONFIG = [16, 256, 4, 3]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x: [1, K] (contiguous), weight: [N, K] (rows contiguous) -> [1, N] in x's dtype."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    N, K = weight.shape
    block_n, block_k, warps, stages = config or GEMV_CONFIG
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, N, K, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return y
