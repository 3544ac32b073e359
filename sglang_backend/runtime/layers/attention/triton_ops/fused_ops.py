"""Fused element-wise kernels of the Llama-family decoder layer (one launch each instead of 5-10 torch ops).

At batch 1 a decode step is ~10 kernels per layer; every small torch op (casts, pow, mean, rsqrt, cat for
rotate_half, index_put for the KV store) costs a few microseconds of a ~140 us layer, so they are fused here.
The arithmetic follows the reference modules (layers/layernorm.py, rotary_embedding.py, models/llama.py):

* RMSNorm: fp32 normalisation, cast to the activation dtype, then times the weight (rounded in that dtype);
* residual add: rounded in the activation dtype, as ``hidden + out`` does;
* SiLU-and-mul: silu rounded to the dtype, then times ``up`` (rounded);
* rotary: neox-style (rotate_half) with fp32 cos/sin, rounded once (the reference rounds cos/sin and each
  product to the dtype; the difference is within one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl as _pdl
from .pdl import pdl_begin


# RMSNorm (+ residual) -------------------------------------------------------------------------------------------
@triton.jit
def _rmsnorm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, N, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(R.dtype.element_ty)
        tl.store(R + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    y = (xf * (1.0 / tl.sqrt(var + eps))).to(Y.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    out = (y.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + offs, out, mask=mask)


def _norm_warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """[T, N] -> [T, N] in x's dtype."""
    assert x.dim() == 2 and x.stride(-1) == 1
    T, N = x.shape
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    block = triton.next_power_of_2(N)
    _rmsnorm_kernel[(T,)](x, x, weight, y, x.stride(0), x.stride(0), y.stride(0), N, eps,
                          HAS_RESIDUAL=False, BLOCK=block, num_warps=_norm_warps(block), **_pdl.launch_args(x, pdl))
    return y


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      pdl: bool = False) -> torch.Tensor:
    """``residual += x`` (in place, rounded to its dtype); returns ``rmsnorm(residual)``."""
    assert x.shape == residual.shape and x.stride(-1) == 1 and residual.stride(-1) == 1
    T, N = x.shape
    y = torch.empty((T, N), dtype=residual.dtype, device=x.device)
    if T == 0:
        return y
    block = triton.next_power_of_2(N)
    _rmsnorm_kernel[(T,)](x, residual, weight, y, x.stride(0), residual.stride(0), y.stride(0), N, eps,
                          HAS_RESIDUAL=True, BLOCK=block, num_warps=_norm_warps(block), **_pdl.launch_args(x, pdl))
    return y


# Per-head q/k RMSNorm (Qwen3), in place --------------------------------------------------------------------------
@triton.jit
def _head_rmsnorm_kernel(QKV, QW, KW, stride_t, num_q_heads, D, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    ptrs = QKV + t * stride_t + head * D + offs
    xf = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(xf * xf, 0) / D
    y = (xf * (1.0 / tl.sqrt(var + eps))).to(QKV.dtype.element_ty)
    if head < num_q_heads:
        w = tl.load(QW + offs, mask=mask, other=0.0)
    else:
        w = tl.load(KW + offs, mask=mask, other=0.0)
    tl.store(ptrs, (y.to(tl.float32) * w.to(tl.float32)).to(QKV.dtype.element_ty), mask=mask)


def head_rmsnorm_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int, eps: float, pdl: bool = False) -> torch.Tensor:
    """RMSNorm over each head of q (``q_weight``) and of k (``k_weight``) of the fused projection's output
    [T, (H + 2 Hkv) * D], in place (v untouched): one launch instead of split, two norms and a cat."""
    assert qkv.dim() == 2 and qkv.stride(-1) == 1
    T = qkv.shape[0]
    if T == 0:
        return qkv
    block = triton.next_power_of_2(head_dim)
    _head_rmsnorm_kernel[(T, num_heads + num_kv_heads)](qkv, q_weight, k_weight, qkv.stride(0), num_heads, head_dim,
                                                        eps, BLOCK=block, num_warps=1 if block <= 256 else 4,
                                                        **_pdl.launch_args(qkv, pdl))
    return qkv


# SiLU and mul ----------------------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + offs, (s.to(tl.float32) * u).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """[T, 2N] (gate | up) -> [T, N] = silu(gate) * up."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    T, N2 = x.shape
    N = N2 // 2
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    block = min(2048, triton.next_power_of_2(N))
    _silu_and_mul_kernel[(T, triton.cdiv(N, block))](x, y, x.stride(0), y.stride(0), N, BLOCK=block,
                                                     num_warps=4, **_pdl.launch_args(x, pdl))
    return y


# Rotary embedding + KV store ------------------------------------------------------------------------------------
@triton.jit
def _head_rmsnorm_halves(x1, x2, W, offs_f, mask_f, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """Per-head RMSNorm of [heads, HALF] first and second halves, rounded where _head_rmsnorm_kernel rounds (the
    normalised value, then the weighted one, to the activations' dtype)."""
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)
    w1 = tl.load(W + offs_f, mask=mask_f, other=0.0).to(tl.float32)
    w2 = tl.load(W + HALF + offs_f, mask=mask_f, other=0.0).to(tl.float32)
    y1 = ((x1 * inv[:, None]).to(DTYPE).to(tl.float32) * w1[None, :]).to(DTYPE).to(tl.float32)
    y2 = ((x2 * inv[:, None]).to(DTYPE).to(tl.float32) * w2[None, :]).to(DTYPE).to(tl.float32)
    return y1, y2


@triton.jit
def _rope_store_kernel(QKV, Positions, CosSin, Loc, KBuf, VBuf, QW, KW, eps,
                       stride_qkv, stride_cs, stride_kt, stride_kh, stride_vt, stride_vh,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       STORE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_f = tl.arange(0, BLOCK_HALF)
    mask_f = offs_f < HALF
    cos = tl.load(CosSin + pos * stride_cs + offs_f, mask=mask_f, other=0.0)
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs_f, mask=mask_f, other=0.0)
    row = QKV + t * stride_qkv

    # q heads, rotated in place.
    offs_h = tl.arange(0, BLOCK_H)
    mq = (offs_h < NUM_HEADS)[:, None] & mask_f[None, :]
    p1 = row + offs_h[:, None] * HEAD_DIM + offs_f[None, :]
    x1 = tl.load(p1, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mq, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _head_rmsnorm_halves(x1, x2, QW, offs_f, mask_f, eps, HEAD_DIM, HALF, QKV.dtype.element_ty)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(QKV.dtype.element_ty), mask=mq)
    tl.store(p1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(QKV.dtype.element_ty), mask=mq)

    # k heads, rotated in place (and stored to the pool).
    offs_kh = tl.arange(0, BLOCK_KH)
    mk = (offs_kh < NUM_KV_HEADS)[:, None] & mask_f[None, :]
    pk = row + NUM_HEADS * HEAD_DIM + offs_kh[:, None] * HEAD_DIM + offs_f[None, :]
    k1 = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(pk + HALF, mask=mk, other=0.0).to(tl.float32)
    if NORM:
        k1, k2 = _head_rmsnorm_halves(k1, k2, KW, offs_f, mask_f, eps, HEAD_DIM, HALF, QKV.dtype.element_ty)
    r1 = (k1 * cos[None, :] - k2 * sin[None, :]).to(QKV.dtype.element_ty)
    r2 = (k2 * cos[None, :] + k1 * sin[None, :]).to(QKV.dtype.element_ty)
    tl.store(pk, r1, mask=mk)
    tl.store(pk + HALF, r2, mask=mk)
    if STORE:
        loc = tl.load(Loc + t).to(tl.int64)
        dk = KBuf + loc * stride_kt + offs_kh[:, None] * stride_kh + offs_f[None, :]
        tl.store(dk, r1.to(KBuf.dtype.element_ty), mask=mk)
        tl.store(dk + HALF, r2.to(KBuf.dtype.element_ty), mask=mk)
        pv = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + offs_kh[:, None] * HEAD_DIM + offs_f[None, :]
        dv = VBuf + loc * stride_vt + offs_kh[:, None] * stride_vh + offs_f[None, :]
        tl.store(dv, tl.load(pv, mask=mk, other=0.0).to(VBuf.dtype.element_ty), mask=mk)
        tl.store(dv + HALF, tl.load(pv + HALF, mask=mk, other=0.0).to(VBuf.dtype.element_ty), mask=mk)


def rope_and_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                      num_kv_heads: int, head_dim: int, out_cache_loc: torch.Tensor | None = None,
                      k_buf: torch.Tensor | None = None, v_buf: torch.Tensor | None = None, *,
                      qk_norm: tuple | None = None, pdl: bool = False) -> None:
    """Rotates the q and k parts of ``qkv`` [T, (H + 2*Hkv) * D] in place with ``cos_sin`` [max_pos, D]
    (cos in the first D/2 columns, sin in the last D/2); with ``k_buf``/``v_buf`` also writes the rotated k
    and v of token t into pool slot ``out_cache_loc[t]``. ``qk_norm`` = (q weight, k weight, eps): Qwen3's
    per-head RMSNorm first, as ``head_rmsnorm_`` (one launch instead of two)."""
    assert qkv.dim() == 2 and qkv.stride(-1) == 1 and head_dim % 2 == 0
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    T = qkv.shape[0]
    if T == 0:
        return
    store = k_buf is not None
    half = head_dim // 2
    if store:
        assert k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    else:
        k_buf = v_buf = qkv
        out_cache_loc = positions
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
    _rope_store_kernel[(T,)](
        qkv, positions, cos_sin, out_cache_loc, k_buf, v_buf, q_weight, k_weight, eps,
        qkv.stride(0), cos_sin.stride(0), k_buf.stride(0), k_buf.stride(1) if store else 0,
        v_buf.stride(0), v_buf.stride(1) if store else 0,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), STORE=store, NORM=qk_norm is not None, num_warps=4,
        **_pdl.launch_args(qkv, pdl),
    )


# Plain KV store (k, v of the new tokens into their pool slots) ----------------------------------------------------
@triton.jit
def _store_kv_kernel(K, V, Loc, KBuf, VBuf, stride_k, stride_v, stride_kt, stride_vt, N, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    loc = tl.load(Loc + t).to(tl.int64)
    tl.store(KBuf + loc * stride_kt + offs, tl.load(K + t * stride_k + offs, mask=mask).to(KBuf.dtype.element_ty),
             mask=mask)
    tl.store(VBuf + loc * stride_vt + offs, tl.load(V + t * stride_v + offs, mask=mask).to(VBuf.dtype.element_ty),
             mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
             pdl: bool = False) -> None:
    """k, v: [T, Hkv*D] (rows may be strided); k_buf, v_buf: [slots, Hkv, D] contiguous per slot."""
    T = k.shape[0]
    if T == 0:
        return
    N = k_buf.shape[1] * k_buf.shape[2]
    assert k.shape[-1] == N and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_buf.stride(1) == k_buf.shape[2] and k_buf.stride(2) == 1
    block = min(1024, triton.next_power_of_2(N))
    _store_kv_kernel[(T, triton.cdiv(N, block))](k, v, loc, k_buf, v_buf, k.stride(0), v.stride(0),
                                                k_buf.stride(0), v_buf.stride(0), N, BLOCK=block, num_warps=4,
                                                **_pdl.launch_args(k, pdl))
