"""The Triton fused-MoE kernel (sglang_backend/runtime/layers/attention/triton_ops/fused_moe.py) on one GPU:
time per MoE layer against its memory and compute floors, at two real layer shapes:

* Qwen3-30B-A3B: H=2048, I=768, E=128, top-8;   * Mixtral-8x7B: H=4096, I=14336, E=8, top-2;

bf16, T in {1, 8, 64, 256, 1024, 4096} tokens, router choices drawn at random (fresh inputs per T). Before it
is timed, each case is checked against the torch reference (layers.moe.torch_moe, the CPU path's arithmetic,
run in fp32 on the GPU). Each time is the median of --reps CUDA-graph replays of --calls back-to-back calls
(a decode step replays MoE layers from a graph; the kernels' launch cost is in the number), after warm-up.

Floors: the expert weights the batch really reads (distinct experts hit x 3 * H * I * 2 bytes) over
--peak-bw (H100 SXM: 3.35e12 B/s), and 6 * T * k * H * I FLOPs over --peak-flops (989e12, bf16 dense);
``ratio`` = time / max(floors) (1.0 would be perfect).

``--sweep`` also tries a list of launch configs at every case and writes the fastest per shape as a
``fused_moe_shapes`` block (copy it into triton_ops/configs/<device>.json, layers/kernel_options.py).

GPU:  python benchmarks/bench_moe.py [--out results.json] [--sweep]     (about a minute on an H100; --sweep more)

The helpers (``moe_inputs``, ``moe_reference``, ``rel_err``, ``check_align``) are also the inputs and reference of
tests/gpu/test_fused_moe.py and tests/gpu/interpreter_moe_check.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks.common import env_info, format_table  # noqa: E402
from sglang_backend.runtime.layers.moe import torch_moe  # noqa: E402

try:  # optional: triton (without it main() says so; the helpers below still import)
    from sglang_backend.runtime.layers.attention.triton_ops.fused_moe import (align_bounds, fused_moe, moe_align,
                                                                              moe_config, moe_shape_key)
except ImportError:
    align_bounds = fused_moe = moe_align = moe_config = moe_shape_key = None

SHAPES = {  # name: (hidden H, intermediate I, experts E, top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
TOKENS = (1, 8, 64, 256, 1024, 4096)
# Relative error ||out - ref|| / ||ref|| against the fp32 reference. Each output element sums I products of
# rounded activations (and the gate/up outputs before them are rounded too): errors of ~eps/2 each that add
# up randomly to about one or two eps of the output's norm (fp16 eps 2^-11 = 4.9e-4, bf16 2^-8 = 3.9e-3), so
# 8 eps (fp16) and 5 eps (bf16) leave room without hiding a wrong row (an error of order 1). fp32 runs the dot
# in IEEE fp32 (no TF32): only the summation order differs.
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}
SWEEP_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    (16, 32, 64, 1, 4, 4), (16, 64, 64, 1, 4, 4), (16, 64, 128, 1, 4, 3), (16, 128, 128, 1, 4, 3),
    (16, 32, 256, 1, 4, 3), (32, 64, 128, 8, 4, 3), (32, 128, 64, 8, 4, 4), (64, 64, 64, 8, 4, 3),
    (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4),
]


# Inputs and reference (shared with the tests) -------------------------------------------------------------------
def moe_inputs(T: int, H: int, I: int, E: int, k: int, dtype, device, seed: int, skew: bool = False,
               weights: tuple | None = None):
    """(x [T, H], w13 [E, 2I, H], w2 [E, H, I], experts [T, k], router weights [T, k]) with unit-scale
    activations. ``skew``: a sixteenth of the experts are strongly favoured and a quarter never chosen (when
    that leaves at least k), so loads are uneven and some experts empty. ``weights``: reuse (w13, w2)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    if weights is None:
        w13 = (torch.randn(E, 2 * I, H, generator=g, device=device, dtype=dtype) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, generator=g, device=device, dtype=dtype) * I ** -0.5).to(dtype)
    else:
        w13, w2 = weights
    logits = torch.randn(T, E, generator=g, device=device)
    if skew:
        perm = torch.randperm(E, generator=g, device=device)
        bias = torch.zeros(E, device=device)
        bias[perm[: max(1, E // 16)]] = 4.0
        if E - E // 4 >= k:
            bias[perm[E - E // 4:]] = -30.0
        logits = logits + bias
    # As SparseMoE.route: softmax in fp32, top-k, renormalised, cast to the activations' dtype.
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    w, experts = torch.topk(probs, k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return x, w13, w2, experts, w.to(dtype)


def moe_reference(x, w13, w2, experts, weights, dtype=torch.float32) -> torch.Tensor:
    """The CPU path's arithmetic (layers.moe.torch_moe) on the same inputs cast to ``dtype``."""
    return torch_moe(x.to(dtype), w13.to(dtype), w2.to(dtype), experts, weights.to(dtype))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        raise AssertionError("non-finite value in the output")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def check_align(experts: torch.Tensor, num_experts: int, block_m: int) -> None:
    """moe_align's invariants (raises AssertionError): the padded length, the buffer sizes, every slot once
    in a block of its own expert, each expert's run where the layout puts it, sentinels in the padding."""
    sorted_ids, block_expert, num_valid = moe_align(experts, num_experts, block_m)
    n = experts.numel()
    flat = experts.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(num_valid)
    assert total == int(padded.sum()), (total, padded.sum())
    assert (sorted_ids.numel(), block_expert.numel()) == align_bounds(n, num_experts, block_m)[::-1]
    assert total <= sorted_ids.numel()
    used = sorted_ids[:total].long()
    real = used < n
    assert sorted(used[real].tolist()) == list(range(n)), "every slot exactly once"
    assert (used[~real] == n).all(), "padding holds the sentinel"
    owner = block_expert[: total // block_m].long().repeat_interleave(block_m)
    assert (flat[used[real]] == owner[real]).all(), "each slot sits in a block of its own expert"
    starts = torch.cumsum(padded, 0) - padded
    for e in torch.nonzero(counts).flatten().tolist():  # each expert's run starts where the layout says
        run = used[starts[e] : starts[e] + padded[e]]
        assert (flat[run[run < n]] == e).all() and int((run < n).sum()) == counts[e]


# Timing ---------------------------------------------------------------------------------------------------------
def time_graph(fn, calls: int, reps: int) -> float:
    """Median seconds per call: a CUDA graph of ``calls`` calls replayed ``reps`` times (eager if capture
    fails: then launch overhead is in the number)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except RuntimeError as e:  # keep timing without graphs
        print(f"  (CUDA graph capture failed, timing eagerly: {e})")

        def run():
            for _ in range(calls):
                fn()
    run()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(samples)


def measure(name: str, T: int, weights, ref_weights, args, seed: int, config=None) -> dict:
    H, I, E, k = SHAPES[name]
    x, w13, w2, experts, w = moe_inputs(T, H, I, E, k, torch.bfloat16, "cuda", seed, weights=weights)
    out = fused_moe(x, w13, w2, experts, w, config=config)
    err = rel_err(out, moe_reference(x, *ref_weights, experts, w))
    if err > TOL[torch.bfloat16]:
        raise AssertionError(f"{name} T={T} config={config}: relative error {err:.3g} > {TOL[torch.bfloat16]}")
    seconds = time_graph(lambda: fused_moe(x, w13, w2, experts, w, config=config), args.calls, args.reps)
    distinct = int(experts.unique().numel())
    weight_bytes = distinct * 3 * H * I * w13.element_size()
    flops = 6 * T * k * H * I
    bw_floor, flop_floor = weight_bytes / args.peak_bw, flops / args.peak_flops
    return {"shape": name, "T": T, "config": list(config or moe_config(T, E, k, H, I)), "time_us": seconds * 1e6,
            "rel_err": err, "experts_hit": distinct, "weight_bytes": weight_bytes, "flops": flops,
            "bw_floor_us": bw_floor * 1e6, "flop_floor_us": flop_floor * 1e6,
            "ratio": seconds / max(bw_floor, flop_floor), "tflops": flops / seconds / 1e12,
            "weight_gbps": weight_bytes / seconds / 1e9}


def sweep_shape(name: str, weights, ref_weights, args, seed: int) -> tuple[list, list]:
    """(every measured row, the fused_moe_shapes rows: the fastest config per T, each up to the geometric
    middle between its T and the next)."""
    rows, best = [], []
    for T in args.tokens:
        timed = []
        for config in SWEEP_CONFIGS:
            try:
                timed.append(measure(name, T, weights, ref_weights, args, seed + T, config))
            except Exception as e:  # noqa: BLE001 - a config past the GPU's shared memory: skip it
                print(f"  {name} T={T} {config}: skipped ({type(e).__name__}: {str(e)[:120]})")
        rows += timed
        if timed:
            win = min(timed, key=lambda r: r["time_us"])
            print(f"  {name} T={T}: best {tuple(win['config'])} {win['time_us']:.1f} us")
            best.append((T, win["config"]))
    table = []
    for i, (T, config) in enumerate(best):
        bound = int((T * best[i + 1][0]) ** 0.5) if i + 1 < len(best) else None
        table.append([bound, *config])
    return rows, table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--calls", type=int, default=10, help="calls per CUDA graph")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed (median)")
    p.add_argument("--peak-bw", type=float, default=3.35e12, help="HBM bytes/s (H100 SXM 3.35e12)")
    p.add_argument("--peak-flops", type=float, default=989e12, help="dense bf16 FLOP/s (H100 SXM 989e12)")
    p.add_argument("--sweep", action="store_true", help="also time SWEEP_CONFIGS and report the fastest")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or fused_moe is None:
        sys.exit("bench_moe.py needs a CUDA GPU and triton (the fused-MoE kernel is GPU-only)")
    results, tuned = [], {}
    for s, name in enumerate(args.shapes):
        H, I, E, k = SHAPES[name]
        x, w13, w2, _, _ = moe_inputs(1, H, I, E, k, torch.bfloat16, "cuda", seed=1000 + s)
        weights, ref_weights = (w13, w2), (w13.float(), w2.float())
        for T in args.tokens:
            row = measure(name, T, weights, ref_weights, args, seed=2000 + 100 * s + T)
            results.append(row)
            print(f"{name} T={T}: {row['time_us']:.1f} us, ratio {row['ratio']:.2f}, err {row['rel_err']:.2e}")
        if args.sweep:
            rows, table = sweep_shape(name, weights, ref_weights, args, seed=3000 + 100 * s)
            results += [dict(r, sweep=True) for r in rows]
            tuned[moe_shape_key(E, k, H, I)] = table
        del weights, ref_weights, w13, w2
        torch.cuda.empty_cache()
    headers = ["shape", "T", "config", "us", "experts", "MB", "bw floor", "flop floor", "ratio", "TFLOP/s"]
    print(format_table(headers, [[r["shape"], r["T"], tuple(r["config"]), f"{r['time_us']:.1f}", r["experts_hit"],
                                  f"{r['weight_bytes'] / 1e6:.1f}", f"{r['bw_floor_us']:.1f}",
                                  f"{r['flop_floor_us']:.1f}", f"{r['ratio']:.2f}", f"{r['tflops']:.1f}"]
                                 for r in results if not r.get("sweep")]))
    if tuned:
        print("fused_moe_shapes for triton_ops/configs/<device>.json:\n" + json.dumps({"fused_moe_shapes": tuned}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env_info(), "args": vars(args), "results": results,
                       "fused_moe_shapes": tuned}, f, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
