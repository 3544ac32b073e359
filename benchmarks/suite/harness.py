"""Runs workloads under baselines/ablations and measures them.

A *baseline* is a system configuration: the engine's ServerArgs (cache, table cache, schedule policy,
jump-forward), the frontend (parallel interpreter, prefix hints) or the HF transformers peer. A run is one
(workload, baseline, mode):

* ``throughput``: every instance at once (one thread per program, up to 128; intra-program parallelism on);
  programs/s and tokens/s over the whole batch;
* ``latency``: one program at a time (the paper's "no batching"); mean latency per program.

Hit rate = cached prompt tokens / prompt tokens over every request of the run (the engine's counters), and
the optimum for exactly those requests: ``optimal_hit_rate`` over the token sequences the engine received,
crediting tokens an earlier request decoded (their KV exists without any prefill).
"""

from __future__ import annotations

import statistics
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sglang_backend.runtime.managers.schedule_policy import optimal_hit_rate

from ..common import progress


@dataclass
class Baseline:
    name: str
    description: str
    engine: dict = field(default_factory=dict)  # ServerArgs overrides
    parallel: bool = True  # frontend parallelism: programs in threads, fork branches concurrently
    fork_hints: bool = True  # frontend prefix hints (fork, select, batch prefix)
    hf_batch: int = 0  # > 0: the HF transformers peer with this max batch (1 = sequential)


BASELINES = {b.name: b for b in [
    Baseline("full", "all optimizations (radix cache, cache-aware lpm order, parallel frontend, hints, jump-forward)"),
    Baseline("no_cache", "no KV reuse between requests (radix cache off)", engine={"disable_radix_cache": True}),
    Baseline("no_tree", "exact-match table cache: a cached sequence is reused only whole", engine={"table_cache": True}),
    Baseline("fcfs", "radix cache, first-come-first-served order", engine={"schedule_policy": "fcfs"}),
    Baseline("random", "radix cache, random order", engine={"schedule_policy": "random"}),
    Baseline("no_frontend_parallel", "programs and fork branches run one at a time", parallel=False),
    Baseline("no_hints", "no frontend prefix hints before fork/select/batch", fork_hints=False),
    Baseline("no_jump_forward", "constrained decoding token by token", engine={"disable_jump_forward": True}),
    Baseline("hf_sequential", "HF transformers generate, one call at a time", hf_batch=1),
    Baseline("hf_batched", "HF transformers generate, concurrent calls batched (max 32)", hf_batch=32),
]}

SAMPLING = dict(temperature=0.0, ignore_eos=True, max_new_tokens=128)  # fixed output lengths, greedy


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _dist(prefix: str, values: list[float]) -> dict:
    return {f"{prefix}_mean": statistics.fmean(values) if values else None,
            f"{prefix}_median": statistics.median(values) if values else None,
            f"{prefix}_p99": _pct(values, 0.99)}


def _batch_hint(workload, backend, n: int) -> None:
    """run_batch's hint: prefill the constant text every instance starts with, once, before the fan-out."""
    program = getattr(workload, "program", None)
    if program is not None:
        program.cache_batch_prefix(backend, n)


def _run_one(workload, kwargs: dict, backend, parallel: bool) -> float:
    t0 = time.perf_counter()
    if hasattr(workload, "run_one"):
        workload.run_one(kwargs, backend)
    else:
        state = workload.program.run(**kwargs, **SAMPLING, backend=backend, use_thread=parallel)
        state.sync()
        err = state.error()
        if err is not None:
            raise err
    return time.perf_counter() - t0


def wait_idle(engine, timeout: float = 120.0) -> None:
    """Waits until the engine has no running or waiting request (a failed program may leave calls behind)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.get_stats()
        if not stats["num_running"] and not stats["num_waiting"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine still busy after {timeout:.0f}s: {stats}")
        time.sleep(0.05)


def run(workload, instances: list[dict], backend, engine, baseline: Baseline, mode: str,
        show_progress: bool = True) -> dict:
    """Runs the instances; returns one result row (metrics + what was run)."""
    sched = engine.scheduler if engine is not None else None
    if engine is not None:
        wait_idle(engine)
        if not engine.flush_cache():
            raise RuntimeError("engine busy: cannot flush the cache before a run")
        sched.request_log = []
        before = engine.get_stats()
    else:
        before = {"num_generated_tokens": backend.num_generated_tokens, "num_prompt_tokens": backend.num_prompt_tokens}
    latencies: list[float] = []
    errors: list[str] = []
    threads = min(len(instances), 128) if (mode == "throughput" and baseline.parallel) else 1
    parallel = baseline.parallel

    def one(kwargs):
        try:
            latencies.append(_run_one(workload, kwargs, backend, parallel))
        except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
            errors.append(f"{type(e).__name__}: {e}")
            if len(errors) == 1:
                traceback.print_exc()
        bar.update()

    t0 = time.perf_counter()
    with progress(total=len(instances), desc=f"{workload.NAME}/{baseline.name}/{mode}", disable=not show_progress) as bar:
        if mode == "throughput":
            _batch_hint(workload, backend, len(instances))
        if threads > 1:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, instances))
        else:
            for kwargs in instances:
                one(kwargs)
    elapsed = time.perf_counter() - t0

    row = {"workload": workload.NAME, "baseline": baseline.name, "mode": mode, "programs": len(instances),
           "completed": len(latencies), "errors": len(errors), "first_error": errors[0] if errors else None,
           "elapsed_s": elapsed, "programs_per_s": len(latencies) / elapsed if elapsed > 0 else None,
           **_dist("latency_s", latencies)}
    if engine is not None:
        wait_idle(engine)
        after = engine.get_stats()
        reqs, sched.request_log = sched.request_log, None
        delta = {k: after[k] - before[k] for k in ("num_prompt_tokens", "num_cached_tokens", "num_generated_tokens",
                                                   "num_forward_tokens", "num_retractions", "num_jump_forward",
                                                   "num_evicted_tokens", "num_prefill_batches", "num_decode_batches")}
        ttft = [r.first_token_time - r.created_time for r in reqs
                if r.first_token_time is not None and r.sampling_params.max_new_tokens > 0]
        row.update(delta)
        row.update(_dist("ttft_s", ttft))
        row["num_requests"] = len(reqs)
        row["hit_rate"] = delta["num_cached_tokens"] / delta["num_prompt_tokens"] if delta["num_prompt_tokens"] else 0.0
        row["optimal_hit_rate"] = optimal_hit_rate([(r.extra_key, list(r.origin_input_ids), list(r.output_ids))
                                                    for r in reqs])
        row["hit_vs_optimal"] = row["hit_rate"] / row["optimal_hit_rate"] if row["optimal_hit_rate"] > 0 else None
        engine.check_pool_whole()
    else:
        row["num_generated_tokens"] = backend.num_generated_tokens - before["num_generated_tokens"]
        row["num_prompt_tokens"] = backend.num_prompt_tokens - before["num_prompt_tokens"]
        row["hit_rate"] = row["optimal_hit_rate"] = None
    row["output_tokens_per_s"] = row["num_generated_tokens"] / elapsed if elapsed > 0 else None
    row["prompt_tokens_per_s"] = row["num_prompt_tokens"] / elapsed if elapsed > 0 else None
    return row
