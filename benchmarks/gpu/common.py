"""What the GPU benchmark's sections share: the model shapes, the run's results and paths, logging, timing,
dummy model files, workloads, and the engine (``engine_for``) of the sections that need one."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Any, Iterator

import torch

from sglang_backend.runtime.model_loader.loader import build_dummy_tokenizer

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
    # Qwen3: head_dim 128 whatever hidden / heads is; per-head q/k RMSNorm.
    "qwen3-8b": dict(dtype="bfloat16", architecture="Qwen3ForCausalLM",
                     config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 max_position_embeddings=40960, rope_theta=1000000.0)),
    # Qwen3-30B-A3B: 128 experts of intermediate 768, 8 per token (normalised), every layer sparse.
    "qwen3-30b-a3b": dict(dtype="bfloat16", architecture="Qwen3MoeForCausalLM",
                          config=dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                      decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                                      num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                      vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0)),
}


def architecture(name: str) -> str:
    return MODELS[name].get("architecture", "LlamaForCausalLM")


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]

# The run's JSON document, written after every section (so a crash keeps the figures so far).
RESULT: dict = {}
# Tuned kernel configurations found by this run's sweeps (attn_sweep): written to a --kernel-config JSON file
# that the engines made afterwards load (see layers/kernel_options.py); copy it into
# sglang_backend/runtime/layers/attention/triton_ops/configs/<GPU name>.json to make it the device's default.
TUNED: dict = {}


@dataclasses.dataclass
class Paths:
    """Where the run writes: the results JSON and the tuned kernel-config file (set by ``main``)."""

    out: str = ""
    kernel_config: str = ""


PATHS = Paths()


@dataclasses.dataclass
class Context:
    """What a section may use: the parsed flags, the model's name, shape table entry and byte counts, and the
    engine (set only while a section that needs one runs)."""

    args: Any
    name: str
    spec: dict
    mb: dict
    eng: Any = None

    @property
    def vocab(self) -> int:
        return self.spec["config"]["vocab_size"]


def log(*a):
    print(*a, flush=True)


def save():
    os.makedirs(os.path.dirname(PATHS.out), exist_ok=True)
    with open(PATHS.out, "w") as f:
        json.dump(RESULT, f, indent=2, default=str)


def section(name):
    """Record the function's outcome and duration under RESULT["sections"][name] and save the JSON; an exception
    is printed and recorded, not raised, so that the other sections still run."""

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


# Timing -------------------------------------------------------------------------------------------------------------
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



# Model files --------------------------------------------------------------------------------------------------------
def make_model_dir(name: str) -> str:
    """A directory with the config (the architecture and shape of ``MODELS[name]``, built with transformers' own
    config class) and a dummy tokenizer; the engines load it with dummy weights."""
    # Deferred heavy import (transformers takes seconds): only the engine sections need it.
    import transformers

    spec = MODELS[name]
    arch = architecture(name)
    d = os.path.join(tempfile.gettempdir(), f"sglb_bench_{name}")
    os.makedirs(d, exist_ok=True)
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = config_class(**spec["config"], rms_norm_eps=1e-6 if "Qwen" in arch else 1e-5, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = [arch]
    cfg.save_pretrained(d)
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        build_dummy_tokenizer(cfg.vocab_size).save_pretrained(d)
    return d


def model_bytes(cfg, dtype_bytes: int, linear_bytes: int | None = None) -> dict:
    """Parameter and byte counts behind the bandwidth floor (weights + KV read per decode step) and the prefill
    FLOP count. A mixture of experts counts the experts a token runs (``matmul_params``, ``weight_bytes`` at
    batch 1); ``weight_bytes_at`` gives the bytes at a batch, with the experts a random routing touches.
    ``linear_bytes``: bytes per weight of the decoder's dense linear layers (1 with FP8; the embedding, LM head,
    norms, router and experts keep ``dtype_bytes``)."""
    h, i, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = head_dim(cfg)
    attn_linear = h * (H + 2 * Hkv) * d + H * d * h  # qkv and o projections
    attn = attn_linear + 2 * h + (2 * d if "head_dim" in cfg else 0)  # + norms
    experts, top_k = cfg.get("num_experts", 0), cfg.get("num_experts_per_tok", 0)
    expert_params = 3 * h * cfg["moe_intermediate_size"] if experts else 0
    mlp = h * experts + top_k * expert_params if experts else 3 * h * i  # router + the experts a token runs
    per_layer = attn + mlp
    linear_params = L * per_layer + V * h + h  # layers + lm_head + final norm (the embedding is only gathered)
    kv_per_token = 2 * L * Hkv * d * dtype_bytes
    dense_linear = L * (attn_linear + (0 if experts else mlp))
    weight_bytes = linear_params * dtype_bytes - dense_linear * (dtype_bytes - (linear_bytes or dtype_bytes))
    return {"read_params": linear_params, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
            "matmul_params": L * (per_layer - 2 * h), "lm_head_params": V * h, "layers": L, "heads": H, "head_dim": d,
            "experts": experts, "top_k": top_k, "expert_bytes": expert_params * dtype_bytes}


def weight_bytes_at(mb: dict, batch: int) -> float:
    """Weight bytes one decode step reads at ``batch`` requests: all of a dense model; for a mixture of experts
    the dense part plus the experts that ``batch`` tokens routed uniformly at random touch on average,
    E * (1 - (1 - k/E)^batch) per layer."""
    if not mb.get("experts"):
        return mb["weight_bytes"]
    E, k = mb["experts"], mb["top_k"]
    dense = mb["weight_bytes"] - mb["layers"] * k * mb["expert_bytes"]
    return dense + mb["layers"] * E * (1 - (1 - k / E) ** batch) * mb["expert_bytes"]


# Workloads ----------------------------------------------------------------------------------------------------------
def rand_ids(n: int, g: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(3, min(vocab, 30000), (n,), generator=g).tolist()


def shared_prefix_prompts(seed: int, vocab: int, n=128, prefix=1024, unique=64):
    g = torch.Generator().manual_seed(seed)
    p = rand_ids(prefix, g, vocab)
    return [p + rand_ids(unique, g, vocab) for _ in range(n)]


# Engines ------------------------------------------------------------------------------------------------------------
def make_engine(model_dir: str, dtype: str, **kw):
    """Our engine on the GPU with dummy weights and triton attention; it loads this run's tuned kernel configs
    when a sweep has found some."""
    # Deferred heavy import (the whole runtime): the sections without an engine never load it.
    from sglang_backend import Engine

    t0 = time.perf_counter()
    if TUNED:
        kw.setdefault("kernel_config", PATHS.kernel_config)
    kw.setdefault("attention_backend", "triton")
    eng = Engine(model_path=model_dir, load_format="dummy", dtype=dtype, device="cuda", log_level="warning", **kw)
    mr = eng.scheduler.model_runner
    log(f"engine up in {time.perf_counter() - t0:.1f} s; KV pool {mr.max_total_num_tokens} tokens; "
        f"graphs {getattr(mr.graph_runner, 'capture_bs', None)}")
    return eng


def close_engine(eng):
    eng.shutdown()
    del eng
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def engine_for(ctx: Context, **overrides) -> Iterator[Any]:
    """An engine for ``ctx``'s model (``overrides``: extra Engine arguments, e.g. an ablation's switch), set as
    ``ctx.eng`` while the block runs and shut down after it, its GPU memory handed back before the next one."""
    eng = make_engine(make_model_dir(ctx.name), ctx.spec["dtype"], mem_fraction_static=ctx.args.mem_fraction_static,
                      quantization=getattr(ctx.args, "quantization", "none"), **overrides)
    if not overrides:  # the run's shared engine: its pool and graph sizes go into the JSON
        mr = eng.scheduler.model_runner
        RESULT["engine"] = {"max_total_num_tokens": mr.max_total_num_tokens,
                            "capture_bs": getattr(mr.graph_runner, "capture_bs", None)}
    ctx.eng = eng
    try:
        yield eng
    finally:
        ctx.eng = None
        close_engine(eng)
        eng = None
        gc.collect()
        torch.cuda.empty_cache()


# Runner-level helpers (KV slots for hand-made batches) --------------------------------------------------------------
def alloc_requests(mr, lens: list[int]):
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


def random_kv(mr):
    pool = mr.token_to_kv_pool
    for buf in pool.k_buffer + pool.v_buffer:  # random KV, never zeros
        buf.normal_()


def free_requests(mr, rows, slots):
    mr.token_to_kv_pool_allocator.free(slots)
    for r in rows:
        mr.req_to_token_pool.free(r)
