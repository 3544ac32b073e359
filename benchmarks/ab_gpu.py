"""Two source trees, one GPU run: the headline GPU figures of an old and a new checkout, interleaved.

A refactor that should leave speed unchanged is checked by running ``benchmarks.bench_gpu`` from both trees
in turn (old, new, old, new, ...) on the same machine in one sitting, so clock drift and a warm or cold GPU
hit both alike; the old-vs-old spread across rounds is the noise floor the new/old ratio is read against.

    git archive <old-commit> | tar -x -C /tmp/old
    python -m benchmarks.ab_gpu /tmp/old . --model llama3-8b --rounds 2

Prints a table (median per figure, new/old ratio, spread) and writes ``$OUT/ab_gpu.json`` (or
``benchmarks/results/ab_gpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# (label, path into bench_gpu's JSON, True when larger is better)
FIGURES = [
    ("decode step, batch 1, 1k ctx (ms)", ("ours", "decode_bs1", "step_s"), False),
    ("decode step, batch 64, 1k ctx (ms)", ("ours", "decode_bs64", "step_s"), False),
    ("prefill 8 x 1024 (ms)", ("ours", "prefill_8x1024", "time_s"), False),
    ("shared prefix (req/s)", ("ours", "shared_prefix", "req_per_s"), True),
    ("offline 1k in / 1k out (output tok/s)", ("ours", "offline_1k_1k", "output_tok_per_s"), True),
]


def figure(result: dict, path: tuple) -> float | None:
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    if isinstance(result, (int, float)):
        return result * 1e3 if path[-1] in ("step_s", "time_s") else float(result)
    return None


def run_tree(tree: str, tag: str, args, out_dir: str) -> dict | None:
    output = os.path.join(out_dir, f"ab_{tag}.json")
    cmd = [sys.executable, "-m", "benchmarks.bench_gpu", "--model", args.model, "--only", args.only,
           "--output", output]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=args.timeout)
    print(f"[{tag}] exit {done.returncode} in {time.monotonic() - start:.0f} s", flush=True)
    if done.returncode != 0 or not os.path.exists(output):
        print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", flush=True)
        return None
    with open(output) as f:
        return json.load(f)


def shared_prefix_driver(model: str, repeats: int, output: str) -> None:
    """Runs in the tree under test (its cwd): the shared-prefix workload of bench_gpu ``repeats`` times on one
    engine. One pass takes under a second, too short for one sample to tell a few percent apart."""
    sys.path.insert(0, os.getcwd())  # the tree under test, not the one this file came from
    import torch  # deferred: only the driver subprocess needs the GPU stack

    from benchmarks.bench_gpu import MODELS, make_model_dir
    from sglang_backend import Engine

    vocab = MODELS[model]["config"]["vocab_size"]
    engine = Engine(model_path=make_model_dir(model), load_format="dummy", dtype=MODELS[model]["dtype"],
                    device="cuda", attention_backend="triton", log_level="warning")
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, vocab, (1024,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, vocab, (64,), generator=gen).tolist() for _ in range(128)]
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=prompts[:32], sampling_params=params)  # warm-up
    rates = []
    for _ in range(repeats):
        engine.flush_cache()
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        rates.append(len(prompts) / (time.perf_counter() - start))
    engine.shutdown()
    with open(output, "w") as f:
        json.dump({"ours": {"shared_prefix_repeated": {"req_per_s": rates}}}, f)


def run_shared_driver(tree: str, tag: str, args, out_dir: str) -> list[float]:
    output = os.path.join(out_dir, f"ab_shared_{tag}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--driver-output", output, "--model", args.model,
           "--shared-repeats", str(args.shared_repeats), tree, tree]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not os.path.exists(output):
        print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", flush=True)
        return []
    with open(output) as f:
        rates = json.load(f)["ours"]["shared_prefix_repeated"]["req_per_s"]
    print(f"[shared {tag}] req/s {[round(r, 1) for r in rates]}", flush=True)
    return rates


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for label, path, higher_is_better in FIGURES:
        values = {side: [v for v in (figure(r, path) for r in runs[side]) if v is not None] for side in runs}
        if not values["old"] or not values["new"]:
            rows.append({"figure": label, "old": values["old"], "new": values["new"]})
            continue
        old, new = statistics.median(values["old"]), statistics.median(values["new"])
        spread = max((max(v) - min(v)) / statistics.median(v) for v in values.values())
        speed_ratio = new / old if higher_is_better else old / new  # > 1: the new tree is faster
        rows.append({"figure": label, "old": values["old"], "new": values["new"], "old_median": old,
                     "new_median": new, "new_speed_over_old": speed_ratio, "spread": spread})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old_tree")
    ap.add_argument("new_tree")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--only", default="ceilings,runner,shared,offline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--shared-repeats", type=int, default=0,
                    help="instead of bench_gpu: the shared-prefix workload this many times per engine, per tree")
    ap.add_argument("--driver-output", help=argparse.SUPPRESS)  # internal: run the driver in this process
    args = ap.parse_args(argv)
    if args.driver_output:
        return shared_prefix_driver(args.model, args.shared_repeats, args.driver_output)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    if args.shared_repeats:
        return compare_shared(args, out_dir)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for round_ in range(args.rounds):
        for side, tree in (("old", args.old_tree), ("new", args.new_tree)):
            result = run_tree(os.path.abspath(tree), f"{side}{round_}", args, out_dir)
            if result is not None:
                runs[side].append(result)
    rows = summarize(runs)
    with open(os.path.join(out_dir, "ab_gpu.json"), "w") as f:
        json.dump({"model": args.model, "only": args.only, "rounds": args.rounds, "rows": rows}, f, indent=1)
    print(f"\n{'figure':40} {'old':>10} {'new':>10} {'new speed/old':>14} {'spread':>8}")
    for row in rows:
        if "old_median" not in row:
            print(f"{row['figure']:40} missing (old {row['old']}, new {row['new']})")
            continue
        print(f"{row['figure']:40} {row['old_median']:10.3f} {row['new_median']:10.3f} "
              f"{row['new_speed_over_old']:14.3f} {row['spread']:8.3f}")


def compare_shared(args, out_dir: str) -> None:
    rates = {"old": [], "new": []}
    paired = []  # new/old of each round's medians: the GPU's state drifts between rounds, less within one
    for round_ in range(args.rounds):
        medians = {}
        for side, tree in (("old", args.old_tree), ("new", args.new_tree)):
            got = run_shared_driver(os.path.abspath(tree), f"{side}{round_}", args, out_dir)
            rates[side] += got
            medians[side] = statistics.median(got) if got else None
        if medians["old"] and medians["new"]:
            paired.append(medians["new"] / medians["old"])
    if not rates["old"] or not rates["new"]:
        print("missing runs", rates)
        return
    old, new = statistics.median(rates["old"]), statistics.median(rates["new"])
    summary = {"model": args.model, "req_per_s": rates, "old_median": old, "new_median": new,
               "new_speed_over_old": new / old, "paired_round_ratios": paired,
               "paired_median": statistics.median(paired) if paired else None}
    with open(os.path.join(out_dir, "ab_gpu_shared.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"shared prefix req/s: old median {old:.1f}, new median {new:.1f}, new/old {new / old:.3f}; "
          f"per round new/old {[round(r, 3) for r in paired]}, median {summary['paired_median']:.3f}")


if __name__ == "__main__":
    main()
