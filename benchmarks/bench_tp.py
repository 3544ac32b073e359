"""Tensor parallelism: TP=2 vs TP=1 on one host — same greedy outputs, decode step time and speedup.

Dummy weights at a real shape (default Llama-2-7B, fp16; no network needed: the weights are drawn from the
config, the same model at every tp_size). Each configuration runs in a fresh child process (one
tensor-parallel group per process, and the GPU memory comes back between runs):

* correctness: 4 prompts of 32 random token ids, greedy, 32 new tokens (ignore_eos); TP=2's output ids must
  equal TP=1's. Where they differ, the report gives the first differing step and TP=1's top-2 logprob gap
  there (a near-tie flipped by the different summation order of the all-reduce, or a real bug).
* decode step time: for each batch size, (time of a 16+N-token generation - time of a 16-token one) / N,
  median of 3: the steady-state cost of one decode step, scheduling, sampling and the TP messages included.
* configurations: CUDA graphs on and off (NCCL collectives are captured in the graphs; the eager run is the
  fallback if capture fails), a float32 correctness run (no near-ties from fp16 rounding; timed on the
  CPU only, where it is the one run), and last, graphs with overlapped decode at both tp sizes: the server's
  default on GPUs (the others run the synchronous loop; the step transport queues everything without a host
  sync, so the followers prepare step N+1 under step N too).
* TP=2 also reports rank 0's host time per forward for handing the step to the other rank (the step header
  down the followers' stdin pipes plus queuing the NCCL broadcast of the batch tensors).

Every configuration must fit in --time-budget (default 330 s for all eight); what does not fit is skipped and
reported as an error, so the script always finishes and writes its JSON.

GPU (2 GPUs):  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 python benchmarks/bench_tp.py
Follower profile: SGLANG_BACKEND_TP_PROFILE=$OUT/tp_prof makes each follower write a cProfile of its step loop
to $OUT/tp_prof.rank<r>.txt at exit (top 30 by own and by cumulative time).
CPU smoke:     python benchmarks/bench_tp.py --model tiny --device cpu --runs fp32-eager --batch-sizes 1 2 --steps 8
Writes benchmarks/results/bench_tp_<model>_<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks.common import RESULTS_DIR, env_info, format_table  # noqa: E402

MODELS = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
}
# name -> (dtype, CUDA graphs, time the decode step, overlapped decode)
# (eager first: its numbers are saved even if capturing NCCL collectives in CUDA graphs fails or hangs; the
# overlapped run, the server's GPU default, last)
RUNS = {"fp16-eager": ("float16", False, True, False), "fp16-graphs": ("float16", True, True, False),
        "fp32-eager": ("float32", False, False, False), "fp16-graphs-overlap": ("float16", True, True, True)}
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 32, 32
CHILD_TIMEOUT_S = 200
MIN_CHILD_S = 30  # a configuration is skipped when less than this is left of --time-budget


def make_model_dir(name: str) -> str:
    from transformers import LlamaConfig

    from sglang_backend.runtime.model_loader.loader import build_dummy_tokenizer

    d = os.path.join(tempfile.gettempdir(), f"sglb_bench_tp_{name}")
    os.makedirs(d, exist_ok=True)
    cfg = LlamaConfig(**MODELS[name], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False, initializer_range=0.02)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(d)
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        build_dummy_tokenizer(cfg.vocab_size).save_pretrained(d)
    return d


# Child: one engine, one configuration ---------------------------------------------------------------------------------
def child(args) -> dict:
    import random

    import torch

    from sglang_backend import Engine
    from sglang_backend.runtime.managers.overlap import OverlapDecoder

    dtype, graphs, timed, overlap = RUNS[args.run]
    gpu = args.device == "cuda"
    timed = timed or not gpu  # on the CPU the fp32 run is the only one: time it
    t0 = time.perf_counter()
    eng = Engine(model_path=make_model_dir(args.model), load_format="dummy", dtype=dtype, device=args.device,
                 tp_size=args.tp, attention_backend="triton" if gpu else "torch_native", disable_cuda_graph=not graphs,
                 max_running_requests=max(args.batch_sizes + [PROMPTS]), max_total_tokens=32768, log_level="warning",
                 disable_overlap_schedule=not overlap)
    if overlap and eng.scheduler.overlap is None:  # the CPU (as tests/unit/test_overlap.py switches it on)
        eng.scheduler.overlap = OverlapDecoder(eng.scheduler)
    out = {"tp": args.tp, "run": args.run, "startup_s": round(time.perf_counter() - t0, 1),
           "cuda_graphs": eng.scheduler.model_runner.graph_runner is not None}
    try:
        rng = random.Random(0)
        vocab = MODELS[args.model]["vocab_size"]
        ids = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
        res = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                           "ignore_eos": True},
                           return_logprob=True, top_logprobs_num=2)
        out["output_ids"] = [r["output_ids"] for r in res]
        out["top2"] = [[[lp for lp, _, _ in step] for step in r["meta_info"]["output_top_logprobs"]] for r in res]
        if timed:
            out["decode_step_ms"] = {}
            sends = _time_sends(eng)
            for bs in args.batch_sizes:
                def run(n):
                    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                    batch = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(bs)]
                    if gpu:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    eng.generate(input_ids=batch, sampling_params=sp)
                    return time.perf_counter() - t

                run(16)  # warm-up
                per_step = [(run(16 + args.steps) - run(16)) / args.steps for _ in range(3)]
                out["decode_step_ms"][bs] = round(1000 * statistics.median(per_step), 3)
                print(f"[tp={args.tp} {args.run}] bs={bs}: decode step {out['decode_step_ms'][bs]:.3f} ms", flush=True)
            if sends[1]:
                out["send_us_per_forward"] = round(1e6 * sends[0] / sends[1], 1)
                print(f"[tp={args.tp} {args.run}] rank 0 host time sending a step: {out['send_us_per_forward']} us",
                      flush=True)
        eng.check_pool_whole()
    finally:
        eng.shutdown()
    return out


def _time_sends(eng) -> list:
    """[seconds, calls] rank 0 spends handing steps to the other ranks (stays [0, 0] at TP=1)."""
    acc = [0.0, 0]
    followers = eng.scheduler.model_runner.tp_followers
    if followers is not None:
        send = followers.send_forward

        def timed_send(*a):
            t = time.perf_counter()
            send(*a)
            acc[0] += time.perf_counter() - t
            acc[1] += 1

        followers.send_forward = timed_send
    return acc


# Parent: children, comparison, table ---------------------------------------------------------------------------------
def compare(ref: dict, got: dict) -> dict:
    """Exact match, or where TP=2 first departs from TP=1 and how close TP=1's top two were there."""
    match = ref["output_ids"] == got["output_ids"]
    first = []
    for i, (a, b) in enumerate(zip(ref["output_ids"], got["output_ids"])):
        step = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is not None:
            top = ref["top2"][i][step]
            first.append({"prompt": i, "step": step, "tp1_top2_gap": round(top[0] - top[1], 5)})
    return {"outputs_equal": match, "first_differences": first}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama2-7b", choices=sorted(MODELS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per measurement")
    p.add_argument("--out", default=None)
    p.add_argument("--time-budget", type=float, default=330,
                   help="seconds for all configurations; what does not fit is skipped (and reported)")
    # Internal: run one configuration and write its JSON.
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--run", default="fp16-graphs", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # NVLink multicast stays off on shared GPU hosts (children and TP ranks inherit the environment).
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, value)
    os.environ.setdefault("SGLANG_BACKEND_TP_STATS", "1")  # followers print their forward count and lag at exit
    if args.child_json:
        with open(args.child_json, "w") as f:
            json.dump(child(args), f)
        return 0

    out_path = args.out or os.path.join(RESULTS_DIR, f"bench_tp_{args.model}_{args.device}.json")
    result = {"env": env_info(), "model": args.model, "shape": MODELS[args.model], "device": args.device,
              "prompts": PROMPTS, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "runs": {}}
    if args.device == "cuda":
        import torch

        result["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rows = []
    deadline = time.monotonic() + args.time_budget
    for run in args.runs:
        per_tp = {}
        for tp in args.tp_sizes:
            left = deadline - time.monotonic()
            if left < MIN_CHILD_S:
                per_tp[tp] = {"error": f"skipped: {args.time_budget:.0f} s time budget spent"}
                continue
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                path = tmp.name
            cmd = [sys.executable, os.path.abspath(__file__), "--child-json", path, "--tp", str(tp), "--run", run,
                   "--model", args.model, "--device", args.device, "--steps", str(args.steps),
                   "--batch-sizes", *map(str, args.batch_sizes)]
            print(f"== {run}, tp={tp}", flush=True)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, timeout=min(CHILD_TIMEOUT_S, left))
                with open(path) as f:
                    per_tp[tp] = json.load(f) if proc.returncode == 0 else {"error": f"exit code {proc.returncode}"}
            except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError) as e:
                per_tp[tp] = {"error": repr(e)}
            finally:
                if os.path.exists(path):
                    os.unlink(path)
            per_tp[tp]["wall_s"] = round(time.perf_counter() - t0, 1)
        entry = {"by_tp": {str(k): {x: y for x, y in v.items() if x not in ("output_ids", "top2")}
                           for k, v in per_tp.items()}}
        ref = per_tp.get(1)
        for tp, got in per_tp.items():
            if tp == 1 or not ref or "error" in ref or "error" in got:
                continue
            entry[f"tp{tp}_vs_tp1"] = cmp = compare(ref, got)
            speed = {}
            for bs, ms in got.get("decode_step_ms", {}).items():
                base = ref.get("decode_step_ms", {}).get(bs)
                speed[bs] = round(base / ms, 3) if base else None
                rows.append([run, bs, base, ms, speed[bs], got.get("send_us_per_forward"), cmp["outputs_equal"]])
            if not speed:
                rows.append([run, "-", None, None, None, None, cmp["outputs_equal"]])
            cmp["decode_speedup"] = speed
        result["runs"][run] = entry
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)
    print(format_table(["run", "batch", "TP=1 step ms", "TP=2 step ms", "speedup", "TP=2 send us", "outputs equal"],
                       rows))
    print(json.dumps({run: {k: v for k, v in e.items() if k != "by_tp"} for run, e in result["runs"].items()}, indent=1))
    print(f"wrote {out_path}")
    errors = [f"{run} tp={tp}: {v['error']}" for run, e in result["runs"].items() for tp, v in e["by_tp"].items()
              if "error" in v]
    for err in errors:
        print("ERROR", err)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
