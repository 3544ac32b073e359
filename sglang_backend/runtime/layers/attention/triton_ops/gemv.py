"""Matrix-vector product for one-token batches: y[1, N] = x[1, K] @ W[N, K]^T (an ``nn.Linear`` weight).

At batch 1 a decode step is nothing but reading the weights once; this kernel streams W in [BLOCK_N, BLOCK_K]
tiles (rows contiguous along K, so every load is coalesced), keeps per-lane fp32 partial sums and reduces once
at the end. The linear layers (layers/linear.py) use it for single-row inputs (benchmarks/bench_gpu.py ``runner``).

Optional fusions remove the small kernels around each linear of a Llama layer, with the same roundings as the
unfused kernels in fused_ops.py:

* ``norm_weight``: x is the residual stream and the GEMV multiplies RMSNorm(x) * norm_weight instead (every
  program computes the fp32 sum of squares of the 1-row x itself: a few KB from L2);
* ``silu_mul``: W holds [gate; up] (2N rows); y = silu(x @ gate^T) * (x @ up^T);
* ``residual``: y is added into ``residual`` in place (each program owns its output columns) and returned;
* ``rope``: W is the fused qkv projection; each program computes rows f and f + head_dim/2 of one head, rotates
  them (q, k) and also writes k and v into the KV pool (the rope_and_store_kv kernel folded in).

``weight_scale``: W is FP8 (e4m3, layers/fp8.py) with one fp32 scale per row; each row's sum is multiplied by
its scale before the bias (the activation stays unquantized: at batch 1 only the weight bytes matter).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ...kernel_options import KernelConfigs
from . import pdl as _pdl
from .pdl import pdl_begin


@triton.jit
def _load_x(X, NW, offs_k, mask_k, rstd, NORM: tl.constexpr):
    x = tl.load(X + offs_k, mask=mask_k, other=0.0)
    if NORM:  # as _rmsnorm_kernel: normalised in fp32, rounded, times the weight, rounded
        y = (x.to(tl.float32) * rstd).to(X.dtype.element_ty)
        w = tl.load(NW + offs_k, mask=mask_k, other=0.0)
        x = (y.to(tl.float32) * w.to(tl.float32)).to(X.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(X, W, B, Y, NW, WS, N, K, stride_w, eps,
                 Positions, CosSin, Loc, KBuf, VBuf, stride_cs, stride_kt, stride_kh, stride_vt, stride_vh,
                 HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr, ADD_TO_Y: tl.constexpr,
                 ROPE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    if ROPE:  # rows f and f + HEAD_DIM/2 of one head (rotate-half partners) in the same program
        HALF = HEAD_DIM // 2
        head = pid // (HALF // BLOCK_N)
        offs_f = (pid % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = head * HEAD_DIM + offs_f
        pair = offs_n + HALF
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        pair = offs_n + N  # the "up" rows when SILU_MUL
    mask_n = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_w
    u_rows = W + pair.to(tl.int64)[:, None] * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    pdl_begin(PDL)

    rstd = 1.0
    if NORM:
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            r = tl.load(X + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            sq += r * r
        rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)

    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SILU_MUL or ROPE:
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mk = ks < K
        m = mask_n[:, None] & mk[None, :]
        w = tl.load(w_rows + ks[None, :], mask=m, other=0.0)
        if SILU_MUL or ROPE:
            u = tl.load(u_rows + ks[None, :], mask=m, other=0.0)
        x = _load_x(X, NW, ks, mk, rstd, NORM)
        acc += w.to(tl.float32) * x[None, :]
        if SILU_MUL or ROPE:
            acc_u += u.to(tl.float32) * x[None, :]

    y = tl.sum(acc, 1)
    if HAS_SCALE:
        y *= tl.load(WS + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SILU_MUL:  # as _silu_and_mul_kernel on the rounded gate/up outputs
        g = y.to(Y.dtype.element_ty).to(tl.float32)
        up = tl.sum(acc_u, 1)
        if HAS_SCALE:
            up *= tl.load(WS + N + offs_n, mask=mask_n, other=0.0)
        if HAS_BIAS:
            up += tl.load(B + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        up = up.to(Y.dtype.element_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32) * up
    if ADD_TO_Y:  # residual add, rounded like ``hidden + out``
        r = tl.load(Y + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = y.to(Y.dtype.element_ty).to(tl.float32) + r
    if ROPE:  # as _rope_store_kernel, on the rounded qkv outputs of the one token
        y2 = tl.sum(acc_u, 1)
        if HAS_SCALE:
            y2 *= tl.load(WS + pair)
        if HAS_BIAS:
            y2 += tl.load(B + pair).to(tl.float32)
        x1 = y.to(Y.dtype.element_ty).to(tl.float32)
        x2 = y2.to(Y.dtype.element_ty).to(tl.float32)
        pos = tl.load(Positions).to(tl.int64)
        cos = tl.load(CosSin + pos * stride_cs + offs_f)
        sin = tl.load(CosSin + pos * stride_cs + HALF + offs_f)
        rotate = head < NUM_HEADS + NUM_KV_HEADS  # q and k heads; v is stored as it is
        r1 = tl.where(rotate, x1 * cos - x2 * sin, x1).to(Y.dtype.element_ty)
        r2 = tl.where(rotate, x2 * cos + x1 * sin, x2).to(Y.dtype.element_ty)
        tl.store(Y + offs_n, r1)
        tl.store(Y + pair, r2)
        loc = tl.load(Loc).to(tl.int64)
        if head >= NUM_HEADS + NUM_KV_HEADS:
            dv = VBuf + loc * stride_vt + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vh + offs_f
            tl.store(dv, r1.to(VBuf.dtype.element_ty))
            tl.store(dv + HALF, r2.to(VBuf.dtype.element_ty))
        elif head >= NUM_HEADS:
            dk = KBuf + loc * stride_kt + (head - NUM_HEADS) * stride_kh + offs_f
            tl.store(dk, r1.to(KBuf.dtype.element_ty))
            tl.store(dk + HALF, r2.to(KBuf.dtype.element_ty))
    else:
        tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


# Launch configs (BLOCK_N, BLOCK_K, num_warps, num_stages) come from the caller's KernelConfigs (tuned per device,
# see layers/kernel_options.py); the defaults are the H100 winners of bench_gpu's gemv_step_sweep.
_DEFAULT_CONFIGS = KernelConfigs()


@dataclasses.dataclass
class RopeStore:
    """What the qkv GEMV of one token needs to also apply rotary to q and k (neox, ``cos_sin`` as in
    fused_ops.rope_and_store_kv) and write k and v into the KV pool slot ``loc``."""
    positions: torch.Tensor  # [1]
    cos_sin: torch.Tensor  # [max_pos, head_dim]: cos | sin
    num_heads: int
    num_kv_heads: int
    head_dim: int
    loc: torch.Tensor  # [1]
    k_buf: torch.Tensor  # [slots, num_kv_heads, head_dim]
    v_buf: torch.Tensor


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None, *, norm_weight: torch.Tensor | None = None,
         eps: float = 1e-6, silu_mul: bool = False, residual: torch.Tensor | None = None,
         rope: RopeStore | None = None, weight_scale: torch.Tensor | None = None,
         configs: KernelConfigs | None = None, pdl: bool = False) -> torch.Tensor:
    """x: [1, K] (contiguous), weight: [N, K] (rows contiguous) -> [1, N] in x's dtype ([1, N/2] with
    ``silu_mul``; ``residual`` itself, updated in place, when given). With ``rope`` the weight is a fused
    qkv projection: q and k come out rotated, and k and v are also stored in the KV pool. ``weight_scale``
    ([rows] fp32): the weight is FP8 with these per-row scales."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    N, K = weight.shape
    assert x.shape[1] == K, f"gemv: x has {x.shape[1]} features, weight expects {K}"
    assert not (silu_mul and rope) and not (residual is not None and rope)
    if silu_mul:
        assert N % 2 == 0
        N //= 2
    if norm_weight is not None:
        assert norm_weight.shape == (K,) and norm_weight.stride(-1) == 1
    if residual is not None:
        assert residual.shape == (1, N) and residual.stride(-1) == 1 and residual.dtype == x.dtype
        y = residual
    else:
        y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    if weight_scale is not None:
        assert weight_scale.shape == (weight.shape[0],) and weight_scale.dtype == torch.float32
    block_n, block_k, warps, stages = config or (configs or _DEFAULT_CONFIGS).gemv_config(
        weight.shape[0], K, silu_mul, fp8=weight_scale is not None)
    grid = triton.cdiv(N, block_n)
    r = rope
    if r is not None:
        half = r.head_dim // 2
        assert N == (r.num_heads + 2 * r.num_kv_heads) * r.head_dim
        assert r.k_buf.stride(-1) == 1 and r.v_buf.stride(-1) == 1 and r.cos_sin.stride(-1) == 1
        block_n = max(1, min(block_n // 2, half))  # each program computes block_n row pairs
        while half % block_n:
            block_n //= 2
        grid = (N // r.head_dim) * (half // block_n)
    _gemv_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, y, norm_weight if norm_weight is not None else x,
        weight_scale if weight_scale is not None else x, N, K, weight.stride(0), eps,
        *((r.positions, r.cos_sin, r.loc, r.k_buf, r.v_buf, r.cos_sin.stride(0), r.k_buf.stride(0),
           r.k_buf.stride(1), r.v_buf.stride(0), r.v_buf.stride(1)) if r is not None else (x,) * 5 + (0,) * 5),
        HAS_BIAS=bias is not None, HAS_SCALE=weight_scale is not None, NORM=norm_weight is not None, SILU_MUL=silu_mul, ADD_TO_Y=residual is not None,
        ROPE=r is not None, NUM_HEADS=r.num_heads if r else 0, NUM_KV_HEADS=r.num_kv_heads if r else 0,
        HEAD_DIM=r.head_dim if r else 2,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **_pdl.launch_args(x, pdl),
    )
    return y
