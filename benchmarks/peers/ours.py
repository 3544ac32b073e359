"""Our side of the peer benchmark, run as a child process: ``OurClient`` over ``Engine`` (GPU: the model's
dtype and triton attention; ``--device cpu``: float32 and torch_native attention, for the smoke run), the
sections, and on the GPU a correctness check: our triton engine's greedy tokens equal our torch_native
engine's on the same dummy weights (both seeded with random_seed 0 and drawn on the GPU in the same order).

    python -m benchmarks.peers.ours --model llama3-8b --out X.json --sections offline,shared_prefix
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import sys
import time
import traceback

import torch

from benchmarks.gpu.common import MODELS, make_model_dir
from benchmarks.peers.child import child_parser, log, new_result, run_sections, server_arg_overrides, write_json
from benchmarks.peers.workloads import TextOutput, random_prompts

GREEDY = {"ignore_eos": True, "temperature": 0}
# What a constrained call cost our engine (reported with the section): decode and prefill forwards, jump-forwards.
REGEX_STATS = ("num_decode_batches", "num_prefill_batches", "num_mixed_batches", "num_jump_forward",
               "num_jump_forward_tokens")
CPU_POOL_TOKENS = 1 << 15  # the smoke run's KV pool (the CPU default would commit 2 GiB)
CHECK_PROMPTS, CHECK_PROMPT_LEN, CHECK_TOKENS = 2, 64, 16
# Where greedy tokens of two attention implementations may part: the reference's top-2 logprob gap is below
# this (a near-tie that rounding can flip; bf16 spaces logits of magnitude 4-8 0.03 apart).
NEAR_TIE = {"float16": 0.05, "bfloat16": 0.2, "float32": 0.0}


class OurClient:
    """The ``Client`` protocol over our ``Engine``."""

    def __init__(self, eng):
        self.eng = eng
        self.extra: dict = {}  # since the last reset: the engine's forward passes and jumps of constrained calls

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
        if isinstance(max_tokens, list):
            params = [{"max_new_tokens": m, **GREEDY} for m in max_tokens]
        else:
            params = {"max_new_tokens": max_tokens, **GREEDY}
        return [o["output_ids"] for o in self.eng.generate(input_ids=prompts, sampling_params=params)]

    def generate_regex(self, prompts: list[list[int]], regex: str, max_tokens: int) -> list[TextOutput]:
        before = self.eng.get_stats()
        out = self.eng.generate(input_ids=prompts,
                                sampling_params={"max_new_tokens": max_tokens, "temperature": 0, "regex": regex})
        after = self.eng.get_stats()
        for key in REGEX_STATS:
            self.extra[key] = self.extra.get(key, 0) + after[key] - before[key]
        return [TextOutput(o["text"], len(o["output_ids"]), o["meta_info"]["finish_reason"]["type"]) for o in out]

    def prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        """As our ``select`` scores choices: from ``logprob_start_len``, so the cached head is not recomputed."""
        out = self.eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, **GREEDY},
                                return_logprob=True, logprob_start_len=starts)
        return [[entry[0] for entry in o["meta_info"]["input_token_logprobs"]] for o in out]

    def reset(self) -> None:
        self.eng.flush_cache()
        self.extra = {}

    def close(self) -> None:
        if self.eng is not None:
            self.eng.shutdown()
            self.eng = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def make_engine(model: str, device: str, cache_on: bool, mem_fraction: float, **overrides):
    """Our engine for ``model`` with dummy weights (seed 0); ``overrides`` replace the defaults."""
    # Deferred heavy import (the whole runtime): the parent process imports this module's helpers only.
    from sglang_backend import Engine

    if device == "cuda":
        kw = dict(dtype=MODELS[model]["dtype"], attention_backend="triton", mem_fraction_static=mem_fraction)
    else:
        kw = dict(dtype="float32", attention_backend="torch_native", max_total_tokens=CPU_POOL_TOKENS)
    kw.update(overrides)
    return Engine(model_path=make_model_dir(model), load_format="dummy", device=device, random_seed=0,
                  disable_radix_cache=not cache_on, log_level="warning", **kw)


def engine_info(eng, init_s: float) -> dict:
    mr = eng.scheduler.model_runner
    sa = eng.server_args
    versions = {}
    for dist in ("sglang-backend", "torch", "triton", "transformers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return dict(engine_init_s=init_s, max_total_num_tokens=mr.max_total_num_tokens,
                capture_bs=getattr(getattr(mr, "graph_runner", None), "capture_bs", None),
                attention_backend=sa.attention_backend, dtype=sa.dtype, device=sa.device,
                disable_radix_cache=sa.disable_radix_cache, mem_fraction_static=sa.mem_fraction_static,
                versions=versions, torch_cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def greedy_with_top2(eng, prompts: list[list[int]]) -> tuple[list[list[int]], list[list]]:
    """Greedy output ids of ``prompts`` and, per output token, the top-2 [logprob, id, text] entries."""
    out = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": CHECK_TOKENS, **GREEDY},
                       return_logprob=True, top_logprobs_num=2)
    return [o["output_ids"] for o in out], [o["meta_info"]["output_top_logprobs"] for o in out]


def compare_greedy(ref: list[list[int]], ref_top: list[list], got: list[list[int]], near_tie: float) -> dict:
    """Where ``got`` parts from ``ref`` (per prompt: the first differing token and the reference's top-2 gap
    there) and whether every parting is at a near-tie (gap below ``near_tie``)."""
    partings = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a == b:
            continue
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        tops = ref_top[i][j] if j < len(ref_top[i]) else None
        gap = tops[0][0] - tops[1][0] if tops and len(tops) > 1 else None
        partings.append(dict(prompt=i, first_diff=j, ref_top2_gap=gap))
    same_len = len(ref) == len(got) and all(len(a) == len(b) for a, b in zip(ref, got))
    return dict(tokens_equal=same_len and not partings, partings=partings,
                ok=same_len and all(p["ref_top2_gap"] is not None and p["ref_top2_gap"] < near_tie
                                    for p in partings))


def check_vs_torch_native(client: OurClient, args) -> dict:
    """The first 16 greedy tokens of 2 prompts from the triton engine (``client``'s, closed afterwards: run
    this section last) against a torch_native engine's on the same dummy weights."""
    if args.device != "cuda":
        return {"skipped": "needs CUDA (the triton engine)", "prompts": CHECK_PROMPTS, "tokens": CHECK_TOKENS}
    vocab = MODELS[args.model]["config"]["vocab_size"]
    prompts = random_prompts(7, CHECK_PROMPTS, CHECK_PROMPT_LEN, vocab)
    client.reset()
    triton_ids, _ = greedy_with_top2(client.eng, prompts)
    client.close()  # the reference engine needs the memory
    ref = OurClient(make_engine(args.model, "cuda", True, 0.5, attention_backend="torch_native",
                                disable_cuda_graph=True, max_total_tokens=8192))
    try:
        ref_ids, ref_top = greedy_with_top2(ref.eng, prompts)
    finally:
        ref.close()
    dtype = MODELS[args.model]["dtype"]
    return dict(prompts=CHECK_PROMPTS, prompt_len=CHECK_PROMPT_LEN, tokens=CHECK_TOKENS, dtype=dtype,
                near_tie=NEAR_TIE[dtype], triton=triton_ids, torch_native=ref_ids,
                **compare_greedy(ref_ids, ref_top, triton_ids, NEAR_TIE[dtype]))


def main(argv: list[str] | None = None) -> int:
    ap = child_parser("our engine's side of the peer benchmark (one phase)")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--attention-backend", default="triton", help="on the GPU (the CPU runs torch_native)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the model dir's dummy one)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="one more ServerArgs field for our engine (repeatable; VALUE as JSON, else a string)")
    args = ap.parse_args(argv)
    result = new_result("ours", args)
    result["info"]["model"] = args.model
    write_json(args.out, result)
    try:
        t0 = time.perf_counter()
        backend = {"attention_backend": args.attention_backend} if args.device == "cuda" else {}
        if args.tokenizer:
            backend["tokenizer_path"] = args.tokenizer
        backend.update(server_arg_overrides(args.server_arg))
        result["info"]["server_args"] = dict(server_arg_overrides(args.server_arg))
        client = OurClient(make_engine(args.model, args.device, args.cache == "on", args.mem_fraction, **backend))
        result["info"].update(engine_info(client.eng, time.perf_counter() - t0))
        log("ours", f"cache {args.cache}: engine up in {result['info']['engine_init_s']:.1f} s, "
                    f"KV pool {result['info']['max_total_num_tokens']} tokens")
    except Exception:  # noqa: BLE001 - recorded for the parent
        result["errors"]["init"] = traceback.format_exc()
        write_json(args.out, result)
        log("ours", f"engine init FAILED\n{result['errors']['init']}")
        return 1
    write_json(args.out, result)
    vocab = MODELS[args.model]["config"]["vocab_size"]
    try:
        failed = run_sections("ours", client, vocab, args, result,
                              extra={"check": lambda _result: check_vs_torch_native(client, args)})
    finally:
        client.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
