"""RadixAttention end to end: our engine with the radix cache + LPM vs the cache off vs the cache + FCFS, one run.

Shared-prefix workload (the paper's few-shot / shared-system-prompt shape): ``--groups`` groups of
``--per-group`` prompts; every prompt of a group is the group's ``--prefix-len``-token prefix followed by its own
``--question-len``-token question; each generates exactly ``--output-len`` tokens (greedy, ``ignore_eos``). All
prompts are submitted at once (one ``generate`` call), in a shuffled order. Token ids are random ordinary ids
(seeded); group prefixes start with different tokens. Three engine configurations, all started (and warmed up)
before any timing; each timed run starts from a flushed cache:

* ``radix_lpm``   radix cache on, ``schedule_policy=lpm`` (the default)
* ``no_cache``    ``disable_radix_cache=True`` (every prompt computed in full)
* ``radix_fcfs``  radix cache on, ``schedule_policy=fcfs``

With ``--repeats N`` every configuration runs N times, interleaved (the order rotates each round, so other load
on the machine hits all configurations alike), and the median-wall run is reported. Reported per
configuration: wall time, requests/s, output tokens/s, total (prompt + output) tokens/s, prompt tokens actually
computed, cache hit rate (cached prompt tokens / prompt tokens, from ``get_stats()``) next to the workload's
optimal hit rate (``schedule_policy.optimal_hit_rate``), and the throughput ratio vs ``no_cache``. Greedy
outputs of all runs are compared token for token (``outputs_identical``).

No-reuse workload: ``--noreuse-prompts`` all-distinct prompts (no two share even their first token) of
``--noreuse-len`` tokens, on ``radix_lpm`` and ``no_cache``. It measures the radix tree's overhead when there is
nothing to reuse: ``tree_op_fraction = get_stats()["tree_op_seconds"] / wall time`` (the paper: < 0.3%), and
the throughput ratio vs the cache off (with ``--repeats``, the median over runs of each run's fraction). Tree ops are prefix matching (including LPM's ordering of the waiting
queue), insertion, eviction and lock bookkeeping, timed inside the scheduler.

    python -m benchmarks.bench_radix                      # SmolLM2-135M (embedded default model)
    python -m benchmarks.bench_radix --tiny               # tiny random-weight Llama, seconds
    python -m benchmarks.bench_radix --smoke              # tiny model, tiny workload (CI)
    python -m benchmarks.bench_radix --groups 4 --per-group 8 --output /tmp/radix_4x8.json   # a smaller workload
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.common import default_output, env_info, format_table, progress, safe_div, write_json

NAME = "radix"

DEFAULTS = dict(groups=8, per_group=16, prefix_len=512, question_len=64, output_len=16,
                noreuse_prompts=64, noreuse_len=256)
SMOKE_DEFAULTS = dict(groups=2, per_group=4, prefix_len=64, question_len=16, output_len=4,
                      noreuse_prompts=8, noreuse_len=32)
CONFIGS = {
    "radix_lpm": dict(schedule_policy="lpm"),
    "no_cache": dict(disable_radix_cache=True),
    "radix_fcfs": dict(schedule_policy="fcfs"),
}
# The tiny model: a random-weight Llama small enough for seconds-long runs, with room for 512-token prefixes.
TINY_CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)


# Workloads ------------------------------------------------------------------------------------------------------
def ordinary_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Token ids inside the model's and the tokenizer's vocabulary that are not special or added tokens."""
    n = min(vocab_size, len(tokenizer))
    excluded = set(getattr(tokenizer, "all_special_ids", None) or [])
    try:
        excluded |= set(tokenizer.get_added_vocab().values())
    except Exception:  # noqa: BLE001 - not every tokenizer has it
        pass
    ids = [i for i in range(n) if i not in excluded]
    if len(ids) < 2:
        raise ValueError("the tokenizer has no ordinary token ids to build prompts from")
    return ids


def shared_prefix_workload(ids: list[int], groups: int, per_group: int, prefix_len: int, question_len: int,
                           seed: int) -> list[list[int]]:
    """groups x per_group prompts (group prefix + own question), shuffled. Prefixes start with distinct tokens."""
    rng = random.Random(seed)
    firsts = rng.sample(ids, groups)
    prompts = []
    for g in range(groups):
        prefix = [firsts[g]] + [rng.choice(ids) for _ in range(prefix_len - 1)]
        for _ in range(per_group):
            prompts.append(prefix + [rng.choice(ids) for _ in range(question_len)])
    rng.shuffle(prompts)
    return prompts


def no_reuse_workload(ids: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of ``length`` tokens whose first tokens are all different: nothing for the cache to reuse."""
    rng = random.Random(seed + 1)
    if n > len(ids):
        raise ValueError(f"--noreuse-prompts {n} exceeds the {len(ids)} distinct first tokens available")
    return [[first] + [rng.choice(ids) for _ in range(length - 1)] for first in rng.sample(ids, n)]


# Running ----------------------------------------------------------------------------------------------------------
def make_tiny_model(out_dir: str) -> str:
    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        save_dummy_hf_model(dummy_config(**TINY_CONFIG), out_dir, seed=0)
    return out_dir


def make_engine(model_path: str | None, engine_kwargs: dict[str, Any], config: dict[str, Any]):
    from sglang_backend import Engine

    kwargs = dict(engine_kwargs)
    kwargs.update(config)
    kwargs.setdefault("log_level", "warning")
    return Engine(model_path=model_path, **kwargs)


def timed_generate(engine, prompts: list[list[int]], output_len: int, desc: str,
                   show_progress: bool = True) -> tuple[list[dict], float, dict, dict]:
    """Submits all prompts at once (one generate call) and times it; a tqdm bar follows get_stats()."""
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    before = engine.get_stats()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = engine.generate(input_ids=prompts, sampling_params=params)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["err"] = e

    t0 = time.perf_counter()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    with progress(total=len(prompts), desc=desc, unit="req", disable=not show_progress) as bar:
        done = 0
        while thread.is_alive():
            thread.join(timeout=0.5)
            if thread.is_alive():
                now = engine.get_stats()["num_finished"] - before["num_finished"]
                bar.update(max(now - done, 0))
                done = max(done, now)
        wall = time.perf_counter() - t0
        bar.update(len(prompts) - done)
    if "err" in box:
        raise box["err"]
    after = engine.get_stats()
    return box["out"], wall, before, after


def measure_once(engine, prompts: list[list[int]], output_len: int, desc: str,
                 show_progress: bool = True) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed run on an empty cache: returns the metrics row and the output ids."""
    assert engine.flush_cache(), "flush_cache refused: engine not idle"
    outs, wall, before, after = timed_generate(engine, prompts, output_len, desc, show_progress)
    engine.check_pool_whole()

    def delta(key: str):
        return after[key] - before[key]

    n = len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = delta("num_cached_tokens")
    assert delta("num_prompt_tokens") == prompt_tokens, (delta("num_prompt_tokens"), prompt_tokens)
    tree_s = delta("tree_op_seconds")
    row = {
        "num_requests": n,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_prompt_tokens": cached,
        "computed_prompt_tokens": prompt_tokens - cached,
        "cache_hit_rate": cached / prompt_tokens,
        "forward_tokens": delta("num_forward_tokens"),
        "prefill_batches": delta("num_prefill_batches"),
        "decode_batches": delta("num_decode_batches"),
        "retractions": delta("num_retractions"),
        "forward_s": delta("forward_seconds"),
        "tree_op_s": tree_s,
        "tree_op_fraction": tree_s / wall,
        "mean_e2e_latency_s": sum(o["meta_info"]["e2e_latency"] for o in outs) / n,
        "max_total_num_tokens": after["max_total_num_tokens"],
    }
    return row, [o["output_ids"] for o in outs]


def compare_configs(engines: dict[str, Any], prompts: list[list[int]], output_len: int, repeats: int, label: str,
                    show_progress: bool) -> tuple[dict[str, dict[str, Any]], bool]:
    """Runs the workload ``repeats`` times on every engine, interleaved (the order rotates each round, so load
    from elsewhere on the machine hits every configuration alike). Per configuration: the median-wall run's
    row, plus every run's wall time and tree-op time. Also whether all greedy outputs were identical."""
    names = list(engines)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    outputs: dict[str, list] = {}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            row, outs = measure_once(engines[name], prompts, output_len, f"{label} {name} [{rep + 1}/{repeats}]",
                                     show_progress)
            runs[name].append(row)
            outputs.setdefault(name, outs)
            if outs != outputs[name]:
                outputs[name] = None  # not even reproducible within one configuration
    results = {}
    for name, rows in runs.items():
        row = dict(sorted(rows, key=lambda r: r["wall_s"])[len(rows) // 2])  # the median run (upper median)
        row["wall_s_runs"] = [r["wall_s"] for r in rows]
        row["tree_op_s_runs"] = [r["tree_op_s"] for r in rows]
        # Any preemption or GC pause inside a timed tree op lands in tree_op_s: take the median over runs
        # (not the median-wall run's value), and keep the least disturbed run's too.
        fractions = sorted(r["tree_op_fraction"] for r in rows)
        row["tree_op_fraction_runs"] = [r["tree_op_fraction"] for r in rows]
        row["tree_op_fraction"] = fractions[len(fractions) // 2]
        row["tree_op_fraction_min"] = fractions[0]
        # Admission depends on the engine's adaptive new-token ratio, which carries over between runs, so
        # batching (and, under memory pressure, retraction) may differ from run to run: keep every run's.
        for key in ("cached_prompt_tokens", "forward_tokens", "prefill_batches", "retractions"):
            row[key + "_runs"] = [r[key] for r in rows]
        results[name] = row
    ref = outputs[names[0]]
    identical = ref is not None and all(o == ref for o in outputs.values())
    return results, identical


def run(args: argparse.Namespace) -> dict[str, Any]:
    from sglang_backend.runtime.managers.schedule_policy import optimal_hit_rate

    logging.getLogger("sglang_backend").setLevel(logging.WARNING)
    tmp = None
    if args.tiny:
        tmp = tempfile.TemporaryDirectory(prefix="bench_radix_tiny_")
        model_path = make_tiny_model(tmp.name)
        model_name = "tiny-dummy-llama " + ",".join(f"{k}={v}" for k, v in TINY_CONFIG.items())
    else:
        model_path = args.model_path  # None: the embedded SmolLM2-135M-Instruct
        model_name = args.model_path or "SmolLM2-135M-Instruct (embedded default)"
    engine_kwargs: dict[str, Any] = {}
    if args.max_total_tokens:
        engine_kwargs["max_total_tokens"] = args.max_total_tokens
    if args.max_running_requests:
        engine_kwargs["max_running_requests"] = args.max_running_requests

    result: dict[str, Any] = {
        "benchmark": NAME,
        "command": "python -m benchmarks.bench_radix " + " ".join(args.argv),
        "model": model_name,
        "config": {"smoke": args.smoke, "tiny": args.tiny, "seed": args.seed, "repeats": args.repeats},
        "engine_kwargs": engine_kwargs,
        "env": env_info(),
        "shared_prefix": {},
        "no_reuse": {},
    }
    engines: dict[str, Any] = {}
    try:
        # All configurations stay up for the whole run so that their timed runs can be interleaved.
        for name, config in CONFIGS.items():
            engines[name] = make_engine(model_path, engine_kwargs, config)
        some = engines["radix_lpm"]
        ids = ordinary_token_ids(some.tokenizer, some.scheduler.model_runner.vocab_size)
        need = args.prefix_len + args.question_len + args.output_len
        if need >= some.context_len:
            raise SystemExit(f"prompt + output ({need}) does not fit the model's context ({some.context_len})")
        for engine in engines.values():  # warm-up: first-call costs stay out of the timings
            engine.generate(input_ids=ids[:16], sampling_params={"max_new_tokens": 2, "ignore_eos": True})

        # Shared-prefix workload, three configurations.
        prompts = shared_prefix_workload(ids, args.groups, args.per_group, args.prefix_len, args.question_len,
                                         args.seed)
        optimal = optimal_hit_rate([(None, p) for p in prompts])
        sp = result["shared_prefix"]
        sp["workload"] = {k: getattr(args, k) for k in ("groups", "per_group", "prefix_len", "question_len",
                                                      "output_len", "seed")}
        sp["workload"]["num_requests"] = len(prompts)
        sp["optimal_hit_rate"] = optimal
        sp["results"], sp["outputs_identical"] = compare_configs(engines, prompts, args.output_len, args.repeats,
                                                                 "shared-prefix", args.progress)
        base = sp["results"]["no_cache"]
        for name, row in sp["results"].items():
            row["config"] = CONFIGS[name]
            row["hit_rate_vs_optimal"] = safe_div(row["cache_hit_rate"], optimal)
            row["throughput_vs_no_cache"] = safe_div(row["total_tokens_per_s"], base["total_tokens_per_s"])

        # No-reuse workload: what the radix tree costs when there is nothing to reuse (vs the cache off).
        nr_prompts = no_reuse_workload(ids, args.noreuse_prompts, args.noreuse_len, args.seed)
        shutdown = engines.pop("radix_fcfs")
        shutdown.shutdown()
        nr_results, nr_identical = compare_configs(engines, nr_prompts, args.output_len, args.repeats,
                                                   "no-reuse", args.progress)
        row = nr_results["radix_lpm"]
        row["throughput_vs_no_cache"] = safe_div(row["total_tokens_per_s"],
                                                 nr_results["no_cache"]["total_tokens_per_s"])
        result["no_reuse"] = {
            "workload": {"num_requests": args.noreuse_prompts, "prompt_len": args.noreuse_len,
                         "output_len": args.output_len, "seed": args.seed},
            "optimal_hit_rate": optimal_hit_rate([(None, p) for p in nr_prompts]),
            "results": nr_results,
            "outputs_identical": nr_identical,
            "tree_op_fraction": row["tree_op_fraction"],
            "tree_op_fraction_min": row["tree_op_fraction_min"],
        }
    finally:
        for engine in engines.values():
            engine.shutdown()
        if tmp is not None:
            tmp.cleanup()
    return result


def print_tables(result: dict[str, Any]) -> None:
    sp = result["shared_prefix"]
    w = sp["workload"]
    print(f"\nModel: {result['model']}")
    print(f"Shared-prefix workload: {w['groups']} groups x {w['per_group']} prompts, prefix {w['prefix_len']} + "
          f"question {w['question_len']} tokens, {w['output_len']} output tokens, all submitted at once "
          f"(shuffled); optimal hit rate {sp['optimal_hit_rate']:.4f}")
    headers = ["config", "wall s", "req/s", "out tok/s", "total tok/s", "computed prompt tok", "hit rate",
               "hit/optimal", "vs no_cache", "tree-op %"]
    rows = []
    for name, r in sp["results"].items():
        rows.append([name, r["wall_s"], r["requests_per_s"], r["output_tokens_per_s"], r["total_tokens_per_s"],
                     r["computed_prompt_tokens"], r["cache_hit_rate"], r["hit_rate_vs_optimal"],
                     r["throughput_vs_no_cache"], 100 * r["tree_op_fraction"]])
    print(format_table(headers, rows))
    print(f"greedy outputs identical across configs: {sp['outputs_identical']}")
    nr = result["no_reuse"]
    w = nr["workload"]
    print(f"\nNo-reuse workload: {w['num_requests']} distinct prompts x {w['prompt_len']} tokens, "
          f"{w['output_len']} output tokens")
    rows = []
    for name, r in nr["results"].items():
        rows.append([name, r["wall_s"], r["requests_per_s"], r["total_tokens_per_s"], r["cache_hit_rate"],
                     100 * r["tree_op_fraction"], 100 * r["tree_op_fraction_min"], r.get("throughput_vs_no_cache")])
    print(format_table(["config", "wall s", "req/s", "total tok/s", "hit rate", "tree-op % of wall",
                        "(min over runs)", "vs no_cache"], rows))
    print(f"greedy outputs identical across configs: {nr['outputs_identical']}")
    reps = result["config"]["repeats"]
    if reps > 1:
        print(f"(median of {reps} interleaved runs per configuration)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-path", default=None, help="HF model dir / hub id / .gguf (default: embedded SmolLM2)")
    src.add_argument("--tiny", action="store_true", help="a tiny random-weight Llama instead of a real model")
    p.add_argument("--smoke", action="store_true", help="tiny model and a tiny workload (seconds; for CI)")
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v} ({SMOKE_DEFAULTS[k]} with --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per configuration (interleaved; median)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (default: the engine's)")
    p.add_argument("--max-running-requests", type=int, default=None, help="running batch cap (default: the engine's)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm progress bars")
    p.add_argument("--output", default=None, help=f"JSON path (default: {default_output(NAME)})")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke and args.model_path is None:
        args.tiny = True
    base = SMOKE_DEFAULTS if args.smoke else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.tiny and args.max_total_tokens is None:
        args.max_total_tokens = 131072  # holds the whole default workload uncached; 256 MiB per tiny engine
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.groups < 1 or args.per_group < 1 or args.prefix_len < 1 or args.question_len < 1 or args.output_len < 1:
        p.error("workload sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print_tables(result)
    path = write_json(result, args.output or default_output(NAME))
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
