"""Sections that time the whole engine (scheduler, sampling, detokenizer state, overlapped decode), i.e. what a
user of ``Engine.generate`` gets: the per-step time of the loop (engine_decode), its GPU timeline with the idle
gaps (engine_trace), where the scheduler thread's CPU time goes (cpu_profile), the shared-prefix workload
(shared) and offline 1k in / 1k out throughput (offline). The ablations (no_overlap, no_pdl, no_radix) rerun
some of them on an engine with one feature off."""

from __future__ import annotations

import cProfile
import gzip
import json
import os
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.common import MODELS, PATHS, RESULT, log, rand_ids, section, shared_prefix_prompts

GREEDY = {"ignore_eos": True, "temperature": 0}


# cpu_profile --------------------------------------------------------------------------------------------------------
def profile_steps(eng, prompts, new: int) -> tuple:
    """Run one generate with cProfile around each Scheduler.step (in the engine's loop thread): (stats, steps,
    seconds in step(), wall seconds)."""
    sched = eng.scheduler
    orig = sched.step
    prof = cProfile.Profile()
    steps = {"n": 0, "s": 0.0}

    def profiled_step():
        t0 = time.perf_counter()
        prof.enable()
        try:
            return orig()
        finally:
            prof.disable()
            steps["n"] += 1
            steps["s"] += time.perf_counter() - t0

    eng.flush_cache()
    sched.step = profiled_step
    try:
        t = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, **GREEDY})
        t = time.perf_counter() - t
    finally:
        sched.step = orig
    return pstats.Stats(prof), steps["n"], steps["s"], t


@section("cpu_profile")
def bench_cpu_profile(eng, vocab: int):
    """Where the scheduler thread's time goes in the shared-prefix workload and a short 1k-context decode:
    cProfile around each Scheduler.step (run in the engine's loop thread), top functions by own time."""
    out = {}
    for name, prompts, new in (("shared", shared_prefix_prompts(9, vocab), 32),
                               ("decode_bs56_ctx1k", [rand_ids(1024, torch.Generator().manual_seed(i), vocab)
                                                      for i in range(56)], 64)):
        st, n_steps, step_s, t = profile_steps(eng, prompts, new)
        rows = sorted(((v[2], v[3], v[1], f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}") for k, v in st.stats.items()),
                      reverse=True)[:25]
        log(f"-- cpu profile {name}: {n_steps} steps, {step_s:.3f} s in step(), wall {t:.3f} s")
        for tt, ct, nc, fn in rows:
            log(f"{tt * 1e3:9.1f} ms own {ct * 1e3:9.1f} ms cum {nc:7d}x  {fn}")
        out[name] = {"steps": n_steps, "step_s": step_s, "wall_s": t,
                     "top_own": [[fn, tt, ct, nc] for tt, ct, nc, fn in rows]}
    eng.flush_cache()
    RESULT["cpu_profile"] = out


# engine_decode ------------------------------------------------------------------------------------------------------
@section("engine_decode")
def bench_engine_decode(eng, vocab: int, suffix: str = ""):
    """Per-step time of the whole engine loop (scheduler, sampling, detokenizer state) at ~1k context: (time of
    a 17+N-token generation - time of a 17-token one) / N, median of 3, so the prefill and the start and drain
    of the overlapped decode pipeline cancel out."""
    res = {}
    g = torch.Generator().manual_seed(11)
    base = 17
    for bs, steps in ((1, 128), (64, 32)):
        prompts = [rand_ids(1024, g, vocab) for _ in range(bs)]

        def timed(n: int) -> float:
            eng.flush_cache()
            t = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, **GREEDY})
            return time.perf_counter() - t

        timed(base + steps)  # warm-up
        per_step = statistics.median((timed(base + steps) - timed(base)) / steps for _ in range(3))
        res[f"engine_decode_step_bs{bs}_s{suffix}"] = per_step
        log(f"engine decode{suffix} bs={bs}: {per_step * 1e3:.2f} ms/step")
    eng.flush_cache()
    RESULT.setdefault("ours", {}).update(res)


# engine_trace -------------------------------------------------------------------------------------------------------
def trace_generate(eng, prompts, steps: int, path: str) -> tuple[list, float]:
    """Profile one generate (after a short warm one): the CUDA kernels, copies and memsets sorted by start,
    and the wall seconds. The chrome trace is kept gzipped at ``path``.gz."""
    sp = {"max_new_tokens": steps, **GREEDY}
    eng.flush_cache()
    eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=4))  # warm
    eng.flush_cache()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
    evs = device_events(prof, path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
        z.write(f.read())
    os.remove(path)
    return evs, wall


def device_events(prof, path: str) -> list:
    """The profiler's CUDA kernels, copies and memsets sorted by start, through its chrome trace written at ``path``."""
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = [e for e in json.load(f)["traceEvents"]
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    evs.sort(key=lambda e: e["ts"])
    return evs


def busy_and_gaps(win: list, t_lo: float) -> tuple[float, list]:
    """GPU-busy microseconds in the window (overlaps counted once) and the idle gaps (length, kernel before,
    kernel after)."""
    busy, end, gaps = 0.0, t_lo, []
    prev = None
    for e in win:
        s, f_ = e["ts"], e["ts"] + e["dur"]
        if s > end:
            gaps.append((s - end, prev["name"][:60] if prev else "", e["name"][:60]))
        busy += max(0.0, f_ - max(s, end))
        if f_ > end:
            end, prev = f_, e
    gaps.sort(reverse=True)
    return busy, gaps


def step_timeline(evs: list, layers: int, bs: int, wall: float, trace: str) -> dict | None:
    """Per decode step over whole steps (first step's first attention kernel to the last step's): time, busy
    and idle, kernel time by kernel, largest gaps. None when too few steps were seen."""
    attn = [e for e in evs if "decode_stage1" in e["name"]]
    n_steps = len(attn) // layers
    if n_steps < 3:
        log(f"engine_trace bs={bs}: only {len(attn)} decode attention kernels seen")
        return None
    t_lo, t_hi = attn[0]["ts"], attn[(n_steps - 1) * layers]["ts"]
    win = [e for e in evs if t_lo <= e["ts"] < t_hi]
    busy, gaps = busy_and_gaps(win, t_lo)
    span = t_hi - t_lo
    per = n_steps - 1
    by_name: dict = {}
    for e in win:
        k = e["name"][:70]
        c, tt = by_name.get(k, (0, 0.0))
        by_name[k] = (c + 1, tt + e["dur"])
    top = sorted(by_name.items(), key=lambda kv_: -kv_[1][1])
    big = sum(gp for gp, *_ in gaps if gp >= 5)
    log(f"engine_trace bs={bs}: {per} steps, {span / per / 1e3:.3f} ms/step, GPU busy {busy / per / 1e3:.3f} "
        f"ms/step, idle {(span - busy) / per / 1e3:.3f} ms/step ({big / per / 1e3:.3f} in gaps >= 5 us); "
        f"generate wall {wall:.2f} s")
    for k, (c, tt) in top[:16]:
        log(f"   {tt / per / 1e3:8.3f} ms/step {c / per:6.1f}x  {k}")
    for gp, a, b_ in gaps[:8]:
        log(f"   gap {gp:8.1f} us after {a} before {b_}")
    return {"steps": per, "step_ms": span / per / 1e3, "busy_ms": busy / per / 1e3,
            "idle_ms": (span - busy) / per / 1e3, "idle_in_gaps_ge5us_ms": big / per / 1e3,
            "kernels": [[k, c / per, tt / per / 1e3] for k, (c, tt) in top[:30]],
            "largest_gaps_us": gaps[:20], "trace": trace}


@section("engine_trace")
def bench_engine_trace(eng, vocab: int):
    """GPU timeline of the engine's own decode loop (CUDA kernels and copies from the profiler, scheduler and
    graph replays as in serving) at batch 1 and 64, 1k context: per decode step, kernel time by kernel, the
    time the GPU sits idle, and the largest idle gaps with the kernels around them. The traces go to $OUT."""
    out_dir = os.path.dirname(PATHS.out)
    g = torch.Generator().manual_seed(13)
    layers = MODELS[RESULT["model"]]["config"]["num_hidden_layers"]
    res = {}
    for bs, steps in ((1, 48), (64, 24)):
        prompts = [rand_ids(1024, g, vocab) for _ in range(bs)]
        path = os.path.join(out_dir, f"engine_trace_bs{bs}.json")
        evs, wall = trace_generate(eng, prompts, steps, path)
        timeline = step_timeline(evs, layers, bs, wall, path + ".gz")
        if timeline is not None:
            res[f"bs{bs}"] = timeline
    eng.flush_cache()
    RESULT["engine_trace"] = res


# shared, offline ----------------------------------------------------------------------------------------------------
@section("shared_prefix")
def bench_shared(eng, vocab: int, key: str):
    """128 requests = one 1024-token prefix + 64 unique tokens each, 32 output tokens: requests/s from a cold
    cache, and the prefill phase alone (one output token) to split prefill from decode."""
    sp = {"max_new_tokens": 32, **GREEDY}
    eng.flush_cache()
    eng.generate(input_ids=shared_prefix_prompts(3, vocab, n=32), sampling_params=sp)  # warm-up
    eng.flush_cache()
    prompts = shared_prefix_prompts(7, vocab)
    t1 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=1))
    t1 = time.perf_counter() - t1
    eng.flush_cache()
    before = eng.get_stats()
    t = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=sp)
    t = time.perf_counter() - t
    stats = eng.get_stats()
    # This workload's hit rate (the engine's own figure covers its whole lifetime, warm-up included).
    prompt_tokens = stats["num_prompt_tokens"] - before["num_prompt_tokens"]
    hit_rate = (stats["num_cached_tokens"] - before["num_cached_tokens"]) / prompt_tokens if prompt_tokens else 0.0
    RESULT.setdefault("ours", {})[key] = r = {
        "time_s": t, "req_per_s": len(prompts) / t, "cache_hit_rate": hit_rate,
        "prefill_phase_s": t1, "decode_step_s": (t - t1) / 31,
        "prefill_batches": stats["num_prefill_batches"] - before["num_prefill_batches"],
        "decode_batches": stats["num_decode_batches"] - before["num_decode_batches"],
        "tree_op_s": stats["tree_op_seconds"] - before["tree_op_seconds"]}
    log(f"   prefill phase {t1:.3f} s; decode ~{(t - t1) / 31 * 1e3:.1f} ms/step; "
        f"{r['prefill_batches']} prefill + {r['decode_batches']} decode batches; tree ops {r['tree_op_s']:.3f} s")
    log(f"{key}: {len(prompts)} requests in {t:.2f} s = {len(prompts) / t:.1f} req/s "
        f"(hit rate {hit_rate:.2f})")
    eng.flush_cache()


# shared_trace -------------------------------------------------------------------------------------------------------
KERNEL_KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("decode attention", ("decode_stage", "decode_prefix")),
    ("extend attention", ("extend_attn", "_fwd_kernel", "flash")),
    ("GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas")),
    ("copies and memsets", ("Memcpy", "Memset", "memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, keys in KERNEL_KINDS if any(k in name for k in keys)), "other")


@section("shared_trace")
def bench_shared_trace(eng, vocab: int):
    """Where the shared-prefix workload's time goes (issue 23): one cold-cache run under the profiler, its GPU
    time by kernel kind, the GPU idle time, and the longest idle gaps with the kernels around them (the chrome
    trace is kept gzipped beside the results JSON)."""
    trace = os.path.join(os.path.dirname(PATHS.out), "shared_trace.json")
    evs, wall = trace_generate(eng, shared_prefix_prompts(7, vocab), 32, trace)
    if not evs:
        log("shared_trace: no kernels seen")
        return
    t_lo = evs[0]["ts"]
    busy, gaps = busy_and_gaps(evs, t_lo)
    span = max(e["ts"] + e["dur"] for e in evs) - t_lo
    by_kind: dict = {}
    for e in evs:
        kind = kernel_kind(e["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
    # The decode phase starts at the first decode-attention kernel; before it the prefill batches run.
    t_decode = next((e["ts"] for e in evs if kernel_kind(e["name"]) == "decode attention"), float("inf"))
    phases = {"prefill": [e for e in evs if e["ts"] < t_decode], "decode": [e for e in evs if e["ts"] >= t_decode]}
    by_name = {phase: top_kernels(win) for phase, win in phases.items()}
    RESULT.setdefault("ours", {})["shared_trace"] = {
        "wall_s": wall, "gpu_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_idle_ms": (span - busy) / 1e3,
        "decode_phase_start_ms": (t_decode - t_lo) / 1e3 if by_name["decode"] else None,
        "kernel_ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernels_by_phase": by_name, "largest_gaps_us": gaps[:20]}
    log(f"shared_trace: generate {wall * 1e3:.1f} ms; GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f}, "
        f"idle {(span - busy) / 1e3:.1f}")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        log(f"   {us / 1e3:8.1f} ms  {kind}")
    for phase, rows in by_name.items():
        log(f"   {phase} phase, top kernels (ms, launches):")
        for name, ms, n in rows[:12]:
            log(f"      {ms:8.2f} ms {n:6d}x  {name}")
    for gp, a, b_ in gaps[:10]:
        log(f"   gap {gp / 1e3:7.2f} ms after {a} before {b_}")


def top_kernels(evs: list, n: int = 25) -> list:
    """The n kernels with the most GPU time in ``evs``: (name cut to 90 characters, ms, launches)."""
    by_name: dict = {}
    for e in evs:
        total, count = by_name.get(e["name"][:90], (0.0, 0))
        by_name[e["name"][:90]] = (total + e["dur"], count + 1)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name, total / 1e3, count) for name, (total, count) in rows]


def generate_timing_steps(eng, prompts, sp) -> tuple[list, list, float]:
    """Generate with each Scheduler.step timed: (outputs, per step (seconds, prefill batches, decode batches),
    wall seconds)."""
    sched = eng.scheduler
    orig_step, steps = sched.step, []

    def timed_step():
        st = sched.stats
        n_pre, n_dec = st.num_prefill_batches, st.num_decode_batches
        t0 = time.perf_counter()
        r = orig_step()
        steps.append((time.perf_counter() - t0, st.num_prefill_batches - n_pre, st.num_decode_batches - n_dec))
        return r

    sched.step = timed_step
    t = time.perf_counter()
    try:
        out = eng.generate(input_ids=prompts, sampling_params=sp)
    finally:
        sched.step = orig_step
    return out, steps, time.perf_counter() - t


@section("offline_1k_1k")
def bench_offline(eng, vocab: int, max_req: int, key: str = "offline_1k_1k"):
    """N requests of 1024 random tokens, 1024 output tokens each (as many as fit the KV pool in one wave, at most
    ``max_req``): output tokens/s, with the per-step times split into prefill and decode (by quarter of the run,
    to see the decode step grow with the context)."""
    mr = eng.scheduler.model_runner
    n = max(1, min(max_req, int(mr.max_total_num_tokens * 0.97) // 2048))
    g = torch.Generator().manual_seed(5)
    prompts = [rand_ids(1024, g, vocab) for _ in range(n)]
    sp = {"max_new_tokens": 1024, **GREEDY}
    eng.flush_cache()
    before = eng.get_stats()
    out, steps, t = generate_timing_steps(eng, prompts, sp)
    after = eng.get_stats()
    toks = sum(len(o["output_ids"]) for o in out)
    prefill_s = sum(dt for dt, p, _ in steps if p)
    dec = [dt for dt, p, d in steps if d and not p]
    quarters = [statistics.mean(dec[i * len(dec) // 4:(i + 1) * len(dec) // 4]) for i in range(4)] if len(dec) >= 4 else []
    log(f"   {len(steps)} steps: prefill {prefill_s:.2f} s; {len(dec)} decode steps {sum(dec):.2f} s, "
        f"mean ms per quarter of the run {[round(q * 1e3, 2) for q in quarters]}")
    RESULT.setdefault("ours", {})[key] = {
        "num_requests": n, "time_s": t, "output_tokens": toks, "output_tok_per_s": toks / t,
        "retractions": after["num_retractions"] - before["num_retractions"],
        "decode_batches": after["num_decode_batches"] - before["num_decode_batches"],
        "forward_seconds": after["forward_seconds"] - before["forward_seconds"],
        "prefill_step_s": prefill_s, "decode_step_s_total": sum(dec), "decode_step_ms_by_quarter": [q * 1e3 for q in quarters],
    }
    log(f"{key}: {n} requests, {toks} tokens in {t:.1f} s = {toks / t:.0f} tok/s "
        f"(forward {after['forward_seconds'] - before['forward_seconds']:.1f} s)")
    eng.flush_cache()
