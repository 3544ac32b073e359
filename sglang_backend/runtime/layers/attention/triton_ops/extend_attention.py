"""Paged extend (prefill) attention over a ragged batch.

Request b computes ``extend_lens[b]`` new tokens that sit after a cached prefix of ``prefix_lens[b]`` tokens;
its new queries are rows ``extend_start[b] : extend_start[b] + extend_lens[b]`` of ``q``. The new tokens' K/V
are already in the pool, so every key (prefix and new) is read through ``req_to_token``: query j (position
prefix + j) attends to keys 0 .. prefix + j. One program computes one block of BLOCK_M queries of one head with
an online softmax (flash attention) over key blocks of BLOCK_N, stopping at the block's causal limit; the key
blocks that every query of the block sees run without masks, the rest (the diagonal) masked.

Sliding window W (``sliding_window``; a compile-time switch, so global layers run the very same kernel as
without it): query j (position p = prefix + j) sees keys p - W < key <= p only. The program starts at the key
block holding the window start of its first query, skipping every block before it, and masks the blocks it
visits where some query's window starts or the causal diagonal runs; the blocks between, inside every query's
window, run unmasked as in the global kernel. Rows that see no key yet keep a zero state.

Grid: ``bs x num_heads x cdiv(max_extend_len, BLOCK_M)``; programs past a request's length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(acc, m_i, l_i, q, K, V, ReqToToken, req, kvh, n0, kv_end, q_pos, offs_d, mask_d,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_rt, sm_scale_log2, window,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr):
    """One key block of the online softmax: keys n0 .. n0 + BLOCK_N of the request, read through its slots.
    MASKED: the block may hold keys past ``kv_end`` or after some queries (the causal diagonal); else every
    key is visible to every query of the block and nothing is masked. SLIDING (always with MASKED): keys at or
    before ``q_pos - window`` are masked too, and a row none of whose keys is visible so far stays at zero."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < kv_end
        slot = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        slot = tl.load(ReqToToken + req * stride_rt + offs_n).to(tl.int64)
        kv_mask = mask_d[None, :]
    k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * sm_scale_log2
    if SLIDING:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(mask_n[None, :] & visible, qk, float("-inf"))
    elif MASKED:
        qk = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if SLIDING:  # a row that sees nothing yet keeps max -inf and a zero state (exp2(-inf - -inf) would be nan)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _extend_attn_kernel(
    Q, O, K, V, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStart,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
    sm_scale_log2, window,
    KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    # The last query blocks (the longest key ranges) first, so that the short ones fill the tail of the launch.
    mb = tl.num_programs(2) - 1 - tl.program_id(2)
    ext_len = tl.load(ExtendLens + b).to(tl.int32)
    if mb * BLOCK_M >= ext_len:
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    q_start = tl.load(ExtendStart + b).to(tl.int64)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    kvh = h // KV_GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = prefix + offs_m

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Whole key blocks before `full_end` are visible to every query of the block: no masks there (the cached
    # prefix and the earlier new tokens); the rest, up to the block's causal limit, is masked.
    full_end = (prefix + mb * BLOCK_M) // BLOCK_N * BLOCK_N
    kv_end = prefix + tl.minimum((mb + 1) * BLOCK_M, ext_len)
    if SLIDING:
        # Key blocks from the one holding the first query's window start (those before it are skipped): up to
        # `full_in`, masked (some query's window starts inside); up to `full_end`, inside every query's window and
        # before every query (no mask); the rest, the causal diagonal, masked.
        kv_start = tl.maximum(prefix + mb * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        full_in = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, full_end)
        for n0 in range(kv_start, full_in, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, ReqToToken, req, kvh, n0, kv_end, q_pos, offs_d,
                                          mask_d, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
                                          sm_scale_log2, window, BLOCK_N, IEEE, True, True)
        for n0 in range(full_in, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, ReqToToken, req, kvh, n0, kv_end, q_pos, offs_d,
                                          mask_d, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
                                          sm_scale_log2, window, BLOCK_N, IEEE, False, False)
        for n0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, ReqToToken, req, kvh, n0, kv_end, q_pos, offs_d,
                                          mask_d, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
                                          sm_scale_log2, window, BLOCK_N, IEEE, True, True)
    else:
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, ReqToToken, req, kvh, n0, kv_end, q_pos, offs_d,
                                          mask_d, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
                                          sm_scale_log2, window, BLOCK_N, IEEE, False, False)
        for n0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, ReqToToken, req, kvh, n0, kv_end, q_pos, offs_d,
                                          mask_d, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
                                          sm_scale_log2, window, BLOCK_N, IEEE, True, False)

    out = acc / l_i[:, None]
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _config(head_dim: int, is_fp32: bool, max_extend_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the head size. On an H100 with 128-wide heads (bf16, GQA 4):
    (128, 64, 4, 3) for long prompts, 333 us per layer for 8 x 1k causal against 445 for (128, 64, 8, 2); and
    blocks of 64 queries when every request adds at most 64 tokens (the rest of a 128-block would be padding):
    558 us for 127 x (1024 cached + 64 new) against 913 with 128-blocks."""
    if is_fp32:
        return 32, 32, 4, 1
    if head_dim <= 64:
        return 128, 64, 4, 2
    if head_dim <= 128:
        return (64, 64, 4, 3) if max_extend_len <= 64 else (128, 64, 4, 3)
    return 64, 32, 4, 2


def extend_attention_fwd(q, o, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                         extend_start, max_extend_len: int, sm_scale: float, config: tuple | None = None,
                         sliding_window: int | None = None) -> None:
    """q, o: [num_tokens, H, D]; k_buf, v_buf: [slots, Hkv, D]; per-request int tensors of length bs.
    ``config``: (BLOCK_M, BLOCK_N, num_warps, num_stages), else the defaults for the head size.
    ``sliding_window`` W: each query sees only the last W positions up to its own (None: all of them)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    bs = req_pool_indices.shape[0]
    if bs == 0 or max_extend_len == 0:
        return
    is_fp32 = q.dtype == torch.float32
    block_m, block_n, num_warps, num_stages = config or _config(head_dim, is_fp32, max_extend_len)
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_attn_kernel[grid](
        q, o, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0), sm_scale * LOG2E, sliding_window or 0,
        KV_GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=is_fp32, SLIDING=sliding_window is not None, num_warps=num_warps,
        num_stages=num_stages,
    )
