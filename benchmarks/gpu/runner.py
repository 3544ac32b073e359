"""Sections that drive ``ModelRunner.forward`` directly on hand-made batches (the engine is idle meanwhile):
the decode step and prefill against the bandwidth floor and the matmul rate (runner), the fused GEMV's launch
configs judged by the whole step (gemv_step_sweep), decode over a shared vs private prefix (runner_shared) and
the per-kernel time of an eager step (profile)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.common import (MODELS, PATHS, RESULT, TUNED, alloc_requests, cuda_time, free_requests, log,
                                   random_kv, section, weight_bytes_at)
from sglang_backend.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode


def decode_batch(mr, rows, per, bs: int, ctx: int, vocab: int) -> ForwardBatch:
    """A decode step of ``bs`` requests at ``ctx`` tokens of context over the slots ``alloc_requests`` gave."""
    return ForwardBatch(ForwardMode.DECODE, torch.randint(3, vocab, (bs,), device="cuda"),
                        torch.full((bs,), ctx - 1, device="cuda"), torch.stack([p[-1] for p in per]),
                        torch.tensor(rows, device="cuda"), torch.full((bs,), ctx, device="cuda"), [ctx] * bs,
                        logits_indices=torch.arange(bs, device="cuda"),
                        shares_prefix=mr.req_to_token_pool.shares_prefix(rows, 1))


# runner -------------------------------------------------------------------------------------------------------------
def runner_variants(base) -> list[tuple]:
    """(batch, linears, PDL, fused merge) to time; the product defaults among them become the headline
    "decode_bs1"/"decode_bs64". The fused linears only where the runner has fused kernels."""
    variants = [(1, m, p, f) for m, p, f in (
        ("fused_rope", True, True), ("fused_rope", False, True), ("fused_rope", False, False), ("fused", True, True),
        ("on", True, True), ("off", True, True)) if base.fused_ops or m == "off"]
    return variants + [(64, "off", True, True), (64, "off", False, True)]


def synced_times(mr, fb) -> list[float]:
    """Wall seconds of a step followed by an argmax read on the host, as the scheduler waits for each step."""
    def synced():
        mr.forward(fb).argmax(-1).tolist()

    t_sync = []
    for _ in range(3):
        synced()
    for _ in range(30):
        t0 = time.perf_counter()
        synced()
        t_sync.append(time.perf_counter() - t0)
    return t_sync


def time_decode_variant(mr, mb: dict, bw, variant: tuple, res: dict):
    """One (batch, linears, PDL, fused merge) variant at 1k context, graphed back to back and synced, vs the
    bandwidth floor; with the eager time for the record where it is a product mode."""
    bs, gemv_mode, use_pdl, fused_merge = variant
    ctx = 1024
    rows, slots, per = alloc_requests(mr, [ctx] * bs)
    fb = decode_batch(mr, rows, per, bs, ctx, mr.vocab_size)
    pipelined = cuda_time(lambda: mr.forward(fb), 30, 5)
    t_sync = synced_times(mr, fb)
    floor_bytes = weight_bytes_at(mb, bs) + bs * ctx * mb["kv_bytes_per_token"]
    floor = floor_bytes / bw if bw else None
    step = statistics.median(pipelined)
    key = f"decode_bs{bs}_{gemv_mode}_{'pdl' if use_pdl else 'nopdl'}{'' if fused_merge else '_stage2'}"
    res[key] = {"gemv_mode": gemv_mode, "pdl": use_pdl, "fused_merge": fused_merge,
                "ctx": ctx, "step_s": step,
                "step_synced_s": statistics.median(t_sync), "floor_bytes": floor_bytes, "floor_s": floor,
                "ratio_to_floor": step / floor if floor else None, "achieved_Bps": floor_bytes / step}
    log(f"decode bs={bs} ctx={ctx} [{key}]: {step * 1e3:.3f} ms (synced {statistics.median(t_sync) * 1e3:.3f} ms); "
        f"floor {floor * 1e3 if floor else float('nan'):.3f} ms; ratio {step / floor if floor else float('nan'):.3f}")
    if use_pdl and fused_merge and gemv_mode in ("fused_rope", "off"):  # eager, for the record
        gr = mr.graph_runner
        mr.graph_runner = None
        try:
            res[key]["step_eager_s"] = statistics.median(cuda_time(lambda: mr.forward(fb), 10, 2))
        finally:
            mr.graph_runner = gr
        log(f"   eager (no graph): {res[key]['step_eager_s'] * 1e3:.3f} ms")
    free_requests(mr, rows, slots)


def pick_headline(res: dict, base, default_mode: str, pdl_supported: bool):
    """"decode_bs1"/"decode_bs64": the variant of the engine's resolved options at that batch size
    (``KernelOptions.for_tokens``; the fastest when the default is outside the measured variants, say --gemv-mode
    on), with the fastest variant's name beside it."""
    for bs in (1, 64):
        opts = base.for_tokens(bs)
        best = min((k for k in res if k.startswith(f"decode_bs{bs}_")), key=lambda k: res[k]["step_s"])
        key = (f"decode_bs{bs}_{default_mode if bs == 1 else 'off'}_{'pdl' if opts.pdl and pdl_supported else 'nopdl'}"
               + ("" if opts.attention_merge == "fused" else "_stage2"))
        if key not in res:
            key = best
        res[f"decode_bs{bs}"] = dict(res[key], variant=key, fastest_variant=best)
        log(f"decode bs={bs}: default {key} {res[key]['step_s'] * 1e3:.3f} ms; fastest {best}")


def time_prefill(mr, mb: dict, mm_rate, res: dict):
    """Prefill of 8 x 1024 new tokens: achieved FLOP/s (linear layers + causal attention) vs the matmul rate."""
    n_req, n = 8, 1024
    V = mr.vocab_size
    rows, slots, per = alloc_requests(mr, [n] * n_req)
    T = n_req * n
    fb = ForwardBatch(ForwardMode.EXTEND, torch.randint(3, V, (T,), device="cuda"),
                      torch.arange(n, device="cuda").repeat(n_req), slots, torch.tensor(rows, device="cuda"),
                      torch.full((n_req,), n, device="cuda"), [n] * n_req,
                      extend_prefix_lens_cpu=[0] * n_req, extend_seq_lens_cpu=[n] * n_req,
                      logits_indices=torch.arange(n_req, device="cuda") * n + n - 1)
    times = cuda_time(lambda: mr.forward(fb), 7, 2)
    t = statistics.median(times)
    L, H, D = mb["layers"], mb["heads"], mb["head_dim"]
    linear_flops = 2 * T * mb["matmul_params"] + 2 * n_req * mb["lm_head_params"]
    attn_flops = 4 * L * H * D * n_req * (n * (n + 1) // 2)
    flops = linear_flops + attn_flops
    res["prefill_8x1024"] = {"time_s": t, "flops": flops, "linear_flops": linear_flops, "attn_flops": attn_flops,
                             "achieved_flops": flops / t, "matmul_rate": mm_rate,
                             "fraction_of_matmul_rate": flops / t / mm_rate if mm_rate else None,
                             "tokens_per_s": T / t}
    log(f"prefill 8x1024: {t * 1e3:.1f} ms = {flops / t / 1e12:.0f} TFLOP/s "
        f"({flops / t / mm_rate * 100 if mm_rate else float('nan'):.0f}% of matmul rate)")
    free_requests(mr, rows, slots)


@section("runner")
def bench_runner(eng, mb: dict, name: str):
    """Decode step and prefill through ModelRunner.forward (the engine is idle meanwhile). Each decode variant
    is new kernel options for the runner (batch-1 linears cuBLAS / Triton GEMV / fused GEMV, PDL, the decode
    attention's merge folded into stage 1 or a stage-2 kernel), which recaptures its graphs; the engine's own
    options are restored for the following sections."""
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_ops import pdl

    eng.flush_cache()
    mr = eng.scheduler.model_runner
    random_kv(mr)
    ceil = RESULT.get("ceilings", {})
    bw = ceil.get("copy_bw_Bps")
    mm_rate = ceil.get("matmul_flops", {}).get(MODELS[name]["dtype"])
    res = {}
    base = mr.kernel_options  # the engine's, from its ServerArgs
    for variant in runner_variants(base):
        _, gemv_mode, use_pdl, fused_merge = variant
        gc.collect()
        mr.set_kernel_options(dataclasses.replace(base, gemv_mode=gemv_mode, pdl=use_pdl, one_token_pdl=None,
                                                  one_token_merge=None,
                                                  attention_merge="fused" if fused_merge else "stage2"))
        time_decode_variant(mr, mb, bw, variant, res)
    default_mode = base.gemv_mode
    pdl_supported = pdl.supported(torch.empty(0, device="cuda"))
    pick_headline(res, base, default_mode, pdl_supported)
    gc.collect()
    mr.set_kernel_options(base)
    one = base.for_tokens(1)
    log(f"configured for the following sections: batch-1 linears {default_mode}, PDL {one.pdl and pdl_supported} "
        f"at batch 1 and {base.pdl and pdl_supported} above, merge {one.attention_merge} / {base.attention_merge}")
    time_prefill(mr, mb, mm_rate, res)
    eng.flush_cache()
    RESULT.setdefault("ours", {}).update(res)


# gemv_step_sweep ----------------------------------------------------------------------------------------------------
# Launch configs (rows per program, K tile, warps, stages) around the default: fewer rows per program, longer K
# tiles, more warps or stages.
GEMV_STEP_CANDIDATES = [[4, 1024, 4, 3], [2, 1024, 4, 3], [2, 2048, 4, 3], [1, 2048, 4, 3], [4, 2048, 8, 2],
                        [4, 1024, 4, 4], [4, 1024, 8, 3], [4, 512, 4, 4], [4, 512, 2, 4], [2, 1024, 2, 4],
                        [8, 1024, 4, 3], [8, 512, 4, 3], [16, 256, 4, 3],
                        # longer K tiles for FP8 weights (half the bytes per element)
                        [8, 2048, 4, 3], [8, 2048, 8, 3], [4, 4096, 8, 3], [2, 4096, 4, 3]]


def gemv_weight_shapes(mr) -> dict:
    """Weight name -> the "N,K,silu" key of its shape in KernelConfigs.gemv_shapes (",fp8" appended for FP8)."""
    lm = getattr(mr.model, "language_model", mr.model)
    layer = lm.model.layers[0]
    shapes = {"qkv": (layer.self_attn.qkv_proj.weight, False), "o": (layer.self_attn.o_proj.weight, False),
              "gate_up": (layer.mlp.gate_up_proj.weight, True), "down": (layer.mlp.down_proj.weight, False),
              "lm_head": (lm.lm_head_weight, False)}
    return {k: f"{w.shape[0]},{w.shape[1]},{int(silu)}" + (",fp8" if w.dtype == torch.float8_e4m3fn else "")
            for k, (w, silu) in shapes.items()}


def coordinate_descent(step_time, shapes: dict, chosen: dict, default_cfg, best_t: float, runs: list) -> float:
    """One weight shape at a time, every candidate with the others at their best so far; ``chosen`` ends with
    the winners. Returns the best step time."""
    for name, key in shapes.items():
        best_cfg = list(chosen.get(key, default_cfg))
        for cfg in GEMV_STEP_CANDIDATES:
            if cfg == best_cfg:
                continue
            chosen[key] = cfg
            try:
                t = step_time()
            except Exception as e:  # noqa: BLE001 - a config may not compile (registers, shared memory)
                log(f"  {name} {cfg} failed: {e!r}"[:200])
                continue
            runs.append({"shape": name, "config": cfg, "step_s": t})
            log(f"  {name} {cfg}: {t * 1e3:.3f} ms")
            if t < best_t:
                best_t, best_cfg = t, cfg
        chosen[key] = best_cfg
        log(f"  {name} {key}: best {best_cfg} ({best_t * 1e3:.3f} ms)")
    return best_t


def write_gemv_config(res: dict, chosen: dict, mb: dict, ctx: int):
    """The winners, merged into this run's tuned configs, to $OUT/kernel_config_gemv_<model>.json; the final
    step time against the bandwidth floor when the ceilings were measured."""
    shapes = res["shapes"]
    path = os.path.join(os.path.dirname(PATHS.out) or ".", f"kernel_config_gemv_{RESULT['model']}.json")
    with open(path, "w") as f:
        json.dump({**TUNED, "gemv_shapes": {**TUNED.get("gemv_shapes", {}), **chosen}}, f, indent=1)
    res["kernel_config_file"] = path
    floor = (mb["weight_bytes"] + ctx * mb["kv_bytes_per_token"]) / RESULT["ceilings"]["copy_bw_Bps"] \
        if "ceilings" in RESULT else None
    res["floor_s"] = floor
    log(f"gemv step sweep: {res['start_s'] * 1e3:.3f} -> {res['final_s'] * 1e3:.3f} ms"
        + (f" ({res['final_s'] / floor:.3f}x floor)" if floor else "") + "; gemv_shapes = {"
        + ", ".join(f"{shapes[n]!r}: {c}" for n, c in res["chosen"].items()) + f"}} (written to {path})")


@section("gemv_step_sweep")
def bench_gemv_step_sweep(eng, mb: dict):
    """Launch configs of the fused batch-1 GEMV, judged by the whole decode step (bs 1, 1k context, CUDA graph)
    rather than by each GEMV alone (alone, launch and tail dominate and mislead). One weight shape at a time,
    the others at their best so far (coordinate descent); the winners go into the runner's kernel options
    (KernelConfigs.gemv_shapes) for the rest of the run and into $OUT/kernel_config_gemv_<model>.json, to be
    copied into the device's file in triton_ops/configs/."""
    mr = eng.scheduler.model_runner
    base = mr.kernel_options
    if not base.fused_ops:
        log("no fused kernels: skipped")
        return
    eng.flush_cache()
    random_kv(mr)
    opts = base if base.fused_gemv else dataclasses.replace(base, gemv_mode="fused_rope")
    full_capture_bs = mr.graph_runner.capture_bs
    shapes = gemv_weight_shapes(mr)
    ctx = 1024
    rows, slots, per = alloc_requests(mr, [ctx])
    fb = ForwardBatch(ForwardMode.DECODE, torch.randint(3, mr.vocab_size, (1,), device="cuda"),
                      torch.full((1,), ctx - 1, device="cuda"), per[0][-1:], torch.tensor(rows, device="cuda"),
                      torch.full((1,), ctx, device="cuda"), [ctx], logits_indices=torch.arange(1, device="cuda"))

    chosen: dict = dict(opts.configs.gemv_shapes)
    for key in shapes.values():  # each shape starts at the config it runs with now
        n, k, silu, *fp8 = key.split(",")
        chosen.setdefault(key, list(opts.configs.gemv_config(int(n), int(k), bool(int(silu)), fp8=bool(fp8))))

    def step_time() -> float:
        configs = dataclasses.replace(opts.configs, gemv_shapes=dict(chosen))
        gc.collect()
        mr.set_kernel_options(dataclasses.replace(opts, configs=configs), capture_bs=[1])
        return statistics.median(cuda_time(lambda: mr.forward(fb), 30, 5))

    res = {"shapes": shapes, "runs": []}
    try:
        res["start_s"] = best_t = step_time()
        log(f"gemv step sweep: start {best_t * 1e3:.3f} ms")
        coordinate_descent(step_time, shapes, chosen, opts.configs.gemv, best_t, res["runs"])
        res["final_s"] = step_time()
        res["chosen"] = {name: list(chosen.get(key, opts.configs.gemv)) for name, key in shapes.items()}
        write_gemv_config(res, chosen, mb, ctx)
    finally:
        free_requests(mr, rows, slots)
        gc.collect()
        # The winners stay for the rest of the run, in the engine's own GEMV mode.
        configs = dataclasses.replace(base.configs, gemv_shapes=dict(chosen))
        mr.set_kernel_options(dataclasses.replace(base, configs=configs), capture_bs=full_capture_bs)
    RESULT["gemv_step_sweep"] = res


# runner_shared ------------------------------------------------------------------------------------------------------
def prefix_decode_step(mr, bs: int, prefix: int, unique: int, shared: bool) -> float:
    """Graphed decode step of ``bs`` requests whose first ``prefix`` KV slots are the same slots (``shared``)
    or each their own, then ``unique`` private slots each."""
    ctx = prefix + unique
    rows = [mr.req_to_token_pool.alloc() for _ in range(bs)]
    n_slots = prefix + bs * unique if shared else bs * ctx
    slots = mr.token_to_kv_pool_allocator.alloc(n_slots)
    last = []
    for i, r in enumerate(rows):
        if shared:
            own = slots[prefix + i * unique: prefix + (i + 1) * unique]
            mr.req_to_token_pool.write(r, 0, slots[:prefix])
            mr.req_to_token_pool.write(r, prefix, own)
        else:
            own = slots[i * ctx: (i + 1) * ctx]
            mr.req_to_token_pool.write(r, 0, own)
        last.append(own[-1])
    fb = ForwardBatch(ForwardMode.DECODE, torch.randint(3, mr.vocab_size, (bs,), device="cuda"),
                      torch.full((bs,), ctx - 1, device="cuda"), torch.stack(last).to("cuda"),
                      torch.tensor(rows, device="cuda"), torch.full((bs,), ctx, device="cuda"), [ctx] * bs,
                      logits_indices=torch.arange(bs, device="cuda"),
                      shares_prefix=mr.req_to_token_pool.shares_prefix(rows, 1))
    step = statistics.median(cuda_time(lambda: mr.forward(fb), 20, 3))
    mr.token_to_kv_pool_allocator.free(slots)
    for r in rows:
        mr.req_to_token_pool.free(r)
    return step


@section("runner_shared")
def bench_runner_shared(eng, mb: dict):
    """Decode step at batch 128 where every request's first 1024 KV slots are the same slots (a radix hit),
    vs the same batch with private slots: shows whether decode attention re-reads the shared prefix from
    HBM or from L2."""
    eng.flush_cache()
    mr = eng.scheduler.model_runner
    random_kv(mr)
    prefix, unique = 1024, 65
    ctx = prefix + unique
    bs = 128 if mr.max_total_num_tokens >= 128 * ctx else 96  # the private variant must fit the pool
    res = {}
    for shared in (True, False):
        step = prefix_decode_step(mr, bs, prefix, unique, shared)
        key = "shared" if shared else "private"
        res[key] = step
        log(f"runner decode bs={bs} ctx={ctx} {key} prefix slots: {step * 1e3:.2f} ms")
    bw = RESULT.get("ceilings", {}).get("copy_bw_Bps")
    if bw:
        res["floor_shared_s"] = (weight_bytes_at(mb, bs) + (prefix + bs * unique) * mb["kv_bytes_per_token"]) / bw
        res["floor_private_s"] = (weight_bytes_at(mb, bs) + bs * ctx * mb["kv_bytes_per_token"]) / bw
    eng.flush_cache()
    res["bs"] = bs
    RESULT.setdefault("ours", {})["runner_shared"] = res


# profile ------------------------------------------------------------------------------------------------------------
def profile_eager_step(mr, fb) -> list[tuple]:
    """(kernel, calls per step, device microseconds per step) of 5 eager decode steps, longest first."""
    gr = mr.graph_runner
    mr.graph_runner = None
    try:
        for _ in range(3):
            mr.forward(fb)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                mr.forward(fb)
            torch.cuda.synchronize()
    finally:
        mr.graph_runner = gr
    rows_out = []
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dt <= 0:
            continue
        rows_out.append((ev.key[:90], ev.count / 5, dt / 5))
    rows_out.sort(key=lambda r: -r[2])
    return rows_out


@section("profile")
def bench_profile(eng):
    """Per-kernel GPU time of one eager decode step (bs 1 and 64, 1k context)."""
    mr = eng.scheduler.model_runner
    eng.flush_cache()
    random_kv(mr)
    out = {}
    for bs in (1, 64):
        ctx = 1024
        rows, slots, per = alloc_requests(mr, [ctx] * bs)
        fb = decode_batch(mr, rows, per, bs, ctx, 1000)
        rows_out = profile_eager_step(mr, fb)
        total = sum(r[2] for r in rows_out)
        log(f"-- eager decode bs={bs}: kernel time per step {total / 1e3:.3f} ms")
        for k, c, t in rows_out[:14]:
            log(f"{t / 1e3:8.3f} ms  {c:6.0f}x  {t / max(c, 1):8.1f} us  {k}")
        out[f"bs{bs}"] = {"kernel_ms_per_step": total / 1e3, "top": rows_out[:20]}
        free_requests(mr, rows, slots)
    RESULT["profile"] = out
