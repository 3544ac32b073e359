"""Keeping agents' KV under memory pressure (issue 26): agents that call the model, wait for a tool, and call again
with their history, while one-shot requests from other users stream through a KV pool too small for everyone.

Each agent is a thread: ``steps`` calls, each prompt = its history so far (a unique task, then every earlier
reply and a tool observation), ``max_new_tokens`` greedy tokens, then a tool sleep drawn from a fixed
distribution. Meanwhile ``noise`` threads send unique one-shot prompts, back to back or at ``noise_rate``. The same workload (same
seeds) runs on one engine per variant, ``rounds`` times each, the order rotating every round:

* ``generic``: the radix cache alone (``session_ttl=0``, no host tier, ``program_scheduling="off"``): what any
  engine with prefix caching gives;
* ``programs``: program-level scheduling alone (waiting requests of the programs served least go first);
* ``pins``: session pins alone (adaptive time to live) keep a live agent's prefix on the device;
* ``host``: the host tier alone (``kv_host_size``) keeps evicted KV in host memory and copies it back on a hit;
* ``pins_host``: pins and the host tier;
* ``all``: all three (the defaults plus the host tier).

``--steps`` takes one count or a comma-separated list that agents take in turn (agent ``i`` runs
``steps[i % len]`` calls): programs of mixed lengths, where program-level scheduling matters; ``--stagger-s``
makes them arrive over time (agent ``i`` starts ``i * stagger`` seconds in).

Reported per variant (medians over rounds): agent program completion time (p50, max), all agents' wall time and
programs/s, the agents' re-prefilled prompt tokens (prompt tokens the cache did not have, minus each step's new
tokens: history computed again), KV copied back from the host, and the noise requests' throughput.

    python -m benchmarks.bench_sessions --out benchmarks/results/sessions_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import threading
import time

from benchmarks.common import rotated, variant_medians

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def steps_list(text: str) -> list[int]:
    steps = [int(x) for x in text.split(",") if x.strip()]
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError("steps: positive counts, comma-separated")
    return steps


def agent(engine, idx: int, args, out: dict) -> None:
    time.sleep(idx * args.stagger_s)  # programs arriving over time; each one's completion time counts from its start
    rng = random.Random(1000 + idx)
    history = f"Agent {idx} task: {words(rng, args.task_words)}\n"
    t0 = time.perf_counter()
    recomputed, replies = 0, []
    for step in range(args.steps[idx % len(args.steps)]):
        new_tokens = len(engine.tokenizer.encode(history)) - out.setdefault("_last_len", {}).get(idx, 0)
        r = engine.generate(history, {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True},
                            session_id=f"agent-{idx}")
        meta = r["meta_info"]
        recomputed += max(0, meta["prompt_tokens"] - meta["cached_tokens"] - new_tokens)
        replies.append(r["text"])
        history += r["text"] + f"\nObservation {step}: {words(rng, args.obs_words)}\n"
        out["_last_len"][idx] = meta["prompt_tokens"] + meta["completion_tokens"]
        time.sleep(rng.uniform(*args.tool_s))
    out.setdefault("agents", []).append(dict(idx=idx, seconds=time.perf_counter() - t0, recomputed_tokens=recomputed,
                                             replies=replies))


def noise(engine, idx: int, args, stop: threading.Event, out: dict) -> None:
    """One-shot prompts from other users: back to back, or (``noise_rate``) arriving at that many per second, spaced
    by seeded exponential gaps (a request that outlasts its gap delays the next one)."""
    rng = random.Random(5000 + idx)
    n, next_at = 0, time.perf_counter()
    while not stop.is_set():
        if args.noise_rate:
            next_at += rng.expovariate(args.noise_rate)
            if stop.wait(max(0.0, next_at - time.perf_counter())):
                break
        engine.generate(f"User {idx}-{n}: {words(rng, args.noise_words)}", {"max_new_tokens": 4, "temperature": 0})
        n += 1
    out.setdefault("noise_requests", []).append(n)


OFF = dict(program_scheduling="off")
VARIANTS = {"generic": dict(session_ttl=0, **OFF), "programs": dict(session_ttl=0), "pins": dict(OFF),
            "host": dict(session_ttl=0, kv_host_size=None, **OFF), "pins_host": dict(kv_host_size=None, **OFF),
            "all": dict(kv_host_size=None)}  # None: --host-tokens


def one_run(args, variant: str) -> dict:
    from sglang_backend import Engine  # deferred: the whole runtime

    knobs = {k: (args.host_tokens if v is None else v) for k, v in VARIANTS[variant].items()}
    engine = Engine(max_total_tokens=args.pool_tokens, log_level="warning", **knobs)
    try:
        out: dict = {}
        stop = threading.Event()
        noisy = [threading.Thread(target=noise, args=(engine, i, args, stop, out)) for i in range(args.noise)]
        agents = [threading.Thread(target=agent, args=(engine, i, args, out)) for i in range(args.agents)]
        t0 = time.perf_counter()
        for t in noisy + agents:
            t.start()
        for t in agents:
            t.join()
        elapsed = time.perf_counter() - t0
        stop.set()
        for t in noisy:
            t.join()
        stats = engine.get_stats()
        for name in [f"agent-{i}" for i in range(args.agents)]:
            engine.end_session(name)
        engine.check_pool_whole()
    finally:
        engine.shutdown()
    times = sorted(a["seconds"] for a in out["agents"])
    # Greedy replies, every agent's in order: equal digests = the variant changed no output
    digest = hashlib.sha256(json.dumps(sorted((a["idx"], a["replies"]) for a in out["agents"])).encode()).hexdigest()
    return dict(variant=variant, elapsed_s=elapsed, programs_per_s=args.agents / elapsed, replies_sha256=digest[:16],
                agent_p50_s=statistics.median(times), agent_mean_s=statistics.fmean(times), agent_max_s=times[-1],
                recomputed_tokens=sum(a["recomputed_tokens"] for a in out["agents"]),
                noise_requests_per_s=sum(out.get("noise_requests", [])) / elapsed,
                evicted_tokens=stats["num_evicted_tokens"], host_loaded_tokens=stats.get("kv_host_loaded_tokens", 0),
                pins={k: v for k, v in stats.items() if k.startswith("session_")},
                host={k: v for k, v in stats.items() if k.startswith("kv_host_")},
                programs={k: v for k, v in stats.items() if k.startswith("program_")})


SUMMARY_KEYS = ("agent_p50_s", "agent_mean_s", "agent_max_s", "elapsed_s", "programs_per_s", "recomputed_tokens", "host_loaded_tokens",
                "noise_requests_per_s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--steps", type=steps_list, default=[4], help="calls per agent: N, or N1,N2,... taken in turn")
    ap.add_argument("--task-words", type=int, default=120)
    ap.add_argument("--obs-words", type=int, default=40)
    ap.add_argument("--stagger-s", type=float, default=0.0, help="agent i starts i times this many seconds late")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--tool-s", type=float, nargs=2, default=(0.5, 1.5), metavar=("MIN", "MAX"))
    ap.add_argument("--noise", type=int, default=1, help="threads of one-shot requests from other users")
    ap.add_argument("--noise-words", type=int, default=300)
    ap.add_argument("--noise-rate", type=float, default=0.0, help="requests/s per noise thread (0: back to back)")
    ap.add_argument("--pool-tokens", type=int, default=3072, help="KV pool: too small for all agents plus noise")
    ap.add_argument("--host-tokens", type=int, default=32768, help="host tier of the host and all variants")
    ap.add_argument("--variants", default="generic,pins,host,all", help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    runs = []
    for rnd in range(args.rounds):
        for variant in rotated(variants, rnd):
            runs.append(dict(round=rnd, **one_run(args, variant)))
            r = runs[-1]
            print(f"round {rnd} {variant:8s}: agents p50 {r['agent_p50_s']:.2f} s, max {r['agent_max_s']:.2f} s, "
                  f"{r['programs_per_s']:.3f} programs/s, re-prefilled {r['recomputed_tokens']} tokens, "
                  f"from host {r['host_loaded_tokens']}, noise {r['noise_requests_per_s']:.2f} req/s", flush=True)
    summary = variant_medians(runs, "variant", variants, SUMMARY_KEYS, "generic", "agent_p50_s", "programs_per_s")
    summary["replies_identical"] = len({r["replies_sha256"] for r in runs}) == 1
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), runs=runs, summary=summary), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
