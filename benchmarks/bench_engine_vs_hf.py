"""Offline throughput: our in-process Engine vs Hugging Face transformers ``generate``, same weights, same run.

Workload per batch size ``B``: ``B`` distinct prompts of exactly ``--input-len`` random token ids (seeded; no
two prompts share even their first token, so the radix cache has nothing to reuse, and the cache is flushed
before every run anyway), each generating exactly ``--output-len`` tokens greedily (``ignore_eos`` for us,
``min_new_tokens = max_new_tokens`` for HF). All prompts have the same length, so HF needs no padding.

For each system and batch size: one warm-up run, then ``--repeats`` timed runs of the whole generate call and
``--repeats`` timed runs with a single output token (≈ prefill + first token = time to first token). Reported:

* ``tokens_per_s``         = B * output_len / median(total time)
* ``ttft_s``               = median(time of the 1-token run)
* ``decode_tokens_per_s``  = B * (output_len - 1) / (median(total) - median(1-token run))

The two systems' runs are interleaved (order alternated per repeat) so background load hits both alike.
Ratios are ours / HF throughput (for TTFT: HF time / our time), so > 1 means our engine is faster.

Correctness guard: the greedy output ids for the measured batch must equal HF's token for token (fp32 on CPU).
``ignore_eos`` (ours) lets eos be generated while HF's ``min_new_tokens`` bans it, so the guard compares HF's
timed output with an untimed run of ours under HF's rule (``min_new_tokens = max_new_tokens``); the raw
timed-vs-timed comparison is recorded as well (see ``check_correctness``).

    python -m benchmarks.bench_engine_vs_hf                       # SmolLM2-135M, batch 1 and 16, 64 in / 64 out
    python -m benchmarks.bench_engine_vs_hf --smoke               # tiny dummy model, a few seconds (CI)
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import (
    default_output,
    env_info,
    format_table,
    progress,
    safe_div,
    summarize,
    write_json,
)

NAME = "engine_vs_hf"

DEFAULTS = dict(batch_sizes=[1, 16], input_len=64, output_len=64, repeats=3)
SMOKE_DEFAULTS = dict(batch_sizes=[1, 2], input_len=8, output_len=8, repeats=1)


# Workload ---------------------------------------------------------------------------------------------------------
def allowed_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ordinary token ids: inside both the model's and the tokenizer's vocabulary, no special/added tokens."""
    n = min(vocab_size, len(tokenizer))
    excluded = set(getattr(tokenizer, "all_special_ids", []) or [])
    try:
        excluded |= set(tokenizer.get_added_vocab().values())
    except Exception:  # noqa: BLE001 - slow tokenizers may not have it
        pass
    ids = [i for i in range(n) if i not in excluded]
    if not ids:
        raise ValueError("no ordinary token ids to build prompts from")
    return ids


def make_prompts(batch: int, input_len: int, token_ids: list[int], seed: int) -> list[list[int]]:
    """``batch`` prompts of exactly ``input_len`` ids; first tokens pairwise distinct (no shared prefix)."""
    rng = random.Random(seed)
    if batch > len(token_ids):
        raise ValueError(f"batch {batch} exceeds the {len(token_ids)} ordinary token ids")
    firsts = rng.sample(token_ids, batch)
    return [[first] + [rng.choice(token_ids) for _ in range(input_len - 1)] for first in firsts]


# The two systems --------------------------------------------------------------------------------------------------
class OursRunner:
    name = "ours"

    def __init__(self, model_path: str):
        from sglang_backend import Engine

        self.engine = Engine(model_path=model_path, log_level="warning")
        self.tokenizer = self.engine.tokenizer
        self.vocab_size = self.engine.config.vocab_size
        self.cached_tokens = 0
        self.forward_seconds = 0.0

    def run(self, prompts: list[list[int]], output_len: int, ban_eos: bool = False) -> tuple[float, list[list[int]]]:
        """Times one generate call. ``ban_eos``: HF's rule instead of ignore_eos (min_new_tokens = max_new_tokens)."""
        self.engine.flush_cache()  # no reuse across runs
        before = self.engine.get_stats()["forward_seconds"]
        params = {"max_new_tokens": output_len, "temperature": 0}
        params.update({"min_new_tokens": output_len} if ban_eos else {"ignore_eos": True})
        t0 = time.perf_counter()
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - t0
        self.forward_seconds = self.engine.get_stats()["forward_seconds"] - before
        self.cached_tokens += sum(o["meta_info"]["cached_tokens"] for o in outs)
        ids = [list(o["output_ids"]) for o in outs]
        if any(len(x) != output_len for x in ids):
            raise RuntimeError(f"ours: expected {output_len} tokens per prompt, got {[len(x) for x in ids]}")
        return elapsed, ids

    def close(self) -> None:
        self.engine.shutdown()


class HFRunner:
    name = "hf"

    def __init__(self, model_path: str):
        import torch
        from transformers.utils import logging as hf_logging

        from sglang_backend.runtime.model_loader.loader import load_hf_reference  # deferred: imports torch

        hf_logging.set_verbosity_error()
        self.torch = torch
        self.model = load_hf_reference(model_path)
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        pad = gc.pad_token_id if gc.pad_token_id is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self.pad_token_id = pad

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        torch = self.torch
        t0 = time.perf_counter()
        input_ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=self.pad_token_id,
            )
        ids = out[:, input_ids.shape[1]:].tolist()
        elapsed = time.perf_counter() - t0
        if any(len(x) != output_len for x in ids):
            raise RuntimeError(f"hf: expected {output_len} tokens per prompt, got {[len(x) for x in ids]}")
        return elapsed, ids

    def close(self) -> None:
        self.model = None


# Measurement ------------------------------------------------------------------------------------------------------
def derive(samples_total: list[float], samples_ttft: list[float], batch: int, input_len: int,
           output_len: int) -> dict[str, Any]:
    """Timing summaries and the rates derived from their medians."""
    total, prefill = summarize(samples_total), summarize(samples_ttft)

    def decode_time(t_total, t_prefill):
        return t_total - t_prefill if output_len > 1 and t_total > t_prefill else None

    t_total, t_prefill = total["median"], prefill["median"]
    dt = decode_time(t_total, t_prefill)
    # Best case (min of repeats): less sensitive to other work on a shared machine than the median.
    dt_best = decode_time(total["min"], prefill["min"])
    return {
        "total_s": total,
        "ttft_s": prefill,
        "tokens_per_s": safe_div(batch * output_len, t_total),
        "decode_tokens_per_s": safe_div(batch * (output_len - 1), dt) if dt else None,
        "prefill_tokens_per_s": safe_div(batch * input_len, t_prefill),
        "inter_token_latency_s": dt / (output_len - 1) if dt else None,
        "tokens_per_s_best": safe_div(batch * output_len, total["min"]),
        "decode_tokens_per_s_best": safe_div(batch * (output_len - 1), dt_best) if dt_best else None,
    }


def measure(runners: list, prompts: list[list[int]], output_len: int, repeats: int, bar):
    """One warm-up per system, then ``repeats`` rounds of (full run, 1-token run) per system, the systems
    interleaved (and their order alternated) so background load on the machine hits both alike.

    Returns ({name: metrics}, {name: output ids of the last full run}).
    """
    batch = len(prompts)
    totals = {r.name: [] for r in runners}
    ttfts = {r.name: [] for r in runners}
    fwd: list[float] = []
    outputs: dict[str, list[list[int]]] = {}
    for runner in runners:
        bar.set_postfix_str(f"bs={batch} {runner.name} warm-up")
        runner.run(prompts, output_len)
        bar.update()
    for rep in range(repeats):
        order = runners if rep % 2 == 0 else runners[::-1]
        for runner in order:
            bar.set_postfix_str(f"bs={batch} {runner.name} run {rep + 1}/{repeats}")
            t, outputs[runner.name] = runner.run(prompts, output_len)
            totals[runner.name].append(t)
            if runner.name == "ours":
                fwd.append(runner.forward_seconds)
            bar.update()
        for runner in order:
            bar.set_postfix_str(f"bs={batch} {runner.name} ttft {rep + 1}/{repeats}")
            t1, _ = runner.run(prompts, 1)
            ttfts[runner.name].append(t1)
            bar.update()
    res = {}
    for runner in runners:
        res[runner.name] = derive(totals[runner.name], ttfts[runner.name], batch, len(prompts[0]), output_len)
    if fwd and "ours" in res:
        # Share of our wall time spent inside model forward passes (the rest: scheduling, sampling, hand-offs).
        res["ours"]["forward_s_median"] = summarize(fwd)["median"]
        res["ours"]["forward_fraction"] = safe_div(res["ours"]["forward_s_median"], res["ours"]["total_s"]["median"])
    return res, outputs


def compare_outputs(ours: list[list[int]], hf: list[list[int]], eos_ids: set[int]) -> dict[str, Any]:
    mismatched = []
    for row, (a, b) in enumerate(zip(ours, hf)):
        if a != b:
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatched.append({
                "row": row, "position": pos,
                "ours": a[pos] if pos < len(a) else None, "hf": b[pos] if pos < len(b) else None,
                "ours_token_is_eos": (a[pos] in eos_ids) if pos < len(a) else False,
            })
    return {
        "outputs_match": not mismatched and len(ours) == len(hf),
        "num_rows": len(ours),
        "num_mismatched_rows": len(mismatched),
        "mismatches": mismatched[:8],
    }


def check_correctness(ours: "OursRunner", prompts, output_len: int, ours_timed, hf_timed, eos_ids) -> dict[str, Any]:
    """Token-for-token guard on the measured batch.

    The timed runs differ in one rule: our ``ignore_eos`` lets eos be generated (and carries on), HF's
    ``min_new_tokens`` bans eos until the length is reached. So the guard re-runs our engine (untimed) with
    HF's exact rule (``min_new_tokens = max_new_tokens``, eos banned) and compares that with HF's timed output;
    the raw comparison of the timed outputs is kept too, with each split flagged if our token there was eos.
    """
    _, twin = ours.run(prompts, output_len, ban_eos=True)
    same_rule = compare_outputs(twin, hf_timed, eos_ids)
    timed = compare_outputs(ours_timed, hf_timed, eos_ids)
    return {
        "outputs_match": same_rule["outputs_match"],
        "method": "ours with min_new_tokens=max_new_tokens (eos banned, as HF) vs HF timed output",
        "same_rule": same_rule,
        "timed_ignore_eos_vs_hf": timed,
        "timed_splits_all_at_our_eos": all(m["ours_token_is_eos"] for m in timed["mismatches"]),
    }


def ratio(a, b):
    return safe_div(a, b)


# CLI --------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_engine_vs_hf", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None,
                   help="HF model dir (default: embedded SmolLM2-135M-Instruct; with --smoke: a tiny dummy model)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help=f"default {DEFAULTS['batch_sizes']}")
    p.add_argument("--input-len", type=int, default=None, help=f"prompt tokens (default {DEFAULTS['input_len']})")
    p.add_argument("--output-len", type=int, default=None, help=f"generated tokens (default {DEFAULTS['output_len']})")
    p.add_argument("--repeats", type=int, default=None, help=f"timed runs per point (default {DEFAULTS['repeats']})")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--smoke", action="store_true", help="tiny dummy model, batch 1 and 2, lengths 8, 1 repeat")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--output", default=None, help=f"JSON result path (default {default_output(NAME)})")
    args = p.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.smoke else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.input_len < 1 or args.output_len < 1 or args.repeats < 1 or min(args.batch_sizes) < 1:
        p.error("--input-len, --output-len, --repeats and --batch-sizes must be >= 1")
    if args.output is None:
        args.output = default_output(NAME + ("_smoke" if args.smoke else ""))
    return args


def print_table(results: list[dict[str, Any]], out=None) -> None:
    out = out if out is not None else sys.stdout
    headers = ["batch", "ours tok/s", "HF tok/s", "ratio", "ratio(best)", "ours dec tok/s", "HF dec tok/s", "ratio",
               "ours TTFT s", "HF TTFT s", "TTFT ratio", "match"]
    rows = []
    for r in results:
        o, h, q = r["ours"], r["hf"], r["ratios"]
        rows.append([r["batch_size"], o["tokens_per_s"], h["tokens_per_s"], q["tokens_per_s"], q.get("tokens_per_s_best"),
                     o["decode_tokens_per_s"], h["decode_tokens_per_s"], q["decode_tokens_per_s"],
                     o["ttft_s"]["median"], h["ttft_s"]["median"], q["ttft"],
                     "yes" if r["correctness"]["outputs_match"] else "NO"])
    print(format_table(headers, rows), file=out)
    print("medians of repeats; ratio = ours / HF throughput (ratio(best): from the fastest repeat of each);\n"
          "TTFT ratio = HF time / our time. > 1 means ours is faster.", file=out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("sglang_backend").setLevel(logging.WARNING)

    tmp = None
    model_path = args.model_path
    if model_path is None:
        if args.smoke:
            from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

            tmp = tempfile.TemporaryDirectory(prefix="bench_smoke_")
            model_path = save_dummy_hf_model(dummy_config(), tmp.name, seed=0)
        else:
            from sglang_backend.runtime.model_loader.embedded import default_model_path

            model_path = default_model_path()

    ours = hf = None
    env_at_start = env_info()
    t_start = time.perf_counter()
    try:
        t0 = time.perf_counter()
        ours = OursRunner(model_path)
        load_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf = HFRunner(model_path)
        load_hf = time.perf_counter() - t0
        token_ids = allowed_token_ids(ours.tokenizer, ours.vocab_size)
        eos_ids = hf.eos_ids | set(ours.engine.scheduler.eos_token_ids)

        results = []
        steps = len(args.batch_sizes) * (2 * (1 + 2 * args.repeats) + 1)
        with progress(total=steps, desc="engine vs HF", disable=args.no_progress, unit="run") as bar:
            for bs in args.batch_sizes:
                prompts = make_prompts(bs, args.input_len, token_ids, seed=args.seed * 1_000_003 + bs)
                res, outs = measure([ours, hf], prompts, args.output_len, args.repeats, bar)
                ours_res, hf_res = res["ours"], res["hf"]
                bar.set_postfix_str(f"bs={bs} correctness check")
                correctness = check_correctness(ours, prompts, args.output_len, outs["ours"], outs["hf"], eos_ids)
                bar.update()
                results.append({
                    "batch_size": bs,
                    "ours": ours_res,
                    "hf": hf_res,
                    "ratios": {
                        "tokens_per_s": ratio(ours_res["tokens_per_s"], hf_res["tokens_per_s"]),
                        "decode_tokens_per_s": ratio(ours_res["decode_tokens_per_s"], hf_res["decode_tokens_per_s"]),
                        "ttft": ratio(hf_res["ttft_s"]["median"], ours_res["ttft_s"]["median"]),
                        "tokens_per_s_best": ratio(ours_res["tokens_per_s_best"], hf_res["tokens_per_s_best"]),
                        "decode_tokens_per_s_best": ratio(ours_res["decode_tokens_per_s_best"],
                                                          hf_res["decode_tokens_per_s_best"]),
                    },
                    "correctness": correctness,
                })
    finally:
        if ours is not None:
            ours.close()
        if hf is not None:
            hf.close()
        if tmp is not None:
            tmp.cleanup()

    result = {
        "benchmark": NAME,
        "command": "python -m benchmarks.bench_engine_vs_hf " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {
            "model_path": "<dummy tiny llama (dummy_config)>" if tmp is not None else model_path,
            "smoke": args.smoke,
            "batch_sizes": args.batch_sizes,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "warmup": 1,
            "seed": args.seed,
            "dtype": "float32",
            "ours_sampling_params": {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True},
            "hf_generate_kwargs": {"max_new_tokens": args.output_len, "min_new_tokens": args.output_len,
                                   "do_sample": False},
            "statistic": "median of repeats after one warm-up; systems interleaved, order alternated per repeat",
        },
        "env": env_at_start,
        "loadavg_at_end": env_info().get("loadavg"),
        "load_seconds": {"ours": load_ours, "hf": load_hf},
        "results": results,
        "ratios": {str(r["batch_size"]): r["ratios"] for r in results},
        "outputs_match": all(r["correctness"]["outputs_match"] for r in results),
        "ours_cached_tokens": ours.cached_tokens,
        "wall_seconds": time.perf_counter() - t_start,
    }
    path = write_json(result, args.output)
    print_table(results)
    print(f"outputs match HF token for token: {result['outputs_match']}")
    rel = os.path.relpath(path)
    print(f"saved {path if rel.startswith('..') else rel}")
    return result


if __name__ == "__main__":
    main()
