"""Paged decode attention: one query token per request over its KV slots, split along the sequence.

Layout (same as the torch_native reference):

* ``q``: [bs, num_heads, head_dim] (any row/head stride, last dim contiguous), the new token of each request;
* ``k_buf`` / ``v_buf``: [num_slots, num_kv_heads, head_dim], the paged pool of one layer;
* ``req_to_token[req_pool_indices[b], i]`` is the KV slot of request b's token i, for i < seq_lens[b]
  (seq_lens includes the new token, whose KV is already stored).

Stage 1 (grid ``bs x heads x splits``) lets each program attend to one contiguous split of the sequence and
write its normalised partial output and log-sum-exp (base 2) to fp32 scratch buffers; stage 2 merges the
splits. With ``merge_counters`` (outside cascade mode) stage 2 is folded into stage 1: each program counts
itself in for its (request, head) with an atomic, and the last one to arrive merges the splits, with the same
code and roundings as stage 2; one split alone writes the output directly. That is one kernel per layer fewer.

The number of splits is a compile-time constant chosen from the batch size only, so one launch shape serves
every sequence length: that is what makes the decode step capturable in a CUDA graph. Empty splits (short
sequences) write a zero output with lse = -inf, which the merge weights by zero.

Stage 1 packs the query heads of one KV head into the rows of a ``tl.dot`` (at least 16, padded), so each KV
tile is read once per group; MHA runs the same kernel with one row per program (tensor cores do the products
of a padded row faster than a vector kernel does them on CUDA cores, measured on an H100).

Sliding window W (``sliding_window``; a compile-time switch, so global layers run the very same kernel as
without it): the new token at position seq_len - 1 sees the keys after position seq_len - 1 - W, the last W.
Stage 1 then splits only those keys (the splits start at seq_len - W instead of 0), which is the mask and the
skip in one, with no per-key test. Not with cascade (the shared prefix may lie outside a request's window): the
caller runs windowed layers without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernel_options import KernelConfigs
from . import pdl as _pdl
from .pdl import pdl_begin

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, K, V, slot, kvh, mask_n, offs_d, mask_d, m_i, l_i, acc,
                 stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2, IEEE: tl.constexpr):
    """One KV tile of an online-softmax attention for a block of query rows (``tl.dot``): the tile's keys
    and values are read from the pool slots ``slot`` of KV head ``kvh``; returns the updated (max, sum, acc)."""
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * sm_scale_log2
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _decode_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, PrefixLen, MidO, MidLse, O, Counters,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, stride_cb,
    sm_scale_log2, window,
    KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, FUSE_MERGE: tl.constexpr,
    IEEE: tl.constexpr, HEAD_FASTEST: tl.constexpr, HAS_PREFIX: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
    PDL: tl.constexpr, SLIDING: tl.constexpr,
):
    pdl_begin(PDL)
    if HEAD_FASTEST:  # programs launched together read neighbouring heads of the same tokens
        kvh = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    base = 0
    if HAS_PREFIX:  # the batch-wide shared prefix is attended by _decode_prefix_stage1
        base = tl.load(PrefixLen).to(tl.int32)
    if SLIDING:  # only the last `window` keys (never with HAS_PREFIX)
        base = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = base + s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < KV_GROUP
    heads = kvh * KV_GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_tile(q, K, V, slot, kvh, mask_n, offs_d, mask_d, m_i, l_i, acc,
                                     stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2, IEEE)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if PREFIX_SPLITS > 0:  # cascade, own part in one split: the prefix partials are ready, merge them here
        _merge_prefix_partials(out, lse, MidO, MidLse, O, b, heads, mask_h, offs_d, mask_d, stride_mb, stride_mh,
                               stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, NUM_SPLITS, PREFIX_SPLITS)
    else:
        _finish_split(out, lse, MidO, MidLse, O, Counters + b * stride_cb + kvh, b, kvh * KV_GROUP, offs_h, mask_h,
                      offs_d, mask_d, s, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                      HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S, KV_GROUP, FUSE_MERGE)


@triton.jit
def _decode_prefix_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, PrefixLen, MidO, MidLse,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    sm_scale_log2, num_rows,
    KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_BASE: tl.constexpr, NUM_PREFIX_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Cascade decode: the first PrefixLen KV slots are the same for every request of the batch (a shared
    radix-cache prefix), so one program reads a tile of them once and attends it with the queries of every
    request (rows = requests x query heads of one KV head) through ``tl.dot``, instead of every request
    re-reading the prefix. Partials go to splits SPLIT_BASE.. of the scratch, merged by stage 2."""
    pdl_begin(PDL)
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    mb = tl.program_id(2)
    prefix_len = tl.load(PrefixLen).to(tl.int32)
    req = tl.load(ReqPoolIdx).to(tl.int64)  # any request's row: the prefix slots are the same in all
    split_len = tl.cdiv(tl.cdiv(prefix_len, NUM_PREFIX_SPLITS), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, prefix_len)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_r = rows < num_rows
    b = rows // KV_GROUP
    h = kvh * KV_GROUP + rows % KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b[:, None] * stride_qb + h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_tile(q, K, V, slot, kvh, mask_n, offs_d, mask_d, m_i, l_i, acc,
                                     stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2, IEEE)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    split = SPLIT_BASE + s
    tl.store(MidO + b[:, None] * stride_mb + h[:, None] * stride_mh + split * stride_ms + offs_d[None, :], out,
             mask=mask_r[:, None] & mask_d[None, :])
    tl.store(MidLse + b * stride_lb + h * stride_lh + split, lse, mask=mask_r)


@triton.jit
def _merge_splits(MidO, MidLse, O, b, h, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                  CACHE: tl.constexpr):
    """Output of request b, head h from its splits' partial outputs and log-sum-exps."""
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"),
                  cache_modifier=CACHE)
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # the split holding the max has weight 1, empty splits 0
    part = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0, cache_modifier=CACHE)
    part = tl.where(w[:, None] > 0, part, 0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


@triton.jit
def _finish_split(out, lse, MidO, MidLse, O, Counter, b, h0, offs_h, mask_h, offs_d, mask_d, s,
                  stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                  GROUP: tl.constexpr, FUSE_MERGE: tl.constexpr):
    """Stores the result of a stage-1 program for query heads h0 + offs_h (``out`` [BLOCK_H, BLOCK_D] fp32,
    ``lse`` [BLOCK_H]) of request b, split s: the output itself when the merge is fused and there is one split,
    else the partials; with FUSE_MERGE the last of the NUM_SPLITS programs of (b, h0) to finish (counted at
    ``Counter``, this program's counter) then merges heads h0 .. h0 + GROUP - 1."""
    heads = h0 + offs_h
    mask = mask_h[:, None] & mask_d[None, :]
    if FUSE_MERGE and NUM_SPLITS == 1:  # stage 2 of one split is the identity (weight 1, sum 1)
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(MidO + b * stride_mb + heads[:, None] * stride_mh + s * stride_ms + offs_d[None, :], out, mask=mask)
        tl.store(MidLse + b * stride_lb + heads * stride_lh + s, lse, mask=mask_h)
        if FUSE_MERGE:
            # A scalar atomic is lowered as a CTA barrier, then one thread's acq_rel atomic at gpu scope: every
            # thread's partial stores above are released with the count, and the last program reads them after
            # acquiring it (from L2: .cg).
            ticket = tl.atomic_add(Counter, 1, sem="acq_rel")
            if ticket == NUM_SPLITS - 1:
                tl.store(Counter, 0)  # ready for the next launch (CUDA graph replays reuse the counters)
                for i in tl.static_range(GROUP):
                    _merge_splits(MidO, MidLse, O, b, h0 + i, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                                  stride_ob, stride_oh, HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S, ".cg")


@triton.jit
def _merge_prefix_partials(out, lse, MidO, MidLse, O, b, heads, mask_h, offs_d, mask_d, stride_mb, stride_mh,
                           stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, SPLIT_BASE: tl.constexpr,
                           PREFIX_SPLITS: tl.constexpr):
    """Cascade decode whose per-request part is one split: merges that part's result (``out`` [BLOCK_H,
    BLOCK_D], ``lse`` [BLOCK_H], heads ``heads`` of request b) with the shared prefix's partials, which
    _decode_prefix_stage1 wrote to splits SPLIT_BASE.. in an earlier launch, and stores the output. The
    arithmetic of stage 2 (weights relative to the largest lse, empty splits weighted zero) without its
    launch or its second pass over the scratch."""
    m = lse
    for i in tl.static_range(PREFIX_SPLITS):
        m = tl.maximum(m, tl.load(MidLse + b * stride_lb + heads * stride_lh + SPLIT_BASE + i, mask=mask_h,
                                  other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)  # padding rows (heads past the group) stay finite; never stored
    w = tl.exp2(lse - m)
    total = w
    acc = out * w[:, None]
    mask = mask_h[:, None] & mask_d[None, :]
    for i in tl.static_range(PREFIX_SPLITS):
        wi = tl.exp2(tl.load(MidLse + b * stride_lb + heads * stride_lh + SPLIT_BASE + i, mask=mask_h,
                             other=float("-inf")) - m)
        part = tl.load(MidO + b * stride_mb + heads[:, None] * stride_mh + (SPLIT_BASE + i) * stride_ms
                       + offs_d[None, :], mask=mask, other=0.0)
        acc += wi[:, None] * tl.where(wi[:, None] > 0, part, 0.0)
        total += wi
    res = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], res.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _decode_stage2(
    MidO, MidLse, O,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    _merge_splits(MidO, MidLse, O, tl.program_id(0), tl.program_id(1), stride_mb, stride_mh, stride_ms, stride_lb,
                  stride_lh, stride_ob, stride_oh, HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S, "")


# Launch parameters of stage 1, (BLOCK_N, num_warps, num_stages, head_fastest), for small batches (the
# sequence split many ways) and large ones come from the caller's KernelConfigs (decode_mha / decode_gqa, tuned
# per device with benchmarks/bench_gpu.py --only attn_sweep; see layers/kernel_options.py for the H100 values).
# (Requesting the first KV tile before the PDL wait, to overlap it with the qkv GEMV's tail, was measured
# slower on an H100: batch 1 5.41 vs 5.20 ms per step, batch 64 17.74 vs 17.33 ms; removed.)
_DEFAULT_CONFIGS = KernelConfigs()


def num_prefix_programs_per_split(bs: int, num_heads: int, num_kv_heads: int,
                                  configs: KernelConfigs | None = None) -> int:
    """Programs of _decode_prefix_stage1 per prefix split: KV heads x blocks of (request, query head) rows."""
    group = num_heads // num_kv_heads
    return num_kv_heads * triton.cdiv(bs * group, (configs or _DEFAULT_CONFIGS).decode_prefix[0])


def decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
                         num_splits: int, sm_scale: float, config: tuple | None = None,
                         prefix_len=None, prefix_splits: int = 0, merge_counters=None,
                         configs: KernelConfigs | None = None, pdl: bool = False,
                         sliding_window: int | None = None) -> None:
    """q, o: [bs, H, D]; k_buf, v_buf: [slots, Hkv, D]; mid_o: >= [bs, H, num_splits + prefix_splits, D] fp32
    and mid_lse: >= [bs, H, num_splits + prefix_splits] fp32 scratch (any leading layout given by their strides).

    Cascade mode (``prefix_splits > 0``): ``prefix_len`` is a 1-element device tensor P such that the first P
    entries of every request's ``req_to_token`` row are the same slots and P < every seq_len. The shared P
    tokens are attended once per tile for the whole batch, the rest per request; P == 0 is valid (no sharing).
    P lives on the device so a CUDA graph captured once serves every step.

    ``merge_counters``: int32 zeros, >= bs * num_heads, owned by the caller and left zero by every launch; with
    them (and outside cascade mode) stage 2 is folded into stage 1 (see the module docstring). ``config`` (one
    launch configuration) or else ``configs`` (the tuned table) picks stage 1's launch parameters.

    ``sliding_window`` W: each request attends only to its last W keys (None: all); not with cascade mode."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    has_prefix = prefix_splits > 0
    assert not has_prefix or prefix_len is not None
    assert not (has_prefix and sliding_window is not None), "no cascade decode for sliding-window layers"
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    scale_log2 = sm_scale * LOG2E
    ieee = q.dtype == torch.float32
    strides = (q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
               req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
               mid_lse.stride(0), mid_lse.stride(1))
    fuse_merge = merge_counters is not None and not has_prefix
    if fuse_merge:
        assert merge_counters.dtype == torch.int32 and merge_counters.numel() >= bs * num_heads
    block_s = triton.next_power_of_2(num_splits)
    common = (q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, prefix_len if has_prefix else seq_lens,
              mid_o, mid_lse, o, merge_counters if fuse_merge else seq_lens) + strides
    launch = _pdl.launch_args(q, pdl)
    configs = configs or _DEFAULT_CONFIGS
    # Cascade with the per-request part in one split and the merge fused: the prefix kernel runs first and
    # stage 1 merges its partials (no stage 2). Otherwise the prefix kernel runs after stage 1 and stage 2 merges.
    prefix_first = has_prefix and num_splits == 1 and merge_counters is not None
    if prefix_first:
        _launch_prefix_stage1(q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_len, mid_o, mid_lse, strides,
                              scale_log2, bs, group, num_kv_heads, head_dim, block_d, num_splits, prefix_splits,
                              ieee, configs, launch)
    block_n, warps, stages, head_fastest = config or configs.decode_config(group == 1, bs, cascade=has_prefix)
    if block_d > 128:
        block_n = min(block_n, 32)
    grid = (num_kv_heads, bs, num_splits) if head_fastest else (bs, num_kv_heads, num_splits)
    _decode_stage1[grid](
        *common, o.stride(0), o.stride(1), num_kv_heads, scale_log2, sliding_window or 0, KV_GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_H=max(16, triton.next_power_of_2(group)), NUM_SPLITS=num_splits,
        BLOCK_S=block_s, FUSE_MERGE=fuse_merge, IEEE=ieee, HEAD_FASTEST=head_fastest, HAS_PREFIX=has_prefix,
        PREFIX_SPLITS=prefix_splits if prefix_first else 0, SLIDING=sliding_window is not None, num_warps=warps,
        num_stages=stages, **launch,
    )
    if fuse_merge or prefix_first:
        return
    total_splits = num_splits
    if has_prefix:
        _launch_prefix_stage1(q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_len, mid_o, mid_lse, strides,
                              scale_log2, bs, group, num_kv_heads, head_dim, block_d, num_splits, prefix_splits,
                              ieee, configs, launch)
        total_splits += prefix_splits
    _decode_stage2[(bs, num_heads)](
        mid_o, mid_lse, o, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=total_splits,
        BLOCK_S=triton.next_power_of_2(total_splits), num_warps=4 if block_d >= 128 else 2, **launch,
    )


def _launch_prefix_stage1(q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_len, mid_o, mid_lse, strides,
                          scale_log2, bs, group, num_kv_heads, head_dim, block_d, split_base, prefix_splits, ieee,
                          configs: KernelConfigs, launch) -> None:
    block_m, block_n, warps, stages = configs.decode_prefix
    grid = (num_kv_heads, prefix_splits, triton.cdiv(bs * group, block_m))
    _decode_prefix_stage1[grid](
        q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_len, mid_o, mid_lse, *strides, scale_log2,
        bs * group,
        KV_GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=block_n if block_d <= 128 else 32, SPLIT_BASE=split_base,
        NUM_PREFIX_SPLITS=prefix_splits, IEEE=ieee, num_warps=warps, num_stages=stages, **launch,
    )


def shared_prefix_len(req_to_token, req_pool_indices, min_seq_len: int, positions, out) -> None:
    """Writes into ``out`` (1-element int32 device tensor) the number of leading KV slots that every request
    of the batch shares, capped at min_seq_len - 1 so each request keeps its newest token in its own part.
    Device ops only (no host sync); ``positions`` is a device arange of at least min_seq_len."""
    n = max(min_seq_len - 1, 0)
    if n == 0 or req_pool_indices.shape[0] < 2:
        out.zero_()
        return
    rows = req_to_token[req_pool_indices, :n]
    differs = (rows != rows[:1]).any(0)
    out.copy_(torch.where(differs, positions[:n], n).min())
