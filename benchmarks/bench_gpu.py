"""GPU benchmark: our engine (triton attention, CUDA graphs) vs the hardware ceilings and vs HF transformers
``generate``, measured in one run on one GPU.

Model: dummy (random) weights at Llama-2-7B shape in fp16 (``--model llama2-7b``) or Llama-3-8B shape in bf16
(``--model llama3-8b``, GQA 32/8); throughput does not depend on weight values. Every figure:

* ceilings, measured here: device-to-device copy bandwidth (bytes read + written) and a dense 8192^3 matmul
  rate in the model's dtype, both on random data;
* decode step at batch 1 and 64 with 1024 tokens of context, through ``ModelRunner.forward`` (CUDA graph
  replay; timed back to back, and with a per-step argmax + host read as the scheduler does), vs the bandwidth
  floor = (weights read per step + KV bytes read) / copy bandwidth; the engine's own per-step time (whole
  scheduler loop) from ``Engine.generate`` is reported beside it;
* prefill of 8 x 1024 new tokens through ``ModelRunner.forward``: achieved FLOP/s (linear layers + causal
  attention) vs the matmul rate;
* shared prefix: 128 requests = one 1024-token prefix + 64 unique tokens each, 32 output tokens
  (ignore_eos, greedy), requests/s for us (radix cache on, and off) and HF ``generate`` in batches of 32;
* offline 1k in / 1k out: N requests (as many as fit the KV pool in one wave, at most 64) output tokens/s.

    python -m benchmarks.bench_gpu                       # the figures above, Llama-2-7B fp16
    python -m benchmarks.bench_gpu --model llama3-8b --only ceilings,attn_sweep,runner,engine_decode
    python -m benchmarks.bench_gpu --smoke               # tiny model, seconds (a GPU is still needed)

Sections (``--only``, run in this order): ceilings, correctness (kernel errors vs float64 on fresh random
inputs), pdl_probe (a chain of GEMVs with and without PDL, eager and graphed), attn_sweep (decode-attention
launch configs; the fastest become the run's defaults), attn_layout (decode attention over the engine's KV
layout at the offline shape, ours vs FlashInfer), gemv_sweep
(cuBLAS vs Triton GEMV at batch 1), hf, profile (per-kernel time of an eager decode step), gemv_step_sweep
(GEMV launch configs per weight shape, judged by the whole batch-1 step), runner,
engine_decode, engine_trace (GPU timeline of the engine loop: kernel time and idle gaps per step), shared,
offline, no_overlap, no_pdl, no_radix. (An earlier ``sched_patch`` ablation measured scheduler changes that
have since landed in the scheduler; its result is kept in results/gpu_llama2_7b_sched_patch.json.)

Writes ``$OUT/gpu_<model>.json`` when $OUT is set, else ``benchmarks/results/gpu_<model>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

from benchmarks.common import env_info, format_table

MODELS = {
    "llama2-7b": dict(dtype="float16", config=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                                   max_position_embeddings=4096)),
    "llama3-8b": dict(dtype="bfloat16", config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                                    max_position_embeddings=8192, rope_theta=500000.0)),
    "tiny": dict(dtype="float16", config=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                              max_position_embeddings=4096)),
}

RESULT: dict = {}
OUT_PATH = ""


def log(*a):
    print(*a, flush=True)


def save():
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "w") as f:
        json.dump(RESULT, f, indent=2, default=str)


def section(name):
    def deco(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            log(f"== {name}")
            try:
                out = fn(*a, **k)
                RESULT.setdefault("sections", {})[name] = {"ok": True, "seconds": time.perf_counter() - t0}
                return out
            except Exception as e:  # noqa: BLE001 - keep the other figures
                traceback.print_exc()
                RESULT.setdefault("sections", {})[name] = {"ok": False, "error": repr(e),
                                                           "seconds": time.perf_counter() - t0}
                return None
            finally:
                save()
        return run
    return deco


def cuda_time(fn, iters: int, warmup: int = 2) -> list[float]:
    """Per-call seconds (events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


# Ceilings -----------------------------------------------------------------------------------------------------------
@section("ceilings")
def ceilings(dtype):
    n = 1 << 30  # 2 GiB per buffer in fp16
    bufs = [torch.empty(n, dtype=torch.float16, device="cuda").normal_() for _ in range(3)]
    dst = torch.empty_like(bufs[0])
    i = [0]

    def copy():
        dst.copy_(bufs[i[0] % 3])
        i[0] += 1

    t = statistics.median(cuda_time(copy, 20, 3))
    bw = 2 * bufs[0].numel() * 2 / t
    del bufs, dst
    torch.cuda.empty_cache()
    rates = {}
    for dt in (torch.float16, torch.bfloat16):
        m = 8192
        a = [torch.randn(m, m, device="cuda", dtype=dt) for _ in range(2)]
        b = torch.randn(m, m, device="cuda", dtype=dt)
        j = [0]

        def mm():
            torch.mm(a[j[0] % 2], b)
            j[0] += 1

        tm = statistics.median(cuda_time(mm, 20, 5))
        rates[str(dt).replace("torch.", "")] = 2 * m**3 / tm
        del a, b
    RESULT["ceilings"] = {"copy_bw_Bps": bw, "matmul_flops": rates}
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s; matmul " + ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in rates.items()))
    torch.cuda.empty_cache()


# Model files --------------------------------------------------------------------------------------------------------
def make_model_dir(name: str) -> str:
    from transformers import LlamaConfig

    from sglang_backend.runtime.model_loader.loader import build_dummy_tokenizer

    spec = MODELS[name]
    d = os.path.join(tempfile.gettempdir(), f"sglb_bench_{name}")
    os.makedirs(d, exist_ok=True)
    cfg = LlamaConfig(**spec["config"], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(d)
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        build_dummy_tokenizer(cfg.vocab_size).save_pretrained(d)
    return d


def model_bytes(cfg, dtype_bytes: int) -> dict:
    h, i, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // H
    per_layer = h * (H + 2 * Hkv) * d + H * d * h + 2 * h * i + i * h + 2 * h
    linear_params = L * per_layer + V * h + h  # layers + lm_head + final norm (the embedding is only gathered)
    kv_per_token = 2 * L * Hkv * d * dtype_bytes
    return {"read_params": linear_params, "weight_bytes": linear_params * dtype_bytes, "kv_bytes_per_token": kv_per_token,
            "matmul_params": L * (per_layer - 2 * h), "lm_head_params": V * h, "layers": L, "heads": H, "head_dim": d}


# Workloads ----------------------------------------------------------------------------------------------------------
def rand_ids(n: int, g: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(3, min(vocab, 30000), (n,), generator=g).tolist()


def shared_prefix_prompts(seed: int, vocab: int, n=128, prefix=1024, unique=64):
    g = torch.Generator().manual_seed(seed)
    p = rand_ids(prefix, g, vocab)
    return [p + rand_ids(unique, g, vocab) for _ in range(n)]


# HF transformers ----------------------------------------------------------------------------------------------------
@section("hf")
def bench_hf(name: str, args):
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
    vocab = cfg.vocab_size
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
        for bs, ctx, steps in ((1, 1024, 64), (64, 1024, 16)):
            ids = [rand_ids(ctx - 1, g, vocab) for _ in range(bs)]
            gen(ids, 2)
            t1 = time.perf_counter(); gen(ids, 1); t1 = time.perf_counter() - t1
            tn = time.perf_counter(); gen(ids, steps + 1); tn = time.perf_counter() - tn
            res[f"decode_step_bs{bs}_s"] = (tn - t1) / steps
            log(f"HF decode bs={bs} ctx={ctx}: {res[f'decode_step_bs{bs}_s'] * 1e3:.2f} ms/step")
    if "shared" in args.hf_parts:
        prompts = shared_prefix_prompts(7, vocab)
        gen(prompts[:32], 2)
        t = time.perf_counter()
        for i in range(0, len(prompts), 32):
            gen(prompts[i : i + 32], 32)
        t = time.perf_counter() - t
        res["shared_prefix_s"] = t
        res["shared_prefix_req_per_s"] = len(prompts) / t
        log(f"HF shared prefix: {len(prompts)} requests in {t:.2f} s = {len(prompts) / t:.1f} req/s")
    RESULT["hf"] = res
    del model
    gc.collect()
    torch.cuda.empty_cache()


# Ours -----------------------------------------------------------------------------------------------------------------
def make_engine(model_dir: str, dtype: str, **kw):
    from sglang_backend import Engine

    t0 = time.perf_counter()
    eng = Engine(model_path=model_dir, load_format="dummy", dtype=dtype, device="cuda", attention_backend="triton",
                 log_level="warning", **kw)
    mr = eng.scheduler.model_runner
    log(f"engine up in {time.perf_counter() - t0:.1f} s; KV pool {mr.max_total_num_tokens} tokens; "
        f"graphs {getattr(mr.graph_runner, 'capture_bs', None)}")
    return eng


def close_engine(eng):
    eng.shutdown()
    del eng
    gc.collect()
    torch.cuda.empty_cache()


def _alloc_requests(mr, lens: list[int]):
    rows = [mr.req_to_token_pool.alloc() for _ in lens]
    assert None not in rows
    slots = mr.token_to_kv_pool_allocator.alloc(sum(lens))
    assert slots is not None, "KV pool too small for the microbenchmark"
    per, off = [], 0
    for r, n in zip(rows, lens):
        mr.req_to_token_pool.write(r, 0, slots[off : off + n])
        per.append(slots[off : off + n].to(mr.device))
        off += n
    return rows, slots.to(mr.device), per


def _random_kv(mr):
    pool = mr.token_to_kv_pool
    for buf in pool.k_buffer + pool.v_buffer:  # random KV, never zeros
        buf.normal_()


def _free_requests(mr, rows, slots):
    mr.token_to_kv_pool_allocator.free(slots)
    for r in rows:
        mr.req_to_token_pool.free(r)


@section("runner")
def bench_runner(eng, mb: dict, name: str):
    """Decode step and prefill through ModelRunner.forward (the engine is idle meanwhile)."""
    from sglang_backend.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

    eng.flush_cache()
    mr = eng.scheduler.model_runner
    _random_kv(mr)
    ceil = RESULT.get("ceilings", {})
    bw = ceil.get("copy_bw_Bps")
    mm_rate = ceil.get("matmul_flops", {}).get(MODELS[name]["dtype"])
    res = {}
    V = mr.vocab_size
    from sglang_backend.runtime.layers.attention.triton_ops import pdl
    from sglang_backend.runtime.model_executor.cuda_graph_runner import CudaGraphRunner

    from sglang_backend.runtime.layers.attention import triton_backend as tb

    def configure(gemv_mode, use_pdl, fused_merge=tb.FUSED_MERGE):
        """Batch-1 linears (cuBLAS / Triton GEMV / fused GEMV), PDL and the decode attention's merge (folded
        into stage 1 or a stage-2 kernel); the graphs are recaptured."""
        if mr.executor is not None:
            mr.executor.gemv_mode = gemv_mode
        if hasattr(mr.attn_backend, "fused_merge"):
            mr.attn_backend.fused_merge = fused_merge
        pdl.set_enabled(use_pdl)
        mr.graph_runner = None
        gc.collect()
        mr.graph_runner = CudaGraphRunner(mr)

    # Each (batch, linears, PDL, fused merge) variant; the product defaults become "decode_bs1"/"decode_bs64".
    fused_ok = mr.executor is not None
    variants = [(1, m, p, f) for m, p, f in (
        ("fused_rope", True, True), ("fused_rope", False, True), ("fused_rope", False, False), ("fused", True, True),
        ("on", True, True), ("off", True, True)) if fused_ok or m == "off"]
    variants += [(64, "off", True, True), (64, "off", False, True)]
    for bs, gemv_mode, use_pdl, fused_merge in variants:
        ctx = 1024
        configure(gemv_mode, use_pdl, fused_merge)
        rows, slots, per = _alloc_requests(mr, [ctx] * bs)
        fb = ForwardBatch(ForwardMode.DECODE, torch.randint(3, V, (bs,), device="cuda"),
                          torch.full((bs,), ctx - 1, device="cuda"), torch.stack([p[-1] for p in per]),
                          torch.tensor(rows, device="cuda"), torch.full((bs,), ctx, device="cuda"), [ctx] * bs,
                          logits_indices=torch.arange(bs, device="cuda"),
                          shared_first_slot=mr.req_to_token_pool.same_first_slot(rows))
        pipelined = cuda_time(lambda: mr.forward(fb), 30, 5)

        def synced():
            mr.forward(fb).argmax(-1).tolist()

        t_sync = []
        for _ in range(3):
            synced()
        for _ in range(30):
            t0 = time.perf_counter()
            synced()
            t_sync.append(time.perf_counter() - t0)
        floor_bytes = mb["weight_bytes"] + bs * ctx * mb["kv_bytes_per_token"]
        floor = floor_bytes / bw if bw else None
        step = statistics.median(pipelined)
        key = f"decode_bs{bs}_{gemv_mode}_{'pdl' if use_pdl else 'nopdl'}{'' if fused_merge else '_stage2'}"
        res[key] = {"gemv_mode": gemv_mode, "pdl": use_pdl, "fused_merge": fused_merge,
                    "ctx": ctx, "step_s": step,
                    "step_synced_s": statistics.median(t_sync), "floor_bytes": floor_bytes, "floor_s": floor,
                    "ratio_to_floor": step / floor if floor else None, "achieved_Bps": floor_bytes / step}
        log(f"decode bs={bs} ctx={ctx} [{key}]: {step * 1e3:.3f} ms (synced {statistics.median(t_sync) * 1e3:.3f} ms); "
            f"floor {floor * 1e3 if floor else float('nan'):.3f} ms; ratio {step / floor if floor else float('nan'):.3f}")
        if use_pdl and fused_merge and gemv_mode in ("fused_rope", "off"):  # eager, for the record
            gr = mr.graph_runner
            mr.graph_runner = None
            try:
                res[key]["step_eager_s"] = statistics.median(cuda_time(lambda: mr.forward(fb), 10, 2))
            finally:
                mr.graph_runner = gr
            log(f"   eager (no graph): {res[key]['step_eager_s'] * 1e3:.3f} ms")
        _free_requests(mr, rows, slots)
    # The headline figures are the product defaults (fused GEMV on sm90+, PDL off); the rest stay as variants.
    from sglang_backend.runtime.layers.attention.triton_ops.fused_llama import default_gemv_mode

    default_mode = default_gemv_mode("cuda") if fused_ok else "off"
    pdl.set_enabled(None)
    default_pdl = pdl.enabled(torch.empty(0, device="cuda"))
    for bs in (1, 64):
        best = min((k for k in res if k.startswith(f"decode_bs{bs}_")), key=lambda k: res[k]["step_s"])
        key = (f"decode_bs{bs}_{default_mode if bs == 1 else 'off'}_{'pdl' if default_pdl else 'nopdl'}"
               + ("" if tb.FUSED_MERGE else "_stage2"))
        res[f"decode_bs{bs}"] = dict(res[key], variant=key, fastest_variant=best)
        log(f"decode bs={bs}: default {key} {res[key]['step_s'] * 1e3:.3f} ms; fastest {best}")
    configure(default_mode, None)
    log(f"configured for the following sections: batch-1 linears {default_mode}, PDL {default_pdl}")

    # Prefill 8 x 1024.
    n_req, n = 8, 1024
    rows, slots, per = _alloc_requests(mr, [n] * n_req)
    T = n_req * n
    fb = ForwardBatch(ForwardMode.EXTEND, torch.randint(3, V, (T,), device="cuda"),
                      torch.arange(n, device="cuda").repeat(n_req), slots, torch.tensor(rows, device="cuda"),
                      torch.full((n_req,), n, device="cuda"), [n] * n_req,
                      extend_prefix_lens_cpu=[0] * n_req, extend_seq_lens_cpu=[n] * n_req,
                      logits_indices=torch.arange(n_req, device="cuda") * n + n - 1)
    times = cuda_time(lambda: mr.forward(fb), 7, 2)
    t = statistics.median(times)
    L, H, D = mb["layers"], mb["heads"], mb["head_dim"]
    linear_flops = 2 * T * mb["matmul_params"] + 2 * n_req * mb["lm_head_params"]
    attn_flops = 4 * L * H * D * n_req * (n * (n + 1) // 2)
    flops = linear_flops + attn_flops
    res["prefill_8x1024"] = {"time_s": t, "flops": flops, "linear_flops": linear_flops, "attn_flops": attn_flops,
                             "achieved_flops": flops / t, "matmul_rate": mm_rate,
                             "fraction_of_matmul_rate": flops / t / mm_rate if mm_rate else None,
                             "tokens_per_s": T / t}
    log(f"prefill 8x1024: {t * 1e3:.1f} ms = {flops / t / 1e12:.0f} TFLOP/s "
        f"({flops / t / mm_rate * 100 if mm_rate else float('nan'):.0f}% of matmul rate)")
    _free_requests(mr, rows, slots)
    eng.flush_cache()
    RESULT.setdefault("ours", {}).update(res)


@section("gemv_step_sweep")
def bench_gemv_step_sweep(eng, mb: dict):
    """Launch configs of the fused batch-1 GEMV, judged by the whole decode step (bs 1, 1k context, CUDA graph)
    rather than by each GEMV alone (alone, launch and tail dominate and mislead). One weight shape at a time,
    the others at their best so far (coordinate descent); the winners go into gemv.GEMV_CONFIGS for the rest
    of the run and are printed, to be written into gemv.py."""
    from sglang_backend.runtime.layers.attention.triton_ops import gemv as gemv_mod
    from sglang_backend.runtime.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang_backend.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

    mr = eng.scheduler.model_runner
    if mr.executor is None:
        log("no fused executor: skipped")
        return
    eng.flush_cache()
    _random_kv(mr)
    mode = mr.executor.gemv_mode
    if not mode.startswith("fused"):
        mr.executor.gemv_mode = "fused_rope"
    layer = mr.executor.model.model.layers[0]
    shapes = {"qkv": (layer.self_attn.qkv_proj.weight, False), "o": (layer.self_attn.o_proj.weight, False),
              "gate_up": (layer.mlp.gate_up_proj.weight, True), "down": (layer.mlp.down_proj.weight, False),
              "lm_head": (mr.executor.model.lm_head_weight, False)}
    shapes = {k: (w.shape[0], w.shape[1], silu) for k, (w, silu) in shapes.items()}
    # Around the last sweep's winner ([4, 1024, 4, 3], now the default; session 4 on an H100): fewer rows per
    # program, longer K tiles, more warps or stages.
    candidates = [[4, 1024, 4, 3], [2, 1024, 4, 3], [2, 2048, 4, 3], [1, 2048, 4, 3], [4, 2048, 8, 2],
                  [4, 1024, 4, 4], [4, 1024, 8, 3], [4, 512, 4, 4], [4, 512, 2, 4], [2, 1024, 2, 4],
                  [8, 1024, 4, 3], [8, 512, 4, 3], [16, 256, 4, 3]]
    ctx = 1024
    rows, slots, per = _alloc_requests(mr, [ctx])
    fb = ForwardBatch(ForwardMode.DECODE, torch.randint(3, mr.vocab_size, (1,), device="cuda"),
                      torch.full((1,), ctx - 1, device="cuda"), per[0][-1:], torch.tensor(rows, device="cuda"),
                      torch.full((1,), ctx, device="cuda"), [ctx], logits_indices=torch.arange(1, device="cuda"))

    def step_time() -> float:
        mr.graph_runner = None
        gc.collect()
        mr.graph_runner = CudaGraphRunner(mr, capture_bs=[1])
        return statistics.median(cuda_time(lambda: mr.forward(fb), 30, 5))

    res = {"shapes": {k: list(v) for k, v in shapes.items()}, "runs": []}
    try:
        res["start_s"] = best_t = step_time()
        log(f"gemv step sweep: start {best_t * 1e3:.3f} ms")
        for name, key in shapes.items():
            best_cfg = gemv_mod.GEMV_CONFIGS.get(key, gemv_mod.GEMV_CONFIG)
            for cfg in candidates:
                if cfg == best_cfg:
                    continue
                gemv_mod.GEMV_CONFIGS[key] = cfg
                try:
                    t = step_time()
                except Exception as e:  # noqa: BLE001 - a config may not compile (registers, shared memory)
                    log(f"  {name} {cfg} failed: {e!r}"[:200])
                    continue
                res["runs"].append({"shape": name, "config": cfg, "step_s": t})
                log(f"  {name} {cfg}: {t * 1e3:.3f} ms")
                if t < best_t:
                    best_t, best_cfg = t, cfg
            gemv_mod.GEMV_CONFIGS[key] = best_cfg
            log(f"  {name} {key}: best {best_cfg} ({best_t * 1e3:.3f} ms)")
        res["final_s"] = step_time()
        res["chosen"] = {name: gemv_mod.GEMV_CONFIGS.get(key, gemv_mod.GEMV_CONFIG) for name, key in shapes.items()}
        floor = (mb["weight_bytes"] + ctx * mb["kv_bytes_per_token"]) / RESULT["ceilings"]["copy_bw_Bps"] \
            if "ceilings" in RESULT else None
        res["floor_s"] = floor
        log(f"gemv step sweep: {res['start_s'] * 1e3:.3f} -> {res['final_s'] * 1e3:.3f} ms"
            + (f" ({res['final_s'] / floor:.3f}x floor)" if floor else "") + f"; GEMV_CONFIGS = {{"
            + ", ".join(f"{tuple(shapes[n])}: {c}" for n, c in res["chosen"].items()) + "}")
    finally:
        _free_requests(mr, rows, slots)
        mr.executor.gemv_mode = mode
        mr.graph_runner = None
        gc.collect()
        mr.graph_runner = CudaGraphRunner(mr)
    RESULT["gemv_step_sweep"] = res


@section("runner_shared")
def bench_runner_shared(eng, mb: dict):
    """Decode step at batch 128 where every request's first 1024 KV slots are the same slots (a radix hit),
    vs the same batch with private slots: shows whether decode attention re-reads the shared prefix from
    HBM or from L2."""
    from sglang_backend.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

    eng.flush_cache()
    mr = eng.scheduler.model_runner
    _random_kv(mr)
    prefix, unique = 1024, 65
    ctx = prefix + unique
    bs = 128 if mr.max_total_num_tokens >= 128 * ctx else 96  # the private variant must fit the pool
    res = {}
    for shared in (True, False):
        rows = [mr.req_to_token_pool.alloc() for _ in range(bs)]
        n_slots = prefix + bs * unique if shared else bs * ctx
        slots = mr.token_to_kv_pool_allocator.alloc(n_slots)
        last = []
        for i, r in enumerate(rows):
            if shared:
                own = slots[prefix + i * unique: prefix + (i + 1) * unique]
                mr.req_to_token_pool.write(r, 0, slots[:prefix])
                mr.req_to_token_pool.write(r, prefix, own)
            else:
                own = slots[i * ctx: (i + 1) * ctx]
                mr.req_to_token_pool.write(r, 0, own)
            last.append(own[-1])
        fb = ForwardBatch(ForwardMode.DECODE, torch.randint(3, mr.vocab_size, (bs,), device="cuda"),
                          torch.full((bs,), ctx - 1, device="cuda"), torch.stack(last).to("cuda"),
                          torch.tensor(rows, device="cuda"), torch.full((bs,), ctx, device="cuda"), [ctx] * bs,
                          logits_indices=torch.arange(bs, device="cuda"),
                          shared_first_slot=mr.req_to_token_pool.same_first_slot(rows))
        step = statistics.median(cuda_time(lambda: mr.forward(fb), 20, 3))
        key = "shared" if shared else "private"
        res[key] = step
        log(f"runner decode bs={bs} ctx={ctx} {key} prefix slots: {step * 1e3:.2f} ms")
        mr.token_to_kv_pool_allocator.free(slots)
        for r in rows:
            mr.req_to_token_pool.free(r)
    bw = RESULT.get("ceilings", {}).get("copy_bw_Bps")
    if bw:
        res["floor_shared_s"] = (mb["weight_bytes"] + (prefix + bs * unique) * mb["kv_bytes_per_token"]) / bw
        res["floor_private_s"] = (mb["weight_bytes"] + bs * ctx * mb["kv_bytes_per_token"]) / bw
    eng.flush_cache()
    res["bs"] = bs
    RESULT.setdefault("ours", {})["runner_shared"] = res


@section("cpu_profile")
def bench_cpu_profile(eng, vocab: int):
    """Where the scheduler thread's time goes in the shared-prefix workload and a short 1k-context decode:
    cProfile around each Scheduler.step (run in the engine's loop thread), top functions by own time."""
    import cProfile
    import pstats

    sched = eng.scheduler
    orig = sched.step
    prof = cProfile.Profile()
    steps = {"n": 0, "s": 0.0}

    def profiled_step():
        t0 = time.perf_counter()
        prof.enable()
        try:
            return orig()
        finally:
            prof.disable()
            steps["n"] += 1
            steps["s"] += time.perf_counter() - t0

    out = {}
    for name, prompts, new in (("shared", shared_prefix_prompts(9, vocab), 32),
                               ("decode_bs56_ctx1k", [rand_ids(1024, torch.Generator().manual_seed(i), vocab)
                                                      for i in range(56)], 64)):
        eng.flush_cache()
        prof = cProfile.Profile()
        steps.update(n=0, s=0.0)
        sched.step = profiled_step
        try:
            t = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "ignore_eos": True,
                                                             "temperature": 0})
            t = time.perf_counter() - t
        finally:
            sched.step = orig
        st = pstats.Stats(prof)
        rows = sorted(((v[2], v[3], v[1], f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}") for k, v in st.stats.items()),
                      reverse=True)[:25]
        log(f"-- cpu profile {name}: {steps['n']} steps, {steps['s']:.3f} s in step(), wall {t:.3f} s")
        for tt, ct, nc, fn in rows:
            log(f"{tt * 1e3:9.1f} ms own {ct * 1e3:9.1f} ms cum {nc:7d}x  {fn}")
        out[name] = {"steps": steps["n"], "step_s": steps["s"], "wall_s": t,
                     "top_own": [[fn, tt, ct, nc] for tt, ct, nc, fn in rows]}
    eng.flush_cache()
    RESULT["cpu_profile"] = out


@section("engine_decode")
def bench_engine_decode(eng, vocab: int, suffix: str = ""):
    """Per-step time of the whole engine loop (scheduler, sampling, detokenizer state) at ~1k context: (time of
    a 17+N-token generation - time of a 17-token one) / N, median of 3, so the prefill and the start and drain
    of the overlapped decode pipeline cancel out."""
    res = {}
    g = torch.Generator().manual_seed(11)
    base = 17
    for bs, steps in ((1, 128), (64, 32)):
        prompts = [rand_ids(1024, g, vocab) for _ in range(bs)]

        def timed(n: int) -> float:
            eng.flush_cache()
            t = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "ignore_eos": True,
                                                               "temperature": 0})
            return time.perf_counter() - t

        timed(base + steps)  # warm-up
        per_step = statistics.median((timed(base + steps) - timed(base)) / steps for _ in range(3))
        res[f"engine_decode_step_bs{bs}_s{suffix}"] = per_step
        log(f"engine decode{suffix} bs={bs}: {per_step * 1e3:.2f} ms/step")
    eng.flush_cache()
    RESULT.setdefault("ours", {}).update(res)


@section("shared_prefix")
def bench_shared(eng, vocab: int, key: str):
    sp = {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0}
    eng.flush_cache()
    eng.generate(input_ids=shared_prefix_prompts(3, vocab, n=32), sampling_params=sp)  # warm-up
    eng.flush_cache()
    prompts = shared_prefix_prompts(7, vocab)
    # Prefill phase alone (one output token), then the whole workload, both from a cold cache.
    t1 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=1))
    t1 = time.perf_counter() - t1
    eng.flush_cache()
    before = eng.get_stats()
    t = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=sp)
    t = time.perf_counter() - t
    stats = eng.get_stats()
    RESULT.setdefault("ours", {})[key] = {
        "time_s": t, "req_per_s": len(prompts) / t, "cache_hit_rate": stats.get("cache_hit_rate"),
        "prefill_phase_s": t1, "decode_step_s": (t - t1) / 31,
        "prefill_batches": stats["num_prefill_batches"] - before["num_prefill_batches"],
        "decode_batches": stats["num_decode_batches"] - before["num_decode_batches"],
        "tree_op_s": stats["tree_op_seconds"] - before["tree_op_seconds"]}
    log(f"   prefill phase {t1:.3f} s; decode ~{(t - t1) / 31 * 1e3:.1f} ms/step; "
        f"{RESULT['ours'][key]['prefill_batches']} prefill + {RESULT['ours'][key]['decode_batches']} decode batches; "
        f"tree ops {RESULT['ours'][key]['tree_op_s']:.3f} s")
    log(f"{key}: {len(prompts)} requests in {t:.2f} s = {len(prompts) / t:.1f} req/s "
        f"(hit rate {stats.get('cache_hit_rate'):.2f})")
    eng.flush_cache()


@section("offline_1k_1k")
def bench_offline(eng, vocab: int, max_req: int, key: str = "offline_1k_1k"):
    mr = eng.scheduler.model_runner
    n = max(1, min(max_req, int(mr.max_total_num_tokens * 0.97) // 2048))
    g = torch.Generator().manual_seed(5)
    prompts = [rand_ids(1024, g, vocab) for _ in range(n)]
    sp = {"max_new_tokens": 1024, "ignore_eos": True, "temperature": 0}
    eng.flush_cache()
    before = eng.get_stats()
    # Per scheduler step: wall seconds and what ran (to split prefill from decode and see decode vs context).
    sched = eng.scheduler
    orig_step, steps = sched.step, []

    def timed_step():
        st = sched.stats
        n_pre, n_dec = st.num_prefill_batches, st.num_decode_batches
        t0 = time.perf_counter()
        r = orig_step()
        steps.append((time.perf_counter() - t0, st.num_prefill_batches - n_pre, st.num_decode_batches - n_dec))
        return r

    sched.step = timed_step
    t = time.perf_counter()
    try:
        out = eng.generate(input_ids=prompts, sampling_params=sp)
    finally:
        sched.step = orig_step
    t = time.perf_counter() - t
    after = eng.get_stats()
    toks = sum(len(o["output_ids"]) for o in out)
    prefill_s = sum(dt for dt, p, _ in steps if p)
    dec = [dt for dt, p, d in steps if d and not p]
    quarters = [statistics.mean(dec[i * len(dec) // 4:(i + 1) * len(dec) // 4]) for i in range(4)] if len(dec) >= 4 else []
    log(f"   {len(steps)} steps: prefill {prefill_s:.2f} s; {len(dec)} decode steps {sum(dec):.2f} s, "
        f"mean ms per quarter of the run {[round(q * 1e3, 2) for q in quarters]}")
    RESULT.setdefault("ours", {})[key] = {
        "num_requests": n, "time_s": t, "output_tokens": toks, "output_tok_per_s": toks / t,
        "retractions": after["num_retractions"] - before["num_retractions"],
        "decode_batches": after["num_decode_batches"] - before["num_decode_batches"],
        "forward_seconds": after["forward_seconds"] - before["forward_seconds"],
        "prefill_step_s": prefill_s, "decode_step_s_total": sum(dec), "decode_step_ms_by_quarter": [q * 1e3 for q in quarters],
    }
    log(f"{key}: {n} requests, {toks} tokens in {t:.1f} s = {toks / t:.0f} tok/s "
        f"(forward {after['forward_seconds'] - before['forward_seconds']:.1f} s)")
    eng.flush_cache()

@section("correctness")
def bench_correctness():
    """Worst relative error of the kernels vs float64 references on fresh random inputs (recorded in the JSON)."""
    import random

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))
    from kernel_checks import check_decode, check_extend, check_fused_ops

    rng = random.Random(int(time.time()))
    res = {}
    for dtype in (torch.float16, torch.bfloat16):
        dn = str(dtype).replace("torch.", "")
        for shape in ((32, 32, 128), (32, 8, 128), (28, 4, 128), (8, 1, 64)):
            key = f"{dn}_{'x'.join(map(str, shape))}"
            d = max(check_decode("cuda", dtype, *shape, [rng.randint(1, 4000) for _ in range(rng.choice([1, 7, 33]))],
                                 rng.choice([1, 8, 32]), seed=rng.randint(0, 1 << 30)) for _ in range(2))
            bs = rng.choice([1, 3, 6])
            e = max(check_extend("cuda", dtype, *shape, [rng.choice([0, rng.randint(1, 2000)]) for _ in range(bs)],
                                 [rng.randint(1, 1500) for _ in range(bs)], seed=rng.randint(0, 1 << 30))
                    for _ in range(2))
            res[key] = {"decode_rel_err": d, "extend_rel_err": e}
        res[f"{dn}_fused_ops"] = check_fused_ops("cuda", dtype, T=64, hidden=4096, inter=11008, num_heads=32,
                                                 num_kv_heads=8, head_dim=128)
    RESULT["kernel_errors"] = res
    for k, v in res.items():
        log(k, {a: f"{b:.2e}" for a, b in v.items()})


def graph_time(fns, reps: int = 7) -> float:
    """GPU seconds per call of the callables in ``fns`` (run in turn), timed as CUDA-graph replays so that
    Python launch overhead is excluded (as in the captured decode step)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for f in fns:
            f()
    t = statistics.median(cuda_time(g.replay, reps, 2))
    del g
    return t / len(fns)


@section("pdl_probe")
def bench_pdl_probe():
    """Does programmatic dependent launch shorten the gaps between dependent kernels here? A chain of 64
    dependent 4096x4096 GEMVs (8 weights rotated: 268 MB, past the L2), timed eager and as a CUDA graph, with
    and without PDL: per-GEMV time and bandwidth."""
    from sglang_backend.runtime.layers.attention.triton_ops import pdl
    from sglang_backend.runtime.layers.attention.triton_ops.gemv import gemv

    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.float16) / 64 for _ in range(8)]
    x0 = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    n = 64

    def chain():
        x = x0
        for i in range(n):
            x = gemv(x, ws[i % len(ws)])
        return x

    res = {}
    try:
        for use_pdl in (False, True):
            pdl.set_enabled(use_pdl)
            eager = statistics.median(cuda_time(chain, 10, 3)) / n
            graph = graph_time([chain]) / n
            tag = "pdl" if use_pdl else "nopdl"
            res[tag] = {"eager_us": eager * 1e6, "graph_us": graph * 1e6, "graph_Bps": ws[0].nbytes / graph}
            log(f"pdl_probe {tag}: eager {eager * 1e6:.2f} us, graph {graph * 1e6:.2f} us per 4096x4096 GEMV "
                f"({ws[0].nbytes / graph / 1e12:.2f} TB/s)")
    finally:
        pdl.set_enabled(None)
    RESULT["pdl_probe"] = res


@section("attn_sweep")
def bench_attn_sweep(name: str):
    """Decode attention alone (batch 1 at 1k context, 64 at 1k and 2k) over launch configs and split counts,
    timed in CUDA graphs with the KV of several layers rotated (so nothing is served from L2), the merge of the
    splits folded into stage 1 as the engine runs it. The fastest small- and large-batch configs become the defaults for the rest of the run,
    and the fastest batch-1 split count sets how many stage-1 programs decode aims for."""
    from sglang_backend.runtime.layers.attention import triton_backend as tb
    from sglang_backend.runtime.layers.attention.triton_ops import decode_attention as da

    cfg = MODELS[name]["config"]
    dtype = getattr(torch, MODELS[name]["dtype"])
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    res = []
    chosen = {}
    counters = torch.zeros(64 * H, dtype=torch.int32, device="cuda")
    # (BLOCK_N, warps, stages, head_fastest); session 5's H100 sweep found batch 1 best at 16 splits of 64-token
    # tiles on 2 warps, batch 64 at [64, 4, 3] (about equal to [128, 4, 2]).
    for bs, n_layers, contexts, splits_list, configs in (
        (1, 8, (1024,), (16, 32), [(bn, w, st, True) for bn in (32, 64, 128) for w in (2, 4) for st in (1, 2)]),
        # Large batches at 1k and 2k context (offline 1k in / 1k out decodes at 1-2k): ranked by the sum.
        (64, 2, (1024, 2048), (1, 2), [(bn, w, st, hf) for bn in (64, 128) for w in (4, 8) for st in (2, 3)
                                        for hf in (True, False)]),
    ):
        for ctx in contexts:
            n_slots = bs * ctx + 1
            kv = [(torch.randn(n_slots, Hkv, D, device="cuda", dtype=dtype),
                   torch.randn(n_slots, Hkv, D, device="cuda", dtype=dtype)) for _ in range(n_layers)]
            r2t = (torch.arange(bs * ctx, device="cuda") + 1).view(bs, ctx)  # fresh allocations are consecutive
            rows = torch.arange(bs, device="cuda")
            seq = torch.full((bs,), ctx, device="cuda")
            q = torch.randn(bs, H, D, device="cuda", dtype=dtype)
            o = torch.empty_like(q)
            nbytes = 2 * bs * ctx * Hkv * D * q.element_size()
            for splits in splits_list:
                mid_o = torch.empty(bs, H, splits, D, device="cuda", dtype=torch.float32)
                mid_lse = torch.empty(bs, H, splits, device="cuda", dtype=torch.float32)
                for c in configs:
                    try:
                        fns = [(lambda k=k, v=v: da.decode_attention_fwd(
                            q, k, v, o, r2t, rows, seq, mid_o, mid_lse, splits, D**-0.5, c, merge_counters=counters,
                            )) for k, v in kv]
                        t = graph_time(fns)
                    except Exception as e:  # noqa: BLE001 - a config may not compile (shared memory)
                        log(f"config {c} failed: {e!r}"[:200])
                        continue
                    res.append({"bs": bs, "ctx": ctx, "splits": splits, "config": list(c),
                                "time_s": t, "Bps": nbytes / t})
            del kv
            torch.cuda.empty_cache()
        totals: dict = {}
        for r in res:
            if r["bs"] == bs:
                key = (r["splits"], tuple(r["config"]))
                totals.setdefault(key, []).append(r)
        full = [rs for rs in totals.values() if len(rs) == len(contexts)]  # measured at every context
        ranked = sorted(full, key=lambda rs: sum(r["time_s"] for r in rs))
        best = [dict(rs[0], time_s=sum(r["time_s"] for r in rs), Bps=sum(r["Bps"] for r in rs) / len(rs))
                for rs in ranked]
        for r in best[:4] + best[-1:]:
            log(f"attn bs={bs} splits={r['splits']} cfg={r['config']}: "
                f"{r['time_s'] * 1e6:.1f} us over ctx {contexts}, mean {r['Bps'] / 1e12:.2f} TB/s")
        size = "small" if bs == 1 else "large"
        chosen[size] = best[0]["config"]
        if bs == 1:  # the engine's split count at batch 1 becomes the winner's
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            tb.TARGET_PROGRAMS_PER_SM = best[0]["splits"] * Hkv / sms
    table_ = da.MHA_CONFIG if H == Hkv else da.GQA_CONFIG
    table_.update(chosen)
    log(f"decode attention configs now {table_}; "
        f"TARGET_PROGRAMS_PER_SM = {tb.TARGET_PROGRAMS_PER_SM:.2f}")
    RESULT["attn_sweep"] = {"runs": res, "chosen": chosen,
                            "target_programs_per_sm": tb.TARGET_PROGRAMS_PER_SM}


def _flashinfer_decode(q, kv, r2t, dtype, sm_scale, tensor_cores: bool):
    """A FlashInfer paged decode over the same pool (one-token pages), planned once; None without the package."""
    try:
        import flashinfer
    except ImportError:
        return None
    bs, ctx = r2t.shape
    H, D = q.shape[1], q.shape[2]
    Hkv = kv[0][0].shape[1]
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    w.plan(torch.arange(bs + 1, dtype=torch.int32) * ctx, r2t.flatten().to(torch.int32),
           torch.ones(bs, dtype=torch.int32), H, Hkv, D, 1, q_data_type=dtype, kv_data_type=dtype, sm_scale=sm_scale)
    return [(lambda k=k, v=v: w.run(q, (k.unsqueeze(1), v.unsqueeze(1)))) for k, v in kv]


@section("attn_layout")
def bench_attn_layout(name: str):
    """Decode attention at the offline 1k/1k shape (batch 56, 1.5k context) as the engine lays its KV out: the
    1024 prompt tokens of each request in consecutive slots, the decoded ones interleaved across the batch (each
    step allocates one slot per request), vs every request's slots consecutive (what attn_sweep times). Our
    kernel and FlashInfer's decode (when installed, with and without tensor cores) over the same pool, all eager
    with 4 layers' KV rotated; outputs compared with ours."""
    from sglang_backend.runtime.layers.attention import triton_backend as tb
    from sglang_backend.runtime.layers.attention.triton_ops import decode_attention as da

    cfg = MODELS[name]["config"]
    dtype = getattr(torch, MODELS[name]["dtype"])
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    bs, ctx, prompt, n_layers = 56, 1536, 1024, 4
    n_slots = bs * ctx + 1
    kv = [(torch.randn(n_slots, Hkv, D, device="cuda", dtype=dtype),
           torch.randn(n_slots, Hkv, D, device="cuda", dtype=dtype)) for _ in range(n_layers)]
    layouts = {"consecutive": (torch.arange(bs * ctx, device="cuda") + 1).view(bs, ctx)}
    t = torch.arange(ctx, device="cuda")
    b = torch.arange(bs, device="cuda")[:, None]
    layouts["engine"] = torch.where(t < prompt, 1 + b * prompt + t, 1 + bs * prompt + (t - prompt) * bs + b)
    rows = torch.arange(bs, device="cuda")
    seq = torch.full((bs,), ctx, device="cuda")
    q = torch.randn(bs, H, D, device="cuda", dtype=dtype)
    nbytes = 2 * bs * ctx * Hkv * D * q.element_size()
    counters = torch.zeros(bs * H, dtype=torch.int32, device="cuda")
    # The engine's split count and scratch for this batch size (no cascade: nothing is shared).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = tb.num_kv_splits(bs, Hkv, sms)  # one stage-1 program per (request, KV head, split)
    mid_o = torch.empty(bs, H, splits, D, device="cuda", dtype=torch.float32)
    mid_lse = torch.empty(bs, H, splits, device="cuda", dtype=torch.float32)
    res = {}
    for lname, r2t in layouts.items():
        outs = {}
        kernels = {}
        o = torch.empty_like(q)
        kernels["ours"] = (o, [(lambda k=k, v=v: da.decode_attention_fwd(
            q, k, v, o, r2t, rows, seq, mid_o, mid_lse, splits, D**-0.5, merge_counters=counters)) for k, v in kv])
        for tc in (False, True):
            try:
                fns = _flashinfer_decode(q, kv, r2t, dtype, D**-0.5, tc)
            except Exception as e:  # noqa: BLE001 - keep our figures
                log(f"flashinfer (tensor cores {tc}) failed: {e!r}"[:300])
                fns = None
            if fns is not None:
                kernels["flashinfer" + ("_tc" if tc else "")] = (None, fns)
        for kname, (o, fns) in kernels.items():
            def all_layers(fns=fns):
                for f in fns:
                    f()
            dt = statistics.median(cuda_time(all_layers, 10, 3)) / n_layers
            out = fns[0]() if o is None else (fns[0](), o)[1]
            outs[kname] = out.float().clone()
            err = (outs[kname] - outs["ours"]).abs().max().item() if kname != "ours" else 0.0
            res[f"{lname}_{kname}"] = {"time_s": dt, "Bps": nbytes / dt, "max_abs_diff_vs_ours": err}
            log(f"attn_layout {lname:12s} {kname:14s}: {dt * 1e6:7.1f} us/layer = {nbytes / dt / 1e12:.2f} TB/s"
                f" (max |diff| vs ours {err:.2e})")
    RESULT["attn_layout"] = {"bs": bs, "ctx": ctx, "prompt": prompt, "splits": splits, "runs": res}
    del kv
    torch.cuda.empty_cache()


@section("engine_trace")
def bench_engine_trace(eng, vocab: int):
    """GPU timeline of the engine's own decode loop (CUDA kernels and copies from the profiler, scheduler and
    graph replays as in serving) at batch 1 and 64, 1k context: per decode step, kernel time by kernel, the
    time the GPU sits idle, and the largest idle gaps with the kernels around them. The traces go to $OUT."""
    from torch.profiler import ProfilerActivity, profile

    out_dir = os.path.dirname(OUT_PATH)
    g = torch.Generator().manual_seed(13)
    res = {}
    for bs, steps in ((1, 48), (64, 24)):
        prompts = [rand_ids(1024, g, vocab) for _ in range(bs)]
        sp = {"max_new_tokens": steps, "ignore_eos": True, "temperature": 0}
        eng.flush_cache()
        eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=4))  # warm
        eng.flush_cache()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params=sp)
            wall = time.perf_counter() - t0
        path = os.path.join(out_dir, f"engine_trace_bs{bs}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            evs = [e for e in json.load(f)["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        import gzip

        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
            z.write(f.read())
        os.remove(path)
        evs.sort(key=lambda e: e["ts"])
        attn = [e for e in evs if "decode_stage1" in e["name"]]
        layers = MODELS[RESULT["model"]]["config"]["num_hidden_layers"]
        n_steps = len(attn) // layers
        if n_steps < 3:
            log(f"engine_trace bs={bs}: only {len(attn)} decode attention kernels seen")
            continue
        # The window: from the first decode step's first attention kernel to the last step's (whole steps).
        t_lo, t_hi = attn[0]["ts"], attn[(n_steps - 1) * layers]["ts"]
        win = [e for e in evs if t_lo <= e["ts"] < t_hi]
        busy, end, gaps = 0.0, t_lo, []
        prev = None
        for e in win:
            s, f_ = e["ts"], e["ts"] + e["dur"]
            if s > end:
                gaps.append((s - end, prev["name"][:60] if prev else "", e["name"][:60]))
            busy += max(0.0, f_ - max(s, end))
            if f_ > end:
                end, prev = f_, e
        span = t_hi - t_lo
        per = n_steps - 1
        by_name: dict = {}
        for e in win:
            k = e["name"][:70]
            c, tt = by_name.get(k, (0, 0.0))
            by_name[k] = (c + 1, tt + e["dur"])
        top = sorted(by_name.items(), key=lambda kv_: -kv_[1][1])
        gaps.sort(reverse=True)
        big = sum(gp for gp, *_ in gaps if gp >= 5)
        log(f"engine_trace bs={bs}: {per} steps, {span / per / 1e3:.3f} ms/step, GPU busy {busy / per / 1e3:.3f} "
            f"ms/step, idle {(span - busy) / per / 1e3:.3f} ms/step ({big / per / 1e3:.3f} in gaps >= 5 us); "
            f"generate wall {wall:.2f} s")
        for k, (c, tt) in top[:16]:
            log(f"   {tt / per / 1e3:8.3f} ms/step {c / per:6.1f}x  {k}")
        for gp, a, b_ in gaps[:8]:
            log(f"   gap {gp:8.1f} us after {a} before {b_}")
        res[f"bs{bs}"] = {"steps": per, "step_ms": span / per / 1e3, "busy_ms": busy / per / 1e3,
                          "idle_ms": (span - busy) / per / 1e3, "idle_in_gaps_ge5us_ms": big / per / 1e3,
                          "kernels": [[k, c / per, tt / per / 1e3] for k, (c, tt) in top[:30]],
                          "largest_gaps_us": gaps[:20], "trace": path + ".gz"}
    eng.flush_cache()
    RESULT["engine_trace"] = res


@section("gemv_sweep")
def bench_gemv_sweep(name: str):
    """Single-row linears (decode at batch 1): cuBLAS vs the Triton GEMV, weights rotated past the L2."""
    import torch.nn.functional as F

    from sglang_backend.runtime.layers.attention.triton_ops.gemv import gemv

    cfg = MODELS[name]["config"]
    dtype = getattr(torch, MODELS[name]["dtype"])
    h, i, H, Hkv, V = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["vocab_size"])
    D = h // H
    shapes = {"qkv": ((H + 2 * Hkv) * D, h), "o": (h, H * D), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (V, h)}
    configs = [(8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3), (32, 256, 8, 3), (4, 1024, 4, 3), (16, 256, 4, 2),
               (32, 128, 4, 3), (64, 128, 8, 3), (8, 1024, 8, 2)]
    res = {}
    for sname, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(3)]
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        j = [0]

        def run(f):
            def g():
                f(ws[j[0] % 3])
                j[0] += 1
            return g

        nbytes = n * k * x.element_size()
        row = {"cublas": nbytes / statistics.median(cuda_time(run(lambda w: F.linear(x, w)), 30, 5))}
        for c in configs:
            try:
                row[str(c)] = nbytes / statistics.median(cuda_time(run(lambda w: gemv(x, w, config=c)), 30, 5))
            except Exception as e:  # noqa: BLE001
                log(f"gemv {c} failed: {e!r}"[:200])
        best = max((kk for kk in row if kk != "cublas"), key=lambda kk: row[kk])
        log(f"gemv {sname} {n}x{k}: cublas {row['cublas'] / 1e12:.2f} TB/s; best triton {best} "
            f"{row[best] / 1e12:.2f} TB/s")
        res[sname] = row
        del ws
    RESULT["gemv_sweep"] = res


@section("profile")
def bench_profile(eng):
    """Per-kernel GPU time of one eager decode step (bs 1 and 64, 1k context)."""
    from torch.profiler import ProfilerActivity, profile

    from sglang_backend.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

    mr = eng.scheduler.model_runner
    eng.flush_cache()
    _random_kv(mr)
    out = {}
    for bs in (1, 64):
        ctx = 1024
        rows, slots, per = _alloc_requests(mr, [ctx] * bs)
        fb = ForwardBatch(ForwardMode.DECODE, torch.randint(3, 1000, (bs,), device="cuda"),
                          torch.full((bs,), ctx - 1, device="cuda"), torch.stack([p[-1] for p in per]),
                          torch.tensor(rows, device="cuda"), torch.full((bs,), ctx, device="cuda"), [ctx] * bs,
                          logits_indices=torch.arange(bs, device="cuda"),
                          shared_first_slot=mr.req_to_token_pool.same_first_slot(rows))
        gr = mr.graph_runner
        mr.graph_runner = None
        try:
            for _ in range(3):
                mr.forward(fb)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    mr.forward(fb)
                torch.cuda.synchronize()
        finally:
            mr.graph_runner = gr
        rows_out = []
        for ev in prof.key_averages():
            dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if dt <= 0:
                continue
            rows_out.append((ev.key[:90], ev.count / 5, dt / 5))
        rows_out.sort(key=lambda r: -r[2])
        total = sum(r[2] for r in rows_out)
        log(f"-- eager decode bs={bs}: kernel time per step {total / 1e3:.3f} ms")
        for k, c, t in rows_out[:14]:
            log(f"{t / 1e3:8.3f} ms  {c:6.0f}x  {t / max(c, 1):8.1f} us  {k}")
        out[f"bs{bs}"] = {"kernel_ms_per_step": total / 1e3, "top": rows_out[:20]}
        _free_requests(mr, rows, slots)
    RESULT["profile"] = out


def table(name: str) -> str:
    o, hf, c = RESULT.get("ours", {}), RESULT.get("hf", {}), RESULT.get("ceilings", {})
    rows = []

    def ms(x):
        return f"{x * 1e3:.2f} ms" if x else "-"

    for bs in (1, 64):
        d = o.get(f"decode_bs{bs}")
        if d:
            rows.append([f"decode step bs={bs} ctx=1k (graph)", ms(d["step_s"]), f"floor {ms(d['floor_s'])}",
                         f"{d['ratio_to_floor']:.3f}x floor",
                         f"eager {ms(d.get('step_eager_s'))}; synced {ms(d['step_synced_s'])}; "
                         f"engine {ms(o.get(f'engine_decode_step_bs{bs}_s'))}; HF {ms(hf.get(f'decode_step_bs{bs}_s'))}"])
    p = o.get("prefill_8x1024")
    if p:
        rows.append(["prefill 8x1024", ms(p["time_s"]), f"{p['achieved_flops'] / 1e12:.0f} TFLOP/s",
                     f"{(p['fraction_of_matmul_rate'] or 0) * 100:.0f}% of matmul",
                     f"matmul {(p['matmul_rate'] or 0) / 1e12:.0f} TFLOP/s"])
    for key, label in (("shared_prefix", "shared prefix (radix on)"), ("shared_prefix_no_radix", "shared prefix (radix off)"),
                       ("shared_prefix_patched", "shared prefix + sched patch")):
        s = o.get(key)
        if s:
            hfr = hf.get("shared_prefix_req_per_s")
            rows.append([label, f"{s['req_per_s']:.1f} req/s", f"HF bs32 {hfr:.1f} req/s" if hfr else "HF -",
                         f"{s['req_per_s'] / hfr:.1f}x HF" if hfr else "-", f"{s['time_s']:.2f} s"])
    rs = o.get("runner_shared")
    if rs:
        rows.append([f"decode bs={rs['bs']} shared 1k prefix (cascade)", ms(rs["shared"]),
                     f"private prefixes {ms(rs['private'])}", f"{rs['private'] / rs['shared']:.2f}x faster",
                     f"floor shared {ms(rs.get('floor_shared_s'))}, private {ms(rs.get('floor_private_s'))}"])
    for key, label in (("offline_1k_1k", "offline 1k in / 1k out"),
                       ("offline_1k_1k_no_overlap", "1k/1k, overlap off"),
                       ("offline_1k_1k_no_pdl", "1k/1k, PDL off"),
                       ("offline_1k_1k_patched", "1k/1k + sched patch")):
        f = o.get(key)
        if f:
            rows.append([label, f"{f['output_tok_per_s']:.0f} tok/s", f"{f['num_requests']} requests",
                         f"{f['time_s']:.1f} s", f"retractions {f['retractions']}"])
    for key in sorted(k for k in o if k.startswith("decode_bs") and k.count("_") >= 2):
        d = o[key]
        rows.append([f"  variant {key[len('decode_'):]}", ms(d["step_s"]), f"floor {ms(d['floor_s'])}",
                     f"{d['ratio_to_floor']:.3f}x floor", f"synced {ms(d['step_synced_s'])}"])
    for bs in (1, 64):
        e = o.get(f"engine_decode_step_bs{bs}_s_no_pdl")
        if e:
            rows.append([f"engine decode bs={bs}, PDL off", ms(e), f"default {ms(o.get(f'engine_decode_step_bs{bs}_s'))}",
                         "-", "whole engine loop per step"])
    for bs in (1, 64):
        e = o.get(f"engine_decode_step_bs{bs}_s_no_overlap")
        if e:
            rows.append([f"engine decode bs={bs}, overlap off", ms(e), f"overlap on {ms(o.get(f'engine_decode_step_bs{bs}_s'))}",
                         "-", "whole engine loop per step"])
    for bs in (1, 64):
        e = o.get(f"engine_decode_step_bs{bs}_s_patched")
        if e:
            rows.append([f"engine decode bs={bs} + sched patch", ms(e), f"unpatched {ms(o.get(f'engine_decode_step_bs{bs}_s'))}",
                         "-", "whole engine loop per step"])
    head = f"{name} on {RESULT.get('env', {}).get('device')}: copy {c.get('copy_bw_Bps', 0) / 1e12:.2f} TB/s"
    return head + "\n" + format_table(["figure", "ours", "reference", "ratio", "notes"], rows)


def main(argv=None):
    global OUT_PATH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b", choices=sorted(MODELS))
    ap.add_argument("--only", default="ceilings,correctness,hf,runner,engine_decode,shared,offline,no_radix",
                    help="comma-separated sections")
    ap.add_argument("--hf-parts", default="decode,shared")
    ap.add_argument("--offline-max-requests", type=int, default=64)
    ap.add_argument("--mem-fraction-static", type=float, default=0.9)
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model = "tiny"
    name = args.model
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    OUT_PATH = args.output or os.path.join(out_dir, f"gpu_{name.replace('-', '_')}.json")
    if not torch.cuda.is_available():
        log("bench_gpu needs a CUDA GPU")
        return 1
    only = set(args.only.split(","))
    spec = MODELS[name]
    RESULT.update({"benchmark": "gpu", "model": name, "dtype": spec["dtype"], "config": spec["config"],
                   "env": env_info(), "argv": sys.argv[1:]})
    try:
        import triton

        RESULT["env"]["triton"] = triton.__version__
    except ImportError:
        pass
    dtype_bytes = torch.tensor([], dtype=getattr(torch, spec["dtype"])).element_size()
    mb = model_bytes(spec["config"], dtype_bytes)
    RESULT["model_bytes"] = mb
    vocab = spec["config"]["vocab_size"]
    if "ceilings" in only:
        ceilings(spec["dtype"])
    if "correctness" in only:
        bench_correctness()
    if "pdl_probe" in only:
        bench_pdl_probe()
    if "attn_sweep" in only:
        bench_attn_sweep(name)
    if "attn_layout" in only:
        bench_attn_layout(name)
    if "gemv_sweep" in only:
        bench_gemv_sweep(name)
    if "hf" in only:
        bench_hf(name, args)
    model_dir = make_model_dir(name)
    if only & {"runner", "gemv_step_sweep", "runner_shared", "engine_decode", "engine_trace", "shared", "offline", "profile",
                "cpu_profile"}:
        eng = make_engine(model_dir, spec["dtype"], mem_fraction_static=args.mem_fraction_static)
        RESULT["engine"] = {"max_total_num_tokens": eng.scheduler.model_runner.max_total_num_tokens,
                            "capture_bs": getattr(eng.scheduler.model_runner.graph_runner, "capture_bs", None)}
        if "profile" in only:
            bench_profile(eng)
        if "gemv_step_sweep" in only:  # first: the runner's figures then use the winners
            bench_gemv_step_sweep(eng, mb)
        if "runner" in only:
            bench_runner(eng, mb, name)
        if "runner_shared" in only:
            bench_runner_shared(eng, mb)
        if "engine_decode" in only:
            bench_engine_decode(eng, vocab)
        if "engine_trace" in only:
            bench_engine_trace(eng, vocab)
        if "cpu_profile" in only:
            bench_cpu_profile(eng, vocab)
        if "shared" in only:
            bench_shared(eng, vocab, "shared_prefix")
        if "offline" in only:
            bench_offline(eng, vocab, args.offline_max_requests)
        close_engine(eng)
        eng = None
        gc.collect()
        torch.cuda.empty_cache()
    if "no_overlap" in only:  # ablation: the synchronous scheduler loop
        eng = make_engine(model_dir, spec["dtype"], mem_fraction_static=args.mem_fraction_static,
                          disable_overlap_schedule=True)
        bench_engine_decode(eng, vocab, "_no_overlap")
        bench_offline(eng, vocab, args.offline_max_requests, "offline_1k_1k_no_overlap")
        close_engine(eng)
        eng = None
        gc.collect()
        torch.cuda.empty_cache()
    if "no_pdl" in only:  # ablation: no programmatic dependent launch (on by default on sm90+)
        from sglang_backend.runtime.layers.attention.triton_ops import pdl

        pdl.set_enabled(False)
        eng = make_engine(model_dir, spec["dtype"], mem_fraction_static=args.mem_fraction_static)
        bench_engine_decode(eng, vocab, "_no_pdl")
        bench_offline(eng, vocab, args.offline_max_requests, "offline_1k_1k_no_pdl")
        close_engine(eng)
        pdl.set_enabled(None)
        eng = None
        gc.collect()
        torch.cuda.empty_cache()
    if "no_radix" in only:
        eng = make_engine(model_dir, spec["dtype"], mem_fraction_static=args.mem_fraction_static,
                          disable_radix_cache=True)
        bench_shared(eng, vocab, "shared_prefix_no_radix")
        close_engine(eng)
        eng = None
    save()
    log(table(name))
    log(f"results: {OUT_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
