"""Where our time goes on the memory-pressure programs (``agents_under_pressure``, ``chat_under_pressure`` in
``programs.py``), step by step: every ``Scheduler.step`` timed and classified (prefill, decode, other), the decode
batch sizes, the host time spent in the radix tree and the host tier, the engine's statistics; then, on a GPU, one
more run under the CUDA profiler for GPU busy and idle time, kernel time by kind and the bytes copied to and from
host memory. Ours only (the side by side with vLLM is ``python -m benchmarks.peers --sections ...``).

    python -m benchmarks.peers.pressure_steps --programs chat_under_pressure,agents_under_pressure \\
        --engine-arg max_total_tokens=32768 --engine-arg kv_host_size=262144 --out steps.json

Each program runs once at a quarter of its size (warm-up: compiles, CUDA graphs), then at ``--scale``.
``--smoke`` runs the tiny model on the CPU at a small scale (the test).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

from benchmarks.gpu.common import MODELS
from benchmarks.peers import programs
from benchmarks.peers.child import server_arg_overrides
from benchmarks.peers.ours import OurClient, make_engine

STAT_KEYS = ("num_prefill_batches", "num_decode_batches", "num_retractions", "num_forward_tokens", "forward_seconds",
             "tree_op_seconds", "num_evicted_tokens", "kv_host_written_tokens", "kv_host_loaded_tokens",
             "num_prompt_tokens", "num_cached_tokens", "num_generated_tokens")
TREE_OPS = ("evict", "match_prefix", "load_back", "cache_finished_req", "cache_unfinished_req", "evict_host")


class StepLog:
    """Times each scheduler step and the tree and host-tier calls made in it (wrapping them on the instance)."""

    def __init__(self, sched):
        self.sched = sched
        self.steps: list[tuple[str, float, int]] = []  # (kind, seconds, running requests before it)
        self.host_time: collections.Counter = collections.Counter()
        real_step = sched.step

        def step():
            st = sched.stats
            n_pre, n_dec, running = st.num_prefill_batches, st.num_decode_batches, len(sched.running)
            t0 = time.perf_counter()
            out = real_step()
            dt = time.perf_counter() - t0
            kind = ("prefill" if st.num_prefill_batches > n_pre else "decode" if st.num_decode_batches > n_dec
                    else "other")
            self.steps.append((kind, dt, running))
            return out

        sched.step = step
        tree = sched.tree_cache
        for name in TREE_OPS:
            if hasattr(tree, name):
                self._time(tree, name, name)
        if getattr(tree, "host", None) is not None:
            self._time(tree.host, "backup", "host.backup")
            self._time(tree.host, "restore", "host.restore")
        self._time(sched.policy, "order", "policy.order")

    def _time(self, obj, name: str, key: str) -> None:
        real = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.host_time[key] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def clear(self) -> None:
        self.steps.clear()
        self.host_time.clear()

    def summary(self) -> dict:
        by_kind: dict = {}
        buckets: collections.Counter = collections.Counter()
        for kind, dt, running in self.steps:
            n, s = by_kind.get(kind, (0, 0.0))
            by_kind[kind] = (n + 1, s + dt)
            if kind == "decode":
                buckets[running // 4 * 4] += 1
        return {"steps": {k: {"n": n, "seconds": round(s, 3)} for k, (n, s) in by_kind.items()},
                "decode_steps_by_batch_size_bucket_of_4": dict(sorted(buckets.items())),
                "host_seconds": {k: round(v, 3) for k, v in self.host_time.most_common()}}


def profiled(run, client, vocab: int, scale: float) -> dict:
    """The program once more under the CUDA profiler: GPU busy and idle, kernel time by kind, bytes copied."""
    # Deferred: only GPU runs profile (torch.profiler and the trace helpers pull in the GPU benchmark code).
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu.engine import busy_and_gaps, device_events, kernel_kind

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run(client, vocab, scale, seed=0)
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        evs = device_events(prof, os.path.join(tmp, "trace.json"))
    if not evs:
        return {"wall_s": wall, "kernels": 0}
    busy, gaps = busy_and_gaps(evs, evs[0]["ts"])
    span = max(e["ts"] + e["dur"] for e in evs) - evs[0]["ts"]
    kinds: collections.Counter = collections.Counter()
    copied: collections.Counter = collections.Counter()
    for e in evs:
        kinds[kernel_kind(e["name"])] += e["dur"]
        if e.get("cat") == "gpu_memcpy":
            copied[e["name"][:40]] += e.get("args", {}).get("bytes", 0)
    return {"wall_s": round(wall, 3), "gpu_span_s": round(span / 1e6, 3), "gpu_busy_s": round(busy / 1e6, 3),
            "gpu_idle_s": round((span - busy) / 1e6, 3),
            "kernel_seconds_by_kind": {k: round(v / 1e6, 3) for k, v in kinds.most_common()},
            "copied_GB": {k: round(v / 1e9, 2) for k, v in copied.most_common()},
            "idle_in_gaps_of_1ms_or_more_s": round(sum(g for g, *_ in gaps if g >= 1000) / 1e6, 3)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="chat_under_pressure,agents_under_pressure")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an Engine argument (repeatable), e.g. max_total_tokens=32768 kv_host_size=262144")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled run (GPU)")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, scale 0.05")
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    model = "tiny" if args.smoke else args.model
    scale = 0.05 if args.smoke else args.scale
    names = [p for p in args.programs.split(",") if p]
    unknown = [p for p in names if p not in programs.PRESSURE_PROGRAMS]
    if unknown:
        ap.error(f"unknown programs {unknown}; choose from {sorted(programs.PRESSURE_PROGRAMS)}")
    overrides = server_arg_overrides(args.engine_arg)
    vocab = MODELS[model]["config"]["vocab_size"]
    eng = make_engine(model, device, True, 0.9, **overrides)
    client = OurClient(eng)
    log = StepLog(eng.scheduler)
    result = {"model": model, "device": device, "scale": scale, "engine_args": overrides, "programs": {}}
    try:
        for name in names:
            run = programs.PRESSURE_PROGRAMS[name]
            run(client, vocab, scale / 4, seed=1)  # warm-up
            log.clear()
            before = eng.get_stats()
            res = run(client, vocab, scale, seed=0)
            after = eng.get_stats()
            entry = {"seconds": round(res["seconds"], 3), "programs_per_s": round(res["programs_per_s"], 4),
                     "well_formed": res["well_formed"],
                     "stats": {k: round(after.get(k, 0) - before.get(k, 0), 3) for k in STAT_KEYS}, **log.summary()}
            if device == "cuda" and not args.no_profile:
                entry["profiled"] = profiled(run, client, vocab, scale)
            result["programs"][name] = entry
            steps = entry["steps"]
            print(f"{name}: {entry['seconds']:.2f} s, {entry['programs_per_s']:.3f} programs/s; steps "
                  + ", ".join(f"{k} {v['n']} in {v['seconds']:.2f} s" for k, v in steps.items())
                  + f"; host time {entry['host_seconds']}", flush=True)
    finally:
        client.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
