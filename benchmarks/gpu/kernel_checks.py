"""Correctness checks of the Triton kernels against float64 torch references on fresh random inputs.

Plain functions taking ``device`` so they run on the GPU under pytest (tests/gpu/test_triton_kernels.py) and,
for debugging without a GPU, on the CPU under ``TRITON_INTERPRET=1``. Each returns the worst relative error
‖out − ref‖ / ‖ref‖ it saw and raises if an output is NaN or unwritten (outputs are poisoned with NaN first).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    if torch.isnan(out).any():
        raise AssertionError("NaN (or unwritten poisoned value) in the output")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def make_pool(num_slots: int, num_kv_heads: int, head_dim: int, dtype, device, gen):
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, dtype=torch.float32).to(device, dtype)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, dtype=torch.float32).to(device, dtype)
    return k, v


def scattered_rows(seq_lens: list[int], num_slots: int, max_ctx: int, num_rows: int, device, gen, shared_prefix=0):
    """req_to_token with each request's tokens on random distinct slots (slot 0 never used); requests may
    share their first ``shared_prefix`` slots (a radix-cache hit). Returns (req_to_token, req_pool_indices)."""
    bs = len(seq_lens)
    req_to_token = torch.zeros(num_rows, max_ctx, dtype=torch.int64)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    rows = torch.randperm(num_rows, generator=gen)[:bs]
    shared = perm[:shared_prefix]
    off = shared_prefix
    for i, n in enumerate(seq_lens):
        own = n - min(n, shared_prefix)
        req_to_token[rows[i], : min(n, shared_prefix)] = shared[: min(n, shared_prefix)]
        req_to_token[rows[i], min(n, shared_prefix) : n] = perm[off : off + own]
        off += own
    assert off <= num_slots - 1
    return req_to_token.to(device), rows.to(device)


def ref_attention(q, keys, values, q_positions, scale):
    """q: [M, H, D], keys/values: [L, Hkv, D] (positions 0..L-1); query i sees keys <= q_positions[i]."""
    H, Hkv = q.shape[1], keys.shape[1]
    g = H // Hkv
    k = keys.double().repeat_interleave(g, dim=1)  # [L, H, D]
    v = values.double().repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,lhd->hml", q.double(), k) * scale
    L = keys.shape[0]
    visible = torch.arange(L, device=q.device)[None, :] <= q_positions[:, None].to(q.device)
    s = s.masked_fill(~visible[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hml,lhd->mhd", p, v)


def rope_table(head_dim: int, device, positions: int = 512):
    """Rotary angles [positions, head_dim / 2] (base 10000, on the host) and the fused kernels' cos | sin table."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs, torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _worst_decode_err(q, o, k_buf, v_buf, req_to_token, rows, seq_lens, scale) -> float:
    """Each request's output vs the float64 reference over its own KV slots; the worst relative error."""
    worst = 0.0
    for i, n in enumerate(seq_lens):
        slots = req_to_token[rows[i], :n]
        ref = ref_attention(q[i : i + 1], k_buf[slots], v_buf[slots], torch.tensor([n - 1]), scale)
        worst = max(worst, rel_err(o[i : i + 1], ref))
    return worst


def check_decode(device, dtype, num_heads, num_kv_heads, head_dim, seq_lens, num_splits, seed=0,
                 fused_merge=False):
    """Split-KV decode vs the float64 reference; with ``fused_merge`` the merge runs inside stage 1 (split
    counters), launched twice on the same counters, which must be left zero."""
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_ops.decode_attention import decode_attention_fwd

    gen = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 64
    k_buf, v_buf = make_pool(num_slots, num_kv_heads, head_dim, dtype, device, gen)
    max_ctx = max(seq_lens) + 8
    req_to_token, rows = scattered_rows(seq_lens, num_slots, max_ctx, bs + 3, device, gen)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    # q as a strided view of a fused qkv buffer, as the model passes it.
    qkv = torch.randn(bs, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : num_heads * head_dim].view(bs, num_heads, head_dim)
    o = torch.full((bs, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    mid_o = torch.full((bs, num_heads, num_splits, head_dim), float("nan"), dtype=torch.float32, device=device)
    mid_lse = torch.full((bs, num_heads, num_splits), float("nan"), dtype=torch.float32, device=device)
    scale = head_dim ** -0.5
    if fused_merge:
        counters = torch.zeros(bs * num_heads + 5, dtype=torch.int32, device=device)
        for _ in range(2):  # the second launch finds the counters as the first left them
            o.fill_(float("nan"))
            decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rows, seq, mid_o, mid_lse, num_splits, scale,
                                 merge_counters=counters)
            assert int(counters.abs().sum()) == 0, f"split counters not reset: {counters.tolist()}"
    else:
        decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rows, seq, mid_o, mid_lse, num_splits, scale)
    return _worst_decode_err(q, o, k_buf, v_buf, req_to_token, rows, seq_lens, scale)


def check_decode_cascade(device, dtype, num_heads, num_kv_heads, head_dim, seq_lens, shared_prefix, num_splits,
                         prefix_splits, seed=0, fused_merge=False, config=None, configs=None):
    """Cascade decode: the requests share their first ``shared_prefix`` slots; the shared length is found on
    the device (as the backend does) and attended once for the batch. ``fused_merge``: with split counters,
    as the backend runs it (one per-request split: stage 1 merges the prefix partials, no stage 2).
    ``config`` / ``configs``: launch configurations as decode_attention_fwd takes them (a sweep's candidates)."""
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_ops.decode_attention import (
        decode_attention_fwd, shared_prefix_len)

    gen = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 64
    k_buf, v_buf = make_pool(num_slots, num_kv_heads, head_dim, dtype, device, gen)
    req_to_token, rows = scattered_rows(seq_lens, num_slots, max(seq_lens) + 8, bs + 3, device, gen,
                                        shared_prefix=shared_prefix)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    prefix_len = torch.full((1,), -1, dtype=torch.int32, device=device)
    shared_prefix_len(req_to_token, rows, min(seq_lens), torch.arange(max(seq_lens), device=device), prefix_len)
    expect = min(shared_prefix, min(seq_lens) - 1) if bs > 1 else 0
    assert int(prefix_len) >= expect, (int(prefix_len), expect)
    qkv = torch.randn(bs, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : num_heads * head_dim].view(bs, num_heads, head_dim)
    o = torch.full((bs, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    total = num_splits + prefix_splits
    mid_o = torch.full((bs, num_heads, total, head_dim), float("nan"), dtype=torch.float32, device=device)
    mid_lse = torch.full((bs, num_heads, total), float("nan"), dtype=torch.float32, device=device)
    scale = head_dim ** -0.5
    counters = torch.zeros(bs * num_heads, dtype=torch.int32, device=device) if fused_merge else None
    decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rows, seq, mid_o, mid_lse, num_splits, scale, config,
                         prefix_len=prefix_len, prefix_splits=prefix_splits, merge_counters=counters, configs=configs)
    if counters is not None:
        assert int(counters.abs().sum()) == 0, "split counters not left zero"
    return _worst_decode_err(q, o, k_buf, v_buf, req_to_token, rows, seq_lens, scale)


def check_extend(device, dtype, num_heads, num_kv_heads, head_dim, prefix_lens, extend_lens, shared_prefix=0, seed=0):
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_ops.extend_attention import extend_attention_fwd

    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 64
    k_buf, v_buf = make_pool(num_slots, num_kv_heads, head_dim, dtype, device, gen)
    req_to_token, rows = scattered_rows(seq_lens, num_slots, max(seq_lens) + 8, bs + 2, device, gen,
                                        shared_prefix=shared_prefix)
    T = sum(extend_lens)
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : num_heads * head_dim].view(T, num_heads, head_dim)
    o = torch.full((T, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    starts = [sum(extend_lens[:i]) for i in range(bs)]
    meta = torch.tensor([prefix_lens, extend_lens, starts], dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    extend_attention_fwd(q, o, k_buf, v_buf, req_to_token, rows, meta[0], meta[1], meta[2], max(extend_lens), scale)
    worst = 0.0
    for i in range(bs):
        if extend_lens[i] == 0:
            continue
        slots = req_to_token[rows[i], : seq_lens[i]]
        qi = q[starts[i] : starts[i] + extend_lens[i]]
        pos = torch.arange(prefix_lens[i], seq_lens[i])
        ref = ref_attention(qi, k_buf[slots], v_buf[slots], pos, scale)
        worst = max(worst, rel_err(o[starts[i] : starts[i] + extend_lens[i]], ref))
    return worst


def check_fused_ops(device, dtype, T=37, hidden=320, inter=448, num_heads=8, num_kv_heads=2, head_dim=64, seed=0):
    """rmsnorm / fused_add_rmsnorm / silu_and_mul / head_rmsnorm_ / rope_and_store_kv / store_kv vs the reference
    modules."""
    # Needs triton (the layers below import it): deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_ops import fused_ops
    from sglang_backend.runtime.layers.layernorm import RMSNorm, head_rmsnorm
    from sglang_backend.runtime.layers.rotary_embedding import apply_rotary

    gen = torch.Generator().manual_seed(seed)
    errs = {}
    x = torch.randn(T, hidden, generator=gen).to(device, dtype)
    r = torch.randn(T, hidden, generator=gen).to(device, dtype)
    norm = RMSNorm(hidden, 1e-5).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
        errs["rmsnorm"] = rel_err(fused_ops.rmsnorm(x, norm.weight, 1e-5), norm(x))
        r2 = r.clone()
        y = fused_ops.fused_add_rmsnorm(x, r2, norm.weight, 1e-5)
        errs["add_rmsnorm.residual"] = rel_err(r2, x + r)
        errs["add_rmsnorm"] = rel_err(y, norm(x + r))
        gu = torch.randn(T, 2 * inter, generator=gen).to(device, dtype)
        g, u = gu.split(inter, dim=-1)
        errs["silu_and_mul"] = rel_err(fused_ops.silu_and_mul(gu), F.silu(g) * u)

        H, Hkv, D = num_heads, num_kv_heads, head_dim
        qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(device, dtype)
        positions = torch.randint(0, 500, (T,), generator=gen).to(device)
        freqs, cos_sin = rope_table(D, device)
        emb = torch.cat([freqs, freqs], dim=-1)[positions.cpu()].to(device)
        cos, sin = emb.cos().double(), emb.sin().double()
        q_ref = apply_rotary(qkv[:, : H * D].double().view(T, H, D), cos, sin).view(T, -1)
        k_ref = apply_rotary(qkv[:, H * D : (H + Hkv) * D].double().view(T, Hkv, D), cos, sin)
        v_ref = qkv[:, (H + Hkv) * D :].view(T, Hkv, D).clone()
        k_buf = torch.full((T + 10, Hkv, D), float("nan"), dtype=dtype, device=device)
        v_buf = torch.full((T + 10, Hkv, D), float("nan"), dtype=dtype, device=device)
        loc = (torch.randperm(T + 9, generator=gen)[:T] + 1).to(device)
        qkv2 = qkv.clone()
        fused_ops.rope_and_store_kv(qkv2, positions, cos_sin, H, Hkv, D, loc, k_buf, v_buf)
        errs["rope.q"] = rel_err(qkv2[:, : H * D], q_ref)
        errs["rope.k"] = rel_err(qkv2[:, H * D : (H + Hkv) * D].reshape(T, Hkv, D), k_ref)
        errs["rope.k_store"] = rel_err(k_buf[loc], k_ref)
        errs["rope.v_store"] = rel_err(v_buf[loc], v_ref)
        q_norm, k_norm = RMSNorm(D, 1e-6).to(device, dtype), RMSNorm(D, 1e-6).to(device, dtype)
        q_norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen))
        k_norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen))
        wide = torch.randn(T, (H + 2 * Hkv) * D + 8, generator=gen).to(device, dtype)[:, 3 : 3 + (H + 2 * Hkv) * D]
        ref = head_rmsnorm(wide.clone(), q_norm, k_norm, H, Hkv, D)  # torch reference (no options)
        errs["head_rmsnorm"] = rel_err(fused_ops.head_rmsnorm_(wide, q_norm.weight, k_norm.weight, H, Hkv, D, 1e-6),
                                       ref)
        # Qwen3: the per-head norms inside the rotary kernel == head_rmsnorm then rotary.
        normed = head_rmsnorm(qkv.clone(), q_norm, k_norm, H, Hkv, D)
        qn_ref = apply_rotary(normed[:, : H * D].double().view(T, H, D), cos, sin).view(T, -1)
        kn_ref = apply_rotary(normed[:, H * D : (H + Hkv) * D].double().view(T, Hkv, D), cos, sin)
        k_buf.fill_(float("nan"))
        qkv4 = qkv.clone()
        fused_ops.rope_and_store_kv(qkv4, positions, cos_sin, H, Hkv, D, loc, k_buf, v_buf,
                                    qk_norm=(q_norm.weight, k_norm.weight, 1e-6))
        errs["rope_qk_norm.q"] = rel_err(qkv4[:, : H * D], qn_ref)
        errs["rope_qk_norm.k_store"] = rel_err(k_buf[loc], kn_ref)
        qkv3 = qkv.clone()
        fused_ops.rope_and_store_kv(qkv3, positions, cos_sin, H, Hkv, D)
        errs["rope.no_store"] = rel_err(qkv3[:, : (H + Hkv) * D], torch.cat([q_ref, k_ref.reshape(T, -1)], -1))
        k_buf.fill_(float("nan"))
        v_buf.fill_(float("nan"))
        fused_ops.store_kv(qkv[:, H * D : (H + Hkv) * D], qkv[:, (H + Hkv) * D :], loc, k_buf, v_buf)
        errs["store_kv"] = rel_err(k_buf[loc].reshape(T, -1), qkv[:, H * D : (H + Hkv) * D])

        from sglang_backend.runtime.layers.attention.triton_ops.gemv import gemv  # needs triton (as above)

        for n, kdim in ((inter + 3, hidden), (hidden, inter)):
            w = (torch.randn(n, kdim, generator=gen) / kdim**0.5).to(device, dtype)
            b = torch.randn(n, generator=gen).to(device, dtype)
            xv = torch.randn(1, kdim, generator=gen).to(device, dtype)
            ref = xv.double() @ w.double().T
            errs[f"gemv_{n}x{kdim}"] = rel_err(gemv(xv, w), ref)
            errs[f"gemv_bias_{n}x{kdim}"] = rel_err(gemv(xv, w, b), ref + b.double())
        # Fused forms (decode at batch 1) vs the unfused kernels: RMSNorm prologue, SiLU-mul epilogue,
        # residual-add epilogue.
        res = torch.randn(1, hidden, generator=gen).to(device, dtype)
        w_gu = (torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).to(device, dtype)
        b_gu = torch.randn(2 * inter, generator=gen).to(device, dtype)
        w_dn = (torch.randn(hidden, inter, generator=gen) / inter**0.5).to(device, dtype)
        normed = fused_ops.rmsnorm(res, norm.weight, 1e-5)
        errs["gemv_norm"] = rel_err(gemv(res, w_gu, norm_weight=norm.weight, eps=1e-5), normed.double() @ w_gu.double().T)
        h_ref = fused_ops.silu_and_mul(gemv(normed, w_gu, b_gu))
        h = gemv(res, w_gu, b_gu, norm_weight=norm.weight, eps=1e-5, silu_mul=True)
        errs["gemv_norm_silu"] = rel_err(h, h_ref)
        r2 = res.clone()
        out = gemv(h, w_dn, residual=r2)
        errs["gemv_residual.same_tensor"] = 0.0 if out.data_ptr() == r2.data_ptr() else float("inf")
        errs["gemv_residual"] = rel_err(r2, res.double() + h.double() @ w_dn.double().T)
        # qkv GEMV with rotary + KV store folded in vs the GEMV then rope_and_store_kv (one token).
        from sglang_backend.runtime.layers.attention.triton_ops.gemv import RopeStore  # needs triton (as above)

        w_qkv = (torch.randn((H + 2 * Hkv) * D, hidden, generator=gen) / hidden**0.5).to(device, dtype)
        b_qkv = torch.randn((H + 2 * Hkv) * D, generator=gen).to(device, dtype)
        pos1 = torch.tensor([int(torch.randint(0, 512, (1,), generator=gen))], device=device)
        loc1 = torch.tensor([int(torch.randint(1, T + 10, (1,), generator=gen))], device=device)
        for bias in (None, b_qkv):
            ref_qkv = gemv(res, w_qkv, bias, norm_weight=norm.weight, eps=1e-5)
            k_ref, v_ref = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
            fused_ops.rope_and_store_kv(ref_qkv, pos1, cos_sin, H, Hkv, D, loc1, k_ref, v_ref)
            k_out, v_out = torch.full_like(k_buf, float("nan")), torch.full_like(v_buf, float("nan"))
            out = gemv(res, w_qkv, bias, norm_weight=norm.weight, eps=1e-5,
                       rope=RopeStore(pos1, cos_sin, H, Hkv, D, loc1, k_out, v_out))
            tag = "gemv_rope" + ("_bias" if bias is not None else "")
            errs[tag] = rel_err(out, ref_qkv)
            errs[tag + ".k"] = rel_err(k_out[loc1], k_ref[loc1])
            errs[tag + ".v"] = rel_err(v_out[loc1], v_ref[loc1])
    return errs


def random_decode_case(rng: random.Random, long: bool = False):
    bs = rng.choice([1, 3, 8, 17])
    hi = 3000 if long else 300
    seq_lens = [rng.randint(1, hi) for _ in range(bs)]
    return seq_lens


def random_extend_case(rng: random.Random, long: bool = False):
    bs = rng.choice([1, 2, 5])
    hi = 700 if long else 150
    prefix = [rng.choice([0, rng.randint(1, hi)]) for _ in range(bs)]
    extend = [rng.randint(1, hi) for _ in range(bs)]
    return prefix, extend


def check_fp8(device, dtype, hidden=320, inter=448, num_heads=8, num_kv_heads=2, head_dim=64, seed=0):
    """FP8 weights (layers/fp8.py): the row quantizer vs its torch reference (``*.mismatch``: the fraction of
    quants or scales that differ, expected 0), the FP8 GEMV in every fused form vs float64 products with the
    dequantized weight, and the ``_scaled_mm`` linear vs float64 products of the dequantized quantized rows."""
    # Needs triton (the layers below import it): deferred so that this module imports without it.
    from sglang_backend.runtime.layers import fp8
    from sglang_backend.runtime.layers.attention.triton_ops import fused_ops
    from sglang_backend.runtime.layers.attention.triton_ops.fp8_quant import quantize_rows_triton
    from sglang_backend.runtime.layers.attention.triton_ops.gemv import RopeStore, gemv

    gen = torch.Generator().manual_seed(seed)
    errs = {}

    def weight(n, k):
        w = (torch.randn(n, k, generator=gen) / k**0.5) * (1 + 4 * torch.rand(n, 1, generator=gen))
        q, s = fp8.quantize_weight(w.to(device))
        return q, s, q.double() * s.double()[:, None]

    for rows, k in ((1, hidden), (37, inter), (300, 4096 + 5)):
        x = (torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 10).to(device, dtype)
        q, s = quantize_rows_triton(x)
        q_ref, s_ref = fp8.quantize_rows_reference(x)
        errs[f"quantize_rows_{rows}x{k}.mismatch"] = float((q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean())
        errs[f"quantize_rows_{rows}x{k}.scale_mismatch"] = float((s != s_ref).float().mean())
    for n, k in ((inter + 16, hidden), (hidden, inter)):
        w, s, w_ref = weight(n, k)
        b = torch.randn(n, generator=gen).to(device, dtype)
        xv = torch.randn(1, k, generator=gen).to(device, dtype)
        ref = xv.double() @ w_ref.T
        errs[f"fp8_gemv_{n}x{k}"] = rel_err(gemv(xv, w, weight_scale=s), ref)
        errs[f"fp8_gemv_bias_{n}x{k}"] = rel_err(gemv(xv, w, b, weight_scale=s), ref + b.double())
        for m in (2, 37, 300):
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            xq, xs = fp8.quantize_rows_reference(x)
            ref = (xq.double() * xs.double()) @ w_ref.T + b.double()
            errs[f"fp8_linear_{m}x{k}x{n}"] = rel_err(fp8.linear(x, w, s, b), ref)
    # Fused forms at batch 1 vs the unfused FP8 GEMV and the fused-op kernels.
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    res = torch.randn(1, hidden, generator=gen).to(device, dtype)
    w_gu, s_gu, ref_gu = weight(2 * inter, hidden)
    w_dn, s_dn, ref_dn = weight(hidden, inter)
    normed = fused_ops.rmsnorm(res, norm_w, 1e-5)
    errs["fp8_gemv_norm"] = rel_err(gemv(res, w_gu, norm_weight=norm_w, eps=1e-5, weight_scale=s_gu),
                                    normed.double() @ ref_gu.T)
    h_ref = fused_ops.silu_and_mul(gemv(normed, w_gu, weight_scale=s_gu))
    h = gemv(res, w_gu, norm_weight=norm_w, eps=1e-5, silu_mul=True, weight_scale=s_gu)
    errs["fp8_gemv_norm_silu"] = rel_err(h, h_ref)
    r2 = res.clone()
    gemv(h, w_dn, residual=r2, weight_scale=s_dn)
    errs["fp8_gemv_residual"] = rel_err(r2, res.double() + h.double() @ ref_dn.T)
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    w_qkv, s_qkv, _ = weight((H + 2 * Hkv) * D, hidden)
    _, cos_sin = rope_table(D, device)
    k_buf = torch.zeros(64, Hkv, D, device=device, dtype=dtype)
    v_buf = torch.zeros_like(k_buf)
    pos1 = torch.tensor([int(torch.randint(0, 512, (1,), generator=gen))], device=device)
    loc1 = torch.tensor([int(torch.randint(1, 64, (1,), generator=gen))], device=device)
    ref_qkv = gemv(res, w_qkv, norm_weight=norm_w, eps=1e-5, weight_scale=s_qkv)
    k_ref, v_ref = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    fused_ops.rope_and_store_kv(ref_qkv, pos1, cos_sin, H, Hkv, D, loc1, k_ref, v_ref)
    k_out, v_out = torch.full_like(k_buf, float("nan")), torch.full_like(v_buf, float("nan"))
    out = gemv(res, w_qkv, norm_weight=norm_w, eps=1e-5, weight_scale=s_qkv,
               rope=RopeStore(pos1, cos_sin, H, Hkv, D, loc1, k_out, v_out))
    errs["fp8_gemv_rope"] = rel_err(out, ref_qkv)
    errs["fp8_gemv_rope.k"] = rel_err(k_out[loc1], k_ref[loc1])
    errs["fp8_gemv_rope.v"] = rel_err(v_out[loc1], v_ref[loc1])
    return errs
