"""A/B of scheduler knobs on one engine: the peer benchmark's sections run under several ServerArgs variants,
interleaved (variant order rotates each round), on one engine whose knobs are switched between runs. Only
knobs the scheduler reads per step qualify (``enable_mixed_chunk``, ``chunked_prefill_size``,
``max_prefill_tokens``, ``schedule_policy``...): the engine is built once.

    python -m benchmarks.peers.ab_knobs --model llama3-8b --cache off --sections shared_prefix \\
        --variant base: --variant mixed:enable_mixed_chunk=true --rounds 3 --out ab.json

Prints, per section, each variant's median seconds and its ratio to the first variant (> 1: faster), and
writes every run to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from benchmarks.peers.child import server_arg_overrides
from benchmarks.peers.ours import OurClient, make_engine
from benchmarks.peers.sections import SECTIONS, expand
from benchmarks.peers.workloads import FULL, SMOKE
from benchmarks.gpu.common import MODELS


def parse_variant(text: str) -> tuple[str, dict]:
    """``name:KEY=VALUE,KEY=VALUE`` (``name:`` alone: the engine's defaults)."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"--variant takes NAME:KEY=VALUE,..., not {text!r}")
    return name, server_arg_overrides([item for item in rest.split(",") if item])


def seconds_of(result: dict) -> float:
    """A section's time: its ``seconds`` (shared prefix, offline, cold prefill) or a program's ``elapsed_s``."""
    for key in ("seconds", "elapsed_s"):
        if key in result:
            return float(result[key])
    raise KeyError(f"no time in the section result (keys: {sorted(result)})")


def run(args) -> dict:
    variants = [parse_variant(v) for v in args.variant] or [("base", {})]
    eng = make_engine(args.model, args.device, args.cache == "on", args.mem_fraction)
    client, sz = OurClient(eng), SMOKE if args.smoke else FULL
    base_args = {k: getattr(eng.server_args, k) for _, over in variants for k in over}
    vocab = MODELS[args.model]["config"]["vocab_size"]
    runs = []
    try:
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
            for name, over in order:
                for key, value in {**base_args, **over}.items():  # the scheduler reads these every step
                    object.__setattr__(eng.server_args, key, value)
                for section in expand(args.sections):
                    t0 = time.perf_counter()
                    result = SECTIONS[section](client, sz, vocab)
                    runs.append(dict(round=rnd, variant=name, section=section, seconds=seconds_of(result),
                                     wall_s=time.perf_counter() - t0, well_formed=result.get("well_formed"),
                                     stats=eng.get_stats() if hasattr(eng, "get_stats") else None))
                    print(f"round {rnd} {name:>10} {section:>20}: {runs[-1]['seconds']:.4f} s", flush=True)
    finally:
        eng.shutdown()
    summary = {}
    for section in expand(args.sections):
        med = {name: statistics.median(r["seconds"] for r in runs if r["variant"] == name and r["section"] == section)
               for name, _ in variants}
        first = variants[0][0]
        summary[section] = {name: dict(median_s=m, speedup_vs_first=med[first] / m) for name, m in med.items()}
        print(f"{section}: " + "; ".join(f"{n} {v['median_s']:.4f} s ({v['speedup_vs_first']:.3f}x)"
                                         for n, v in summary[section].items()), flush=True)
    return dict(model=args.model, cache=args.cache, device=args.device, rounds=args.rounds,
                variants=[dict(name=n, server_args=o) for n, o in variants], sizes=dataclasses.asdict(sz),
                runs=runs, summary=summary)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--cache", default="on", choices=("on", "off"))
    ap.add_argument("--sections", default="shared_prefix")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    ap.add_argument("--smoke", action="store_true", help="every size shrunk (CPU, tiny model)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
