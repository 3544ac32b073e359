"""The HF transformers reference: ``generate`` on the same model shape (random weights, built on the GPU) for
the decode step at batch 1 and 64 (1k context) and the shared-prefix workload in batches of 32."""

from __future__ import annotations

import gc
import time

import torch

from benchmarks.gpu.common import MODELS, RESULT, log, rand_ids, section, shared_prefix_prompts


def build_hf_model(name: str):
    # Deferred heavy import (transformers' Llama takes seconds): only this section needs it.
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = MODELS[name]
    dtype = getattr(torch, spec["dtype"])
    cfg = LlamaConfig(**spec["config"], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    t0 = time.perf_counter()
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    log(f"HF model built in {time.perf_counter() - t0:.1f} s")
    return model


def hf_decode(gen, g, vocab: int, res: dict):
    """Per-step decode time: (time of 1 + N new tokens - time of 1) / N, so the prefill cancels out."""
    for bs, ctx, steps in ((1, 1024, 64), (64, 1024, 16)):
        ids = [rand_ids(ctx - 1, g, vocab) for _ in range(bs)]
        gen(ids, 2)
        t1 = time.perf_counter(); gen(ids, 1); t1 = time.perf_counter() - t1
        tn = time.perf_counter(); gen(ids, steps + 1); tn = time.perf_counter() - tn
        res[f"decode_step_bs{bs}_s"] = (tn - t1) / steps
        log(f"HF decode bs={bs} ctx={ctx}: {res[f'decode_step_bs{bs}_s'] * 1e3:.2f} ms/step")


def hf_shared(gen, vocab: int, res: dict):
    """The shared-prefix workload in batches of 32 (HF has no prefix cache)."""
    prompts = shared_prefix_prompts(7, vocab)
    gen(prompts[:32], 2)
    t = time.perf_counter()
    for i in range(0, len(prompts), 32):
        gen(prompts[i : i + 32], 32)
    t = time.perf_counter() - t
    res["shared_prefix_s"] = t
    res["shared_prefix_req_per_s"] = len(prompts) / t
    log(f"HF shared prefix: {len(prompts)} requests in {t:.2f} s = {len(prompts) / t:.1f} req/s")


@section("hf")
def bench_hf(name: str, args):
    model = build_hf_model(name)
    vocab = MODELS[name]["config"]["vocab_size"]
    res = {}

    def gen(ids: list[list[int]], new: int):
        x = torch.tensor(ids, device="cuda")
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return out

    g = torch.Generator().manual_seed(1)
    gen([rand_ids(64, g, vocab)] * 2, 4)  # warm-up
    if "decode" in args.hf_parts:
        hf_decode(gen, g, vocab, res)
    if "shared" in args.hf_parts:
        hf_shared(gen, vocab, res)
    RESULT["hf"] = res
    del model
    gc.collect()
    torch.cuda.empty_cache()
