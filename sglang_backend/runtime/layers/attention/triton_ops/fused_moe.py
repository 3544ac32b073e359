"""Fused mixture-of-experts MLP for the GPU: every expert's SiLU-gated MLP over its tokens in two grouped GEMMs.

``fused_moe(x, w13, w2, experts, weights)`` computes what layers/moe.py's torch loop computes, without a host
sync (so a decode step with MoE layers can be captured in a CUDA graph):

1. :func:`moe_align` (one single-program kernel) sorts the T * k (token, choice) slots by expert and pads each
   expert's run to a multiple of BLOCK_M, so every BLOCK_M rows of the sorted list belong to one expert. The
   buffers have a static size (an upper bound of the padded length), the real length stays on the device, and
   the GEMMs' programs past it return at once.
2. gate-up: each row block gathers its tokens' rows of x and multiplies them by its expert's ``w13`` (gate and
   up tiles in the same program), and the epilogue writes ``silu(gate) * up`` [rows, I] in sorted order;
3. down: the sorted rows times the expert's ``w2``, times the router weight of the slot, written to the slot's
   own row [T * k, H]; a sum over each token's k rows gives the output.

Roundings follow the torch reference (each GEMM accumulates in fp32 and is rounded to the activation dtype,
then silu, the product with ``up``, the product with the router weight, each rounded as torch rounds them);
the k-way sum is torch's (fp32 accumulation, one rounding) where the reference adds expert by expert.

Launch configurations (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) come from
:func:`moe_config`: built-in choices by the mean number of rows per expert, or per-shape rows of
``KernelConfigs.fused_moe_shapes`` (the per-device JSON of layers/kernel_options.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernel_options import KernelConfigs

_ALIGN_CHUNK = 1024  # slots per step of the align kernel's loops
_ALIGN_BLOCKS = 64  # row blocks per step when it finds each block's expert


@triton.jit
def _topk_softmax_kernel(Logits, Ids, Weights, num_experts, stride_l,
                         TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, RENORM: tl.constexpr):
    """One token: softmax of its router logits in fp32, the top-k (highest first, the lower id on ties), their
    probabilities optionally divided by their sum, cast to the weights' dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_POW2)
    logits = tl.load(Logits + row * stride_l + offs, mask=offs < num_experts, other=-float("inf")).to(tl.float32)
    e = tl.exp(logits - tl.max(logits, 0))
    probs = e / tl.sum(e, 0)
    kk = tl.arange(0, K_POW2)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    weights = tl.zeros([K_POW2], dtype=tl.float32)
    left = tl.where(offs < num_experts, probs, -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(left, 0)
        ids = tl.where(kk == j, best, ids)
        weights = tl.where(kk == j, tl.max(left, 0), weights)
        left = tl.where(offs == best, -1.0, left)
    if RENORM:
        weights = weights / tl.sum(weights, 0)
    tl.store(Ids + row * TOP_K + kk, ids, mask=kk < TOP_K)
    tl.store(Weights + row * TOP_K + kk, weights.to(Weights.dtype.element_ty), mask=kk < TOP_K)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k] int32, weights [T, k] in ``dtype``): what layers/moe.py's
    torch routing computes (fp32 softmax, top-k, optional renormalisation, one cast) in one launch instead of
    five or six small ones, which at decode sizes cost more than the work."""
    T, E = logits.shape
    assert logits.stride(-1) == 1
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, top_k), dtype=dtype, device=logits.device)
    if T:
        _topk_softmax_kernel[(T,)](logits, ids, weights, E, logits.stride(0), TOP_K=top_k,
                                   K_POW2=triton.next_power_of_2(top_k), E_POW2=triton.next_power_of_2(E),
                                   RENORM=renormalize, num_warps=1 if E <= 256 else 4)
    return ids, weights


@triton.jit
def _moe_align_kernel(Experts, SortedIds, BlockExpert, NumValid, Cursor,
                      num_slots, num_experts, max_rows, max_blocks,
                      BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr):
    """One program (its phases ordered by barriers): count the slots of each expert, lay the experts' padded
    runs end to end, name each row block's expert, fill the list with the sentinel, then drop every slot at
    its expert's next free position (an atomic cursor per expert: the order inside a run does not matter,
    each row's result is the same wherever it sits)."""
    offs = tl.arange(0, CHUNK)
    bins = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        valid = start + offs < num_slots
        e = tl.load(Experts + start + offs, mask=valid, other=0).to(tl.int32)
        # Lanes past the end were counted in bin 0 (a histogram without a mask works on every Triton 3.x).
        counts += tl.histogram(e, E_POW2) - tl.where(bins == 0, CHUNK - tl.sum(valid.to(tl.int32), 0), 0)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(Cursor + bins, ends - padded, mask=bins < num_experts)
    tl.store(NumValid, tl.sum(padded, 0))

    offs_b = tl.arange(0, CHUNK_B)
    for b0 in range(0, max_blocks, CHUNK_B):
        blocks = b0 + offs_b
        # A block's expert is the number of experts whose run ends at or before its first row (empty
        # experts end where the previous one does, so they are skipped).
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(BlockExpert + blocks, tl.minimum(expert, num_experts - 1), mask=blocks < max_blocks)

    for r0 in range(0, max_rows, CHUNK):
        tl.store(SortedIds + r0 + offs, num_slots, mask=r0 + offs < max_rows)
    tl.debug_barrier()  # the sentinels and cursors are written before any slot lands
    for start in range(0, num_slots, CHUNK):
        slots = start + offs
        valid = slots < num_slots
        e = tl.load(Experts + slots, mask=valid, other=0).to(tl.int32)
        pos = tl.atomic_add(Cursor + e, 1, mask=valid)
        tl.store(SortedIds + pos, slots, mask=valid)


def align_bounds(num_slots: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(row blocks, rows) that the padded list can need at most: each expert that has slots pads fewer than
    block_m rows, at most min(E, T*k) experts have slots, and no block is all padding."""
    blocks = min(num_slots, (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)
    return blocks, blocks * block_m


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts: [T, k] expert ids -> (sorted_ids [rows] int32: slot ids t * k + j grouped by expert, each
    expert's run padded to a multiple of block_m with the sentinel T * k; block_expert [rows / block_m] int32:
    the expert of each block; num_valid [1] int32: the padded length in use). Sizes are the static bound of
    :func:`align_bounds`; nothing is read back to the host."""
    assert experts.dim() == 2
    flat = experts.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_slots = flat.numel()
    max_blocks, max_rows = align_bounds(num_slots, num_experts, block_m)
    dev = experts.device
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_valid = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)  # scratch: each expert's next free row
    if num_slots == 0:
        num_valid.zero_()
        return sorted_ids, block_expert, num_valid
    # At least a warp's worth of bins: older Tritons' histogram wants one bin per lane.
    _moe_align_kernel[(1,)](flat, sorted_ids, block_expert, num_valid, cursor,
                            num_slots, num_experts, max_rows, max_blocks,
                            BLOCK_M=block_m, E_POW2=max(32, triton.next_power_of_2(num_experts)),
                            CHUNK=_ALIGN_CHUNK, CHUNK_B=_ALIGN_BLOCKS, num_warps=8)
    return sorted_ids, block_expert, num_valid


@triton.jit
def _tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """GROUP_M row blocks (mostly one expert's) walk the column blocks together, sharing weight tiles in L2."""
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _moe_gemm_kernel(A, B, C, RouterW, SortedIds, BlockExpert, NumValid,
                     N, K, num_slots, top_k, num_pid_m, stride_am, stride_be, stride_bn, stride_cm, up_offset,
                     GATE_UP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C = A[rows] @ B[expert]^T per row block. GATE_UP: A = x gathered by token (slot // top_k), B = w13
    (gate row n, up row N + n, ``up_offset`` elements further), C [rows, N] in sorted order = silu(gate) * up.
    Else: A = the sorted activations, B = w2, C [T * k, N] at each slot's row = the product times the slot's
    router weight. Padding rows load zeros and store nothing."""
    pid_m, pid_n = _tile_of(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumValid):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(SortedIds + offs_m)
    real = slot < num_slots  # not padding
    if GATE_UP:
        a_rows = slot // top_k
    else:
        a_rows = offs_m
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [K, N] tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=real[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16's raw bits; products of bf16 are exact in fp32 anyway
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATE_UP:
            u = tl.load(b_ptrs + up_offset, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    dt = C.dtype.element_ty
    if GATE_UP:  # as F.silu(gate) * up on the rounded GEMM outputs
        gate = acc.to(dt).to(tl.float32)
        up = acc_up.to(dt).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
        c_rows = offs_m
    else:  # as F.linear(...) * weight, each rounded
        w = tl.load(RouterW + slot, mask=real, other=0.0).to(tl.float32)
        y = acc.to(dt).to(tl.float32) * w[:, None]
        c_rows = slot
    c_ptrs = C + c_rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, y.to(dt), mask=real[:, None] & mask_n[None, :])


# Built-in launch configs by the mean rows per expert (T * k / E): (most rows, config). Decode-sized batches
# take 16-row blocks (the least padding; the GEMMs only stream weights) with long K tiles and narrow N tiles
# (enough programs to keep every SM streaming: Mixtral's down GEMM at T=1 is 2 experts x 4096 / 32 blocks);
# prefill takes big tiles for tensor-core throughput. Chosen for an H100 by reasoning, not yet swept
# (benchmarks/bench_moe.py --sweep writes tuned rows for KernelConfigs.fused_moe_shapes).
DEFAULT_MOE_CONFIGS = (
    (16, (16, 32, 128, 1, 4, 4)),
    (48, (32, 64, 128, 8, 4, 3)),
    (96, (64, 64, 64, 8, 4, 3)),
    (None, (128, 128, 64, 8, 8, 3)),
)


def moe_shape_key(num_experts: int, top_k: int, hidden: int, inter: int) -> str:
    """Key of ``KernelConfigs.fused_moe_shapes``: "E,k,H,I" (I: this rank's intermediate size)."""
    return f"{num_experts},{top_k},{hidden},{inter}"


def moe_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
               configs: KernelConfigs | None = None) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for T tokens. A tuned row list for this
    shape in ``configs.fused_moe_shapes`` ([max_tokens, *config], the first with T <= max_tokens; a last
    row's max_tokens may be null) wins over the built-in table."""
    rows = (configs.fused_moe_shapes if configs is not None else {}).get(
        moe_shape_key(num_experts, top_k, hidden, inter))
    if rows:
        for row in rows:
            if row[0] is None or num_tokens <= row[0]:
                return tuple(row[1:])
        return tuple(rows[-1][1:])
    per_expert = num_tokens * top_k / num_experts
    for most, config in DEFAULT_MOE_CONFIGS:
        if most is None or per_expert <= most:
            return config
    raise AssertionError("the last default has no bound")


def _grouped_gemm(a, b, c, router_w, aligned, n, k, top_k, gate_up: bool, config: tuple) -> None:
    sorted_ids, block_expert, num_valid = aligned
    block_m, block_n, block_k, group_m, warps, stages = config
    num_pid_m = block_expert.numel()
    grid = (num_pid_m * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, router_w, sorted_ids, block_expert, num_valid,
        n, k, router_w.numel(), top_k, num_pid_m, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        n * b.stride(1),
        GATE_UP=gate_up, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=a.device.type != "cuda" and a.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor, config: tuple | None = None, configs: KernelConfigs | None = None
              ) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; experts [T, k] ids; weights [T, k]
    router weights (x's dtype) -> [T, H] in x's dtype: sum_j weights[t, j] * expert_{experts[t, j]}(x[t]).
    ``config`` forces a launch config, else :func:`moe_config` picks one (``configs``: tuned per device)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = experts.shape[1]
    assert w13.shape == (E, 2 * inter, H) and w2.shape == (E, H, inter), (x.shape, w13.shape, w2.shape)
    assert experts.shape == weights.shape == (T, top_k)
    assert x.dtype == w13.dtype == w2.dtype and x.stride(-1) == 1
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1 and w13.stride(1) == H and w2.stride(1) == inter
    if T == 0:
        return x.new_zeros((0, H))
    config = config or moe_config(T, E, top_k, H, inter, configs)
    aligned = moe_align(experts, E, config[0])
    router_w = weights.reshape(-1).contiguous()
    act = torch.empty((aligned[0].numel(), inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, router_w, aligned, inter, H, top_k, True, config)
    y = torch.empty((T * top_k, H), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, y, router_w, aligned, H, inter, top_k, False, config)
    return y.view(T, top_k, H).sum(1)
