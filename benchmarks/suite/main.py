"""``sglang-backend bench <workload...>|all``: the paper's LM-program benchmark suite.

Presets (sizes per workload are in each workload module's SIZES):

* ``--smoke``: a tiny dummy Llama (made in a temp dir), a few instances each: CI, seconds per workload;
* ``--preset cpu``: the embedded SmolLM2-135M (or ``--model-path``) on CPU, instance counts scaled down;
* ``--preset gpu``: dummy weights at Llama-2-7B shape, fp16, triton attention on one GPU, paper-like sizes.

Every output length is fixed (greedy, ignore_eos), so all baselines do the same work. By default every
workload runs under ``full`` and ``no_cache`` in throughput and latency mode (gpu preset: throughput only,
``--modes throughput,latency`` for both), and the other ablations and
the HF peer run on ``--ablation-workloads`` (``no_jump_forward`` only where a regex is decoded). Results:
``results.jsonl`` (one row per workload x baseline x mode), ``summary.md`` and PNG figures in ``--output``.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import random
import sys
import tempfile
import time

from ..common import RESULTS_DIR, env_info, format_table
from . import workloads as wl_registry
from .data import TextGen
from .harness import BASELINES, Baseline, run

PRESETS = {
    "smoke": dict(ablation_workloads=["shared_prefix", "json_decode"], latency_instances=2, interleave=False,
                  extra=["no_tree", "fcfs", "random", "no_frontend_parallel", "no_hints", "no_jump_forward",
                         "hf_sequential", "hf_batched"]),
    "cpu": dict(ablation_workloads=["mmlu", "tree_of_thought", "json_decode"], latency_instances=2, interleave=True,
                extra=["no_tree", "fcfs", "random", "no_frontend_parallel", "no_hints", "no_jump_forward",
                       "hf_sequential", "hf_batched"]),
    "gpu": dict(ablation_workloads=["mmlu", "json_decode"], latency_instances=2, modes="throughput", interleave=False, isolate=True,
                extra=["no_tree", "no_frontend_parallel", "no_hints", "no_jump_forward"]),
}
MAIN_BASELINES = ["full", "no_cache"]
HIT_RATE_TARGET = 0.96  # paper: the cache-aware scheduler reaches 96% of the optimal hit rate on average


def tiny_model_dir() -> str:
    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

    d = os.path.join(tempfile.gettempdir(), "sglb_suite_tiny")
    if not os.path.exists(os.path.join(d, "config.json")):
        save_dummy_hf_model(dummy_config(max_position_embeddings=4096), d, seed=0)
    return d


def engine_setup(preset: str, model_path: str | None) -> tuple[str | None, dict]:
    """(model path, Engine kwargs) for a preset."""
    if preset == "gpu":
        from benchmarks.bench_gpu import make_model_dir

        return model_path or make_model_dir("llama2-7b"), dict(
            load_format="auto" if model_path else "dummy", dtype="float16", device="cuda",
            attention_backend="triton")
    if preset == "smoke":
        return model_path or tiny_model_dir(), dict(max_total_tokens=32768)
    return model_path, {}


def plan(names: list[str], baselines: list[str] | None, ablation_workloads: list[str], extra: list[str],
         modes: list[str], interleave: bool = False) -> list[tuple[str, str, str]]:
    """(baseline, workload, mode) triples, grouped by baseline so each engine starts once; ``interleave``:
    grouped by workload instead, so the baselines of one workload run close in time (on a shared machine
    whose load changes, comparisons between runs minutes apart are noise)."""
    triples = []
    wanted = baselines or MAIN_BASELINES + extra
    # The main comparison first (a --time-budget cuts the tail), then the ablations; baselines on the same
    # engine as the one before run back to back (one engine start each).
    rest = [b for b in wanted if b not in MAIN_BASELINES]
    frontend = [b for b in rest if not BASELINES[b].engine and not BASELINES[b].hf_batch]
    wanted = [b for b in MAIN_BASELINES if b in wanted] + frontend + [b for b in rest if b not in frontend]
    for b in wanted:
        for name in names:
            mod = wl_registry.load(name)
            if baselines is None and b not in MAIN_BASELINES and name not in ablation_workloads:
                continue
            if b == "no_jump_forward" and name != "json_decode":
                continue  # identical to full wherever nothing is constrained
            if BASELINES[b].hf_batch and not mod.HF:
                continue
            for mode in modes:
                if mode == "latency" and b not in MAIN_BASELINES:
                    continue
                triples.append((b, name, mode))
    if interleave:
        order = ["full", *frontend, "no_cache"]
        rank = lambda t: (names.index(t[1]), order.index(t[0]) if t[0] in order else len(order))  # noqa: E731
        triples.sort(key=rank)  # stable: the remaining baselines keep their order
    return triples


def parse_sizes(items: list[str]) -> dict:
    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"--size takes key=value, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="sglang-backend bench", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.epilog = ("workloads:\n" + wl_registry.describe() + "\n\nbaselines:\n" +
                     "\n".join(f"  {b.name:<22} {b.description}" for b in BASELINES.values()))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("workloads", nargs="*", help="workload names (see below) or 'all'")
    parser.add_argument("--smoke", action="store_true", help="tiny dummy model, CI sizes (= --preset smoke)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="sizes and model (default: cpu)")
    parser.add_argument("--model-path", default=None, help="model dir / hub id / .gguf (default: by preset)")
    parser.add_argument("--output", default=None, help="output dir (default: benchmarks/results/suite_<preset>)")
    parser.add_argument("--baseline", action="append", default=None, choices=sorted(BASELINES),
                        help="run only these baselines, on every selected workload (repeatable)")
    parser.add_argument("--ablation-workloads", default=None,
                        help="comma list: where the non-main baselines run by default (default: by preset)")
    parser.add_argument("--modes", default=None,
                        help="comma list of throughput, latency (default: both; gpu preset: throughput)")
    parser.add_argument("--latency-instances", type=int, default=None, help="programs per latency run")
    parser.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                        help="override a size field in every selected workload that has it, e.g. n=8")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra ServerArgs for every engine, e.g. max_total_tokens=20000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="time each run this many times on its engine and report the last (the others are kept "
                             "in the row's repeat_programs_per_s): steadier figures where one-time costs linger")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no new run after this many seconds (the rest is listed in meta.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--dry-run", action="store_true", help="build the instances, print the plan, run nothing")
    parser.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                        help="one child process per engine configuration (default for the gpu preset: frees GPU memory)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false")
    parser.add_argument("--replot", metavar="DIR", default=None,
                        help="only rewrite summary.md and the figures from DIR/results.jsonl (e.g. a GPU run's)")
    return parser


def _make_backend(baseline: Baseline, model_path, engine_kwargs, tokenizer, preset):
    from sglang_backend import Engine
    from sglang_backend.lang.backends.engine import EngineBackend

    if baseline.hf_batch:
        from .hf_peer import HFBackend
        from sglang_backend.runtime.model_loader.loader import resolve_model_path

        device = "cuda" if preset == "gpu" else "cpu"
        dtype = None
        if preset == "gpu":
            import torch

            dtype = torch.float16
        return None, HFBackend(resolve_model_path(model_path), tokenizer, baseline.hf_batch, device, dtype,
                               dummy=engine_kwargs.get("load_format") == "dummy")
    engine = Engine(model_path=model_path, log_level="warning", **{**engine_kwargs, **baseline.engine})
    return engine, EngineBackend(engine, fork_hints=baseline.fork_hints)


def run_isolated(args, argv, triples, out_dir: str) -> tuple[list[dict], list[str]]:
    """One child process per engine configuration (consecutive triples on the same engine): a GPU engine's
    memory is only surely back when its process exits. Rows are merged into out_dir/results.jsonl."""
    import subprocess

    groups: list[list[tuple]] = []
    for t in triples:
        b = BASELINES[t[0]]
        key = (b.hf_batch, tuple(sorted(b.engine.items())))
        if groups and groups[-1][0] == key:
            groups[-1][1].append(t)
        else:
            groups.append((key, [t]))
    passthrough = []
    if args.model_path:
        passthrough += ["--model-path", args.model_path]
    if args.latency_instances:
        passthrough += ["--latency-instances", str(args.latency_instances)]
    for item in args.size:
        passthrough += ["--size", item]
    for item in args.engine_arg:
        passthrough += ["--engine-arg", item]
    if args.repeats != 1:
        passthrough += ["--repeats", str(args.repeats)]
    rows, skipped, t_start = [], [], time.perf_counter()
    for i, (_, group) in enumerate(groups):
        left = None if args.time_budget is None else args.time_budget - (time.perf_counter() - t_start)
        if left is not None and left <= 0:
            skipped += [f"{n}/{b}/{m}" for b, n, m in group]
            continue
        part = os.path.join(out_dir, f"part{i}")
        baselines = list(dict.fromkeys(b for b, _, _ in group))
        workloads = list(dict.fromkeys(n for _, n, _ in group))
        modes = ",".join(dict.fromkeys(m for _, _, m in group))
        cmd = [sys.executable, "-m", "benchmarks.suite.main", *workloads, "--preset", "smoke" if args.smoke else
               args.preset, "--output", part, "--modes", modes, "--seed", str(args.seed), "--no-isolate",
               *[x for b in baselines for x in ("--baseline", b)], *passthrough]
        if left is not None:
            cmd += ["--time-budget", str(left)]
        if args.no_progress:
            cmd.append("--no-progress")
        print(f"[bench] child process for {baselines}: {' '.join(cmd[3:])}", file=sys.stderr)
        subprocess.run(cmd, check=False, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        path = os.path.join(part, "results.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                rows += [json.loads(line) for line in f if line.strip()]
        meta_path = os.path.join(part, "meta.json")
        if os.path.exists(meta_path):
            skipped += json.load(open(meta_path, encoding="utf-8")).get("skipped_for_time_budget", [])
    with open(os.path.join(out_dir, "results.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows, skipped


def release(backend, names: list[str]) -> None:
    """Stops the engine (or HF model) and frees its memory before the next one starts (GPU: weights + pool)."""
    backend.shutdown()
    for name in names:  # workloads that keep per-engine objects (the DSPy LM) drop them
        getattr(wl_registry.load(name), "reset", lambda: None)()
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def budget_over(budget: float | None, t_start: float) -> bool:
    return budget is not None and time.perf_counter() - t_start > budget


def warm_up(engine, backend) -> None:
    """One short call first, so lazy initialisation (kernels, allocator, threads) is not timed."""
    if engine is not None:
        engine.generate("Warm up the engine.", {"max_new_tokens": 4, "ignore_eos": True})
        engine.flush_cache()
    else:
        backend._submit(("gen", backend.tokenizer.encode("Warm up the model."), 4, True))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    if not args.workloads:
        parser.error("name at least one workload, or 'all'")
    preset = "smoke" if args.smoke else args.preset
    cfg = PRESETS[preset]
    names = list(wl_registry.NAMES) if "all" in args.workloads else args.workloads
    for n in names:
        wl_registry.load(n)  # unknown names fail here, before any model loads
    default_root = os.environ.get("OUT") or RESULTS_DIR  # $OUT: the GPU device returns what is written there
    out_dir = args.output or os.path.join(default_root, f"suite_{preset}")
    os.makedirs(out_dir, exist_ok=True)
    ablation_workloads = args.ablation_workloads.split(",") if args.ablation_workloads else cfg["ablation_workloads"]
    modes = [m for m in (args.modes or cfg.get("modes", "throughput,latency")).split(",") if m]
    if not modes or set(modes) - {"throughput", "latency"}:
        raise SystemExit(f"--modes takes throughput and/or latency, got {args.modes!r}")
    latency_n = args.latency_instances or cfg["latency_instances"]
    model_path, engine_kwargs = engine_setup(preset, args.model_path)
    engine_kwargs.update(parse_sizes(args.engine_arg))
    sizes = parse_sizes(args.size)

    from sglang_backend.runtime.model_loader.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(model_path))
    textgen_words = TextGen(tokenizer).words
    instances, skipped = {}, {}
    for i, name in enumerate(names):
        mod = wl_registry.load(name)
        reason = mod.unavailable() if hasattr(mod, "unavailable") else None
        if reason:
            skipped[name] = reason
            print(f"[bench] skipping {name}: {reason}", file=sys.stderr)
            continue
        size = dict(mod.SIZES[preset])
        size.update({k: v for k, v in sizes.items() if k in size})
        tg = TextGen.__new__(TextGen)  # same word list for every workload, its own seeded stream
        tg.tokenizer, tg.words, tg.rng = tokenizer, textgen_words, random.Random(args.seed * 1000 + i)
        instances[name] = mod.instances(tg, **size)
    names = [n for n in names if n in instances]

    triples = plan(names, args.baseline, ablation_workloads, cfg["extra"], modes, interleave=cfg["interleave"])
    meta = {"preset": preset, "model_path": model_path or "embedded SmolLM2-135M-Instruct",
            "engine_kwargs": engine_kwargs, "sizes": {n: {**wl_registry.load(n).SIZES[preset],
                                                          **{k: v for k, v in sizes.items()
                                                             if k in wl_registry.load(n).SIZES[preset]}}
                                                      for n in names},
            "skipped": skipped, "env": env_info(), "argv": argv if argv is not None else sys.argv[1:]}
    if args.dry_run:
        for name in names:
            print(f"{name:<20} {len(instances[name])} instances, e.g. {str(instances[name][0])[:100]}...")
        for t in triples:
            print(" ".join(t))
        return []
    if args.isolate if args.isolate is not None else cfg.get("isolate", False):
        rows, budget_skipped = run_isolated(args, argv, triples, out_dir)
        meta["skipped_for_time_budget"] = budget_skipped
        with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, default=str)
        report(rows, out_dir, skipped, f"{preset}, {os.path.basename(str(meta['model_path']))}")
        return rows
    rows: list[dict] = []
    budget_skipped: list[str] = []
    results_path = os.path.join(out_dir, "results.jsonl")
    t_start = time.perf_counter()
    with open(results_path, "w", encoding="utf-8") as f:
        current, engine, backend = None, None, None
        warmed: set = set()  # (engine configuration, workload) pairs that ran their warm-up instance
        for b, name, mode in triples:
            baseline = BASELINES[b]
            if budget_over(args.time_budget, t_start):
                budget_skipped.append(f"{name}/{b}/{mode}")
                continue
            key = (baseline.hf_batch, tuple(sorted(baseline.engine.items())))
            if key != current:
                if backend is not None:
                    release(backend, names)
                    engine = backend = None
                engine, backend = _make_backend(baseline, model_path, engine_kwargs, tokenizer, preset)
                current = key
                warm_up(engine, backend)
            elif engine is not None:
                from sglang_backend.lang.backends.engine import EngineBackend

                backend = EngineBackend(engine, fork_hints=baseline.fork_hints)  # same engine, other frontend
            mod = wl_registry.load(name)
            todo = instances[name] if mode == "throughput" else instances[name][:latency_n]
            if (current, name) not in warmed:
                # One untimed instance of each workload on each engine: one-time costs (Triton JIT of the shapes
                # this workload hits, its grammar's token index; both cached on disk after the first process)
                # must not land in whichever configuration happens to run first.
                run(mod, todo[:1], backend, engine, baseline, mode, show_progress=False)
                warmed.add((current, name))
            runs = [run(mod, todo, backend, engine, baseline, mode, show_progress=not args.no_progress)
                    for _ in range(max(1, args.repeats))]
            row = runs[-1]
            if len(runs) > 1:
                row["repeat_programs_per_s"] = [r["programs_per_s"] for r in runs]
            row["preset"] = preset
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"[bench] {name:<20} {b:<20} {mode:<10} {row['completed']}/{row['programs']} programs "
                  f"{row['programs_per_s'] or 0:.3f} prog/s  hit {_fmt(row.get('hit_rate'))} "
                  f"opt {_fmt(row.get('optimal_hit_rate'))}  {row['elapsed_s']:.1f}s", file=sys.stderr)
        if backend is not None:
            release(backend, names)
    meta["wall_s"] = time.perf_counter() - t_start
    if budget_skipped:
        meta["skipped_for_time_budget"] = budget_skipped
        print(f"[bench] time budget reached: skipped {len(budget_skipped)} runs: {budget_skipped}", file=sys.stderr)
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, default=str)
    report(rows, out_dir, skipped, f"{preset}, {os.path.basename(str(meta['model_path']))}")
    return rows


def report(rows: list[dict], out_dir: str, skipped: dict, title: str) -> None:
    """summary.md (printed too) and the PNG figures."""
    summary = summarize(rows, skipped)
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(summary)
    print(summary)
    try:
        from .plots import make_plots

        for p in make_plots(rows, out_dir, title):
            print(f"[bench] wrote {p}", file=sys.stderr)
    except ImportError as e:
        print(f"[bench] no plots ({e}); install the 'bench' extra: pip install -e .[bench]", file=sys.stderr)


def replot(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "results.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    meta_path = os.path.join(out_dir, "meta.json")
    meta = json.load(open(meta_path, encoding="utf-8")) if os.path.exists(meta_path) else {}
    title = f"{meta.get('preset', '?')}, {os.path.basename(str(meta.get('model_path', '?')))}"
    report(rows, out_dir, meta.get("skipped", {}), title)
    return rows


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def summarize(rows: list[dict], skipped: dict | None = None) -> str:
    """Per workload: throughput full vs no_cache (speedup), hit rate vs optimal; then every row."""
    by = {(r["workload"], r["baseline"], r["mode"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    head = ["workload", "full prog/s", "no_cache prog/s", "speedup", "lat full s", "lat no_cache s", "hit", "optimal",
            "hit/opt", ">=96%"]
    table = []
    for w in workloads:
        full, nc = by.get((w, "full", "throughput")), by.get((w, "no_cache", "throughput"))
        lf, ln = by.get((w, "full", "latency")), by.get((w, "no_cache", "latency"))
        ratio = full.get("hit_vs_optimal") if full else None
        table.append([w, full and full["programs_per_s"], nc and nc["programs_per_s"],
                      (full["programs_per_s"] / nc["programs_per_s"]) if full and nc and nc["programs_per_s"] else None,
                      lf and lf["latency_s_mean"], ln and ln["latency_s_mean"],
                      full and full.get("hit_rate"), full and full.get("optimal_hit_rate"), ratio,
                      None if ratio is None else ("yes" if ratio >= HIT_RATE_TARGET else "NO")])
    all_rows = [[r["workload"], r["baseline"], r["mode"], f"{r['completed']}/{r['programs']}", r["programs_per_s"],
                 r.get("output_tokens_per_s"), r.get("latency_s_mean"), r.get("latency_s_p99"), r.get("ttft_s_mean"),
                 r.get("hit_rate"), r.get("optimal_hit_rate")] for r in rows]
    text = ["# Benchmark suite summary", "", "```", format_table(head, table), "```", "", "## All runs", "", "```",
            format_table(["workload", "baseline", "mode", "done", "prog/s", "out tok/s", "lat mean", "lat p99",
                          "ttft mean", "hit", "optimal"], all_rows), "```"]
    if skipped:
        text += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())]
    return "\n".join(text) + "\n"


if __name__ == "__main__":
    main()
