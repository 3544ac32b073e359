"""Kernel-level sections, no engine: kernel errors vs float64 references (correctness), whether programmatic
dependent launch shortens the gaps between dependent kernels (pdl_probe), decode-attention launch configs
(attn_sweep, whose winners the engines made afterwards load), decode attention over the engine's KV layout vs
FlashInfer (attn_layout), and cuBLAS vs the Triton GEMV for single-row linears (gemv_sweep)."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.gpu.common import MODELS, PATHS, RESULT, TUNED, cuda_time, graph_time, head_dim, log, section
from benchmarks.gpu.kernel_checks import check_decode, check_decode_cascade, check_extend, check_fp8, check_fused_ops
from sglang_backend.runtime.layers.kernel_options import KernelConfigs, load_kernel_configs


def attn_shape(name: str):
    """(dtype, query heads, KV heads, head dim) of the model."""
    cfg = MODELS[name]["config"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return getattr(torch, MODELS[name]["dtype"]), H, Hkv, head_dim(cfg)


# correctness --------------------------------------------------------------------------------------------------------
@section("correctness")
def bench_correctness():
    """Worst relative error of the kernels vs float64 references on fresh random inputs (recorded in the JSON):
    a fresh seed each run, so that runs together cover more inputs than the unit tests' fixed ones."""
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
        if torch.cuda.get_device_capability() >= (8, 9):  # FP8 GEMMs: Ada, Hopper
            res[f"{dn}_fp8"] = check_fp8("cuda", dtype, hidden=4096, inter=14336, num_heads=32, num_kv_heads=8,
                                         head_dim=128, seed=rng.randint(0, 1 << 30))
    RESULT["kernel_errors"] = res
    for k, v in res.items():
        log(k, {a: f"{b:.2e}" for a, b in v.items()})


# pdl_probe ----------------------------------------------------------------------------------------------------------
@section("pdl_probe")
def bench_pdl_probe():
    """Does programmatic dependent launch shorten the gaps between dependent kernels here? A chain of 64
    dependent 4096x4096 GEMVs (8 weights rotated: 268 MB, past the L2), timed eager and as a CUDA graph, with
    and without PDL: per-GEMV time and bandwidth."""
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_ops.gemv import gemv

    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.float16) / 64 for _ in range(8)]
    x0 = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    n = 64

    res = {}
    for use_pdl in (False, True):
        def chain(use_pdl=use_pdl):
            x = x0
            for i in range(n):
                x = gemv(x, ws[i % len(ws)], pdl=use_pdl)
            return x

        eager = statistics.median(cuda_time(chain, 10, 3)) / n
        graph = graph_time([chain]) / n
        tag = "pdl" if use_pdl else "nopdl"
        res[tag] = {"eager_us": eager * 1e6, "graph_us": graph * 1e6, "graph_Bps": ws[0].nbytes / graph}
        log(f"pdl_probe {tag}: eager {eager * 1e6:.2f} us, graph {graph * 1e6:.2f} us per 4096x4096 GEMV "
            f"({ws[0].nbytes / graph / 1e12:.2f} TB/s)")
    RESULT["pdl_probe"] = res


# attn_sweep ---------------------------------------------------------------------------------------------------------
# (batch, layers' KV rotated, contexts, split counts, configs (BLOCK_N, warps, stages, head_fastest)). Batch 1
# around its known winners (many short splits on few warps); large batches at 1k and 2k context (offline 1k in /
# 1k out decodes at 1-2k), ranked by the sum over both.
# Split counts None: the one the engine uses at that batch size (from target_programs_per_sm, which the batch-1
# sweep before it sets), so the large-batch config is judged as it will run.
ATTN_SWEEP = (
    (1, 8, (1024,), (16, 32), [(bn, w, st, True) for bn in (32, 64, 128) for w in (2, 4) for st in (1, 2)]),
    (64, 2, (1024, 2048), None, [(bn, w, st, hf) for bn in (32, 64, 128) for w in (4, 8) for st in (1, 2, 3)
                                 for hf in (True, False)]),
)


def sweep_context(da, name: str, bs: int, n_layers: int, ctx: int, splits_list, configs, counters, res: list):
    """Time every (split count, config) at one batch size and context; append the runs to ``res``."""
    dtype, H, Hkv, D = attn_shape(name)
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


def rank_runs(res: list, bs: int, contexts) -> list[dict]:
    """The (split count, config) pairs measured at every context of ``bs``, fastest first by the summed time."""
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
    return best


@section("attn_sweep")
def bench_attn_sweep(name: str):
    """Decode attention alone (batch 1 at 1k context, 64 at 1k and 2k) over launch configs and split counts,
    timed in CUDA graphs with the KV of several layers rotated (so nothing is served from L2), the merge of the
    splits folded into stage 1 as the engine runs it. The fastest small- and large-batch configs, and the
    fastest batch-1 split count (how many stage-1 programs decode aims for), go into this run's kernel-config
    file (TUNED), which the engines made afterwards load."""
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_backend import num_kv_splits
    from sglang_backend.runtime.layers.attention.triton_ops import decode_attention as da

    _, H, Hkv, _ = attn_shape(name)
    res = []
    chosen = {}
    counters = torch.zeros(64 * H, dtype=torch.int32, device="cuda")
    for bs, n_layers, contexts, splits_list, configs in ATTN_SWEEP:
        if splits_list is None:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            splits_list = (num_kv_splits(bs, Hkv, sms, TUNED.get("target_programs_per_sm",
                                                                  KernelConfigs().target_programs_per_sm)),)
        for ctx in contexts:
            sweep_context(da, name, bs, n_layers, ctx, splits_list, configs, counters, res)
        best = rank_runs(res, bs, contexts)
        size = "small" if bs == 1 else "large"
        chosen[size] = best[0]["config"]
        if bs == 1:  # the engine's split count at batch 1 becomes the winner's
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            TUNED["target_programs_per_sm"] = best[0]["splits"] * Hkv / sms
    table_key = "decode_mha" if H == Hkv else "decode_gqa"
    TUNED[table_key] = {**TUNED.get(table_key, {}), **chosen}
    with open(PATHS.kernel_config, "w") as f:
        json.dump(TUNED, f, indent=1)
    log(f"decode attention configs now {TUNED[table_key]}; target_programs_per_sm = "
        f"{TUNED['target_programs_per_sm']:.2f} (kernel config {PATHS.kernel_config})")
    RESULT["attn_sweep"] = {"runs": res, "chosen": chosen, "kernel_config": dict(TUNED),
                            "target_programs_per_sm": TUNED["target_programs_per_sm"]}


# cascade_sweep ------------------------------------------------------------------------------------------------------
# Cascade decode at the shared-prefix workload's shape (issue 23): batches of 64 and 128 requests behind one
# 1024-token prefix, each with 64-96 tokens of its own. First the prefix kernel (BLOCK_M, BLOCK_N, warps, stages)
# x programs per SM, with the per-request part as configured; then, with the prefix winner, the per-request
# part's stage-1 config (BLOCK_N, warps, stages, head_fastest), which becomes the "cascade" entry.
CASCADE_BATCHES = (64, 128)
CASCADE_PREFIX = 1024
CASCADE_OWN = (64, 96)
PREFIX_SWEEP = [(bm, bn, w, st) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for st in (2, 3)]
PREFIX_PROGRAMS_PER_SM = (1.0, 2.0, 4.0)
SUFFIX_SWEEP = [(bn, w, st, hf) for bn in (16, 32, 64) for w in (1, 2, 4) for st in (1, 2) for hf in (True, False)]


def _cascade_case(name: str, bs: int, n_layers: int, gen):
    """KV pools of n_layers layers, a request-to-slot table whose rows share the first CASCADE_PREFIX slots,
    the queries, and the sequence lengths (prefix + own tokens)."""
    dtype, H, Hkv, D = attn_shape(name)
    own = torch.randint(CASCADE_OWN[0], CASCADE_OWN[1] + 1, (bs,), generator=gen)
    n_slots = CASCADE_PREFIX + int(own.sum()) + 1
    kv = [(torch.randn(n_slots, Hkv, D, device="cuda", dtype=dtype),
           torch.randn(n_slots, Hkv, D, device="cuda", dtype=dtype)) for _ in range(n_layers)]
    width = CASCADE_PREFIX + CASCADE_OWN[1]
    r2t = torch.zeros(bs, width, dtype=torch.int64)
    r2t[:, :CASCADE_PREFIX] = torch.arange(1, CASCADE_PREFIX + 1)
    off = CASCADE_PREFIX + 1
    for b in range(bs):
        n = int(own[b])
        r2t[b, CASCADE_PREFIX : CASCADE_PREFIX + n] = torch.arange(off, off + n)
        off += n
    seq = (own + CASCADE_PREFIX).to("cuda")
    q = torch.randn(bs, H, D, device="cuda", dtype=dtype)
    return kv, r2t.to("cuda"), seq, q


def _time_cascade(da, name: str, bs: int, case, config, configs: KernelConfigs, prefix_splits: int, counters):
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_backend import num_kv_splits

    dtype, H, Hkv, D = attn_shape(name)
    kv, r2t, seq, q = case
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_kv_splits(bs, Hkv, sms, configs.target_programs_per_sm)
    rows = torch.arange(bs, device="cuda")
    prefix_len = torch.full((1,), CASCADE_PREFIX, dtype=torch.int32, device="cuda")
    o = torch.empty_like(q)
    mid_o = torch.empty(bs, H, splits + prefix_splits, D, device="cuda", dtype=torch.float32)
    mid_lse = torch.empty(bs, H, splits + prefix_splits, device="cuda", dtype=torch.float32)
    fns = [(lambda k=k, v=v: da.decode_attention_fwd(
        q, k, v, o, r2t, rows, seq, mid_o, mid_lse, splits, D**-0.5, config, prefix_len=prefix_len,
        prefix_splits=prefix_splits, merge_counters=counters, configs=configs)) for k, v in kv]
    return graph_time(fns)


def _cascade_ok(name: str, config, configs: KernelConfigs, prefix_splits: int, seed: int) -> bool:
    """The candidate against the float64 reference on a small fresh cascade batch before it is timed."""
    dtype, H, Hkv, D = attn_shape(name)
    gen = random.Random(seed)
    seq_lens = [300 + gen.randint(1, 150) for _ in range(12)]
    err = check_decode_cascade("cuda", dtype, H, Hkv, D, seq_lens, 300, 1, prefix_splits, seed=seed,
                               fused_merge=True, config=config, configs=configs)
    if err >= 2e-2:
        log(f"cascade config {config} / {configs.decode_prefix} x{prefix_splits}: error {err:.2e}, skipped")
    return err < 2e-2


@section("cascade_sweep")
def bench_cascade_sweep(name: str):
    """Cascade decode launch configs at the shared-prefix shape (see CASCADE_BATCHES): each candidate is checked
    against the float64 reference on a fresh random batch, then timed in CUDA graphs over several layers' KV;
    the winners (summed over the batch sizes) go into this run's kernel-config file like attn_sweep's."""
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_backend import prefix_splits_for
    from sglang_backend.runtime.layers.attention.triton_ops import decode_attention as da

    _, H, Hkv, _ = attn_shape(name)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = KernelConfigs.from_json(dict(TUNED)) if TUNED else load_kernel_configs("cuda")
    gen = torch.Generator().manual_seed(17)
    cases = {bs: _cascade_case(name, bs, 3, gen) for bs in CASCADE_BATCHES}
    counters = torch.zeros(max(CASCADE_BATCHES) * H, dtype=torch.int32, device="cuda")
    seed = int(time.time())
    runs = []

    def measure(config, configs):
        total = 0.0
        for bs in CASCADE_BATCHES:
            ps = prefix_splits_for(bs, H, Hkv, sms, configs)
            if not _cascade_ok(name, config, configs, ps, seed + len(runs)):
                return None
            total += _time_cascade(da, name, bs, cases[bs], config, configs, ps, counters)
        runs.append({"prefix": list(configs.decode_prefix), "prefix_programs_per_sm": configs.prefix_programs_per_sm,
                     "stage1": list(config or configs.decode_config(H == Hkv, 64, cascade=True)), "time_s": total})
        return total

    base_time = measure(None, base)
    best = (base_time, base)
    for pc in PREFIX_SWEEP:
        for pp in PREFIX_PROGRAMS_PER_SM:
            cand = dataclasses.replace(base, decode_prefix=pc, prefix_programs_per_sm=pp)
            try:
                t = measure(None, cand)
            except Exception as e:  # noqa: BLE001 - a config may not compile (shared memory)
                log(f"prefix config {pc} failed: {e!r}"[:200])
                continue
            if t is not None and t < best[0]:
                best = (t, cand)
    prefix_time, winner = best
    best_stage1 = (prefix_time, None)
    for c in SUFFIX_SWEEP:
        try:
            t = measure(c, winner)
        except Exception as e:  # noqa: BLE001
            log(f"stage-1 config {c} failed: {e!r}"[:200])
            continue
        if t is not None and t < best_stage1[0]:
            best_stage1 = (t, c)
    table_key = "decode_mha" if H == Hkv else "decode_gqa"
    TUNED.update({k: v for k, v in base.to_json().items() if k not in TUNED})
    TUNED["decode_prefix"] = list(winner.decode_prefix)
    TUNED["prefix_programs_per_sm"] = winner.prefix_programs_per_sm
    if best_stage1[1] is not None:
        TUNED[table_key] = {**TUNED.get(table_key, {}), "cascade": list(best_stage1[1])}
    with open(PATHS.kernel_config, "w") as f:
        json.dump(TUNED, f, indent=1)
    n = len(CASCADE_BATCHES)
    log(f"cascade_sweep (batches {CASCADE_BATCHES}, mean per layer): as configured {base_time / n * 1e6:.1f} us; "
        f"prefix {list(winner.decode_prefix)} x {winner.prefix_programs_per_sm} per SM {prefix_time / n * 1e6:.1f} us; "
        f"stage 1 {best_stage1[1]} {best_stage1[0] / n * 1e6:.1f} us")
    for r in sorted(runs, key=lambda r: r["time_s"])[:6]:
        log(f"   {r['time_s'] / n * 1e6:7.1f} us  prefix {r['prefix']} x {r['prefix_programs_per_sm']}  "
            f"stage 1 {r['stage1']}")
    RESULT["cascade_sweep"] = {"batches": list(CASCADE_BATCHES), "prefix": CASCADE_PREFIX, "own": list(CASCADE_OWN),
                               "as_configured_s": base_time, "best_s": best_stage1[0], "runs": runs,
                               "kernel_config": dict(TUNED)}


# attn_layout --------------------------------------------------------------------------------------------------------
def _flashinfer_decode(q, kv, r2t, dtype, sm_scale, tensor_cores: bool):
    """A FlashInfer paged decode over the same pool (one-token pages), planned once; None without the package."""
    try:
        import flashinfer  # optional dependency: the comparison is skipped without it
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


def kv_layouts(bs: int, ctx: int, prompt: int) -> dict:
    """Request-to-slot tables: every request's slots consecutive, and the engine's (prompt consecutive, then
    one slot per request per decode step, interleaved across the batch)."""
    layouts = {"consecutive": (torch.arange(bs * ctx, device="cuda") + 1).view(bs, ctx)}
    t = torch.arange(ctx, device="cuda")
    b = torch.arange(bs, device="cuda")[:, None]
    layouts["engine"] = torch.where(t < prompt, 1 + b * prompt + t, 1 + bs * prompt + (t - prompt) * bs + b)
    return layouts


def layout_kernels(ours, q, kv, r2t, dtype, sm_scale) -> dict:
    """name -> (output tensor or None when the call returns it, per-layer callables): ours, then FlashInfer's
    decode without and with tensor cores where it runs."""
    kernels = {"ours": ours}
    for tc in (False, True):
        try:
            fns = _flashinfer_decode(q, kv, r2t, dtype, sm_scale, tc)
        except Exception as e:  # noqa: BLE001 - keep our figures
            log(f"flashinfer (tensor cores {tc}) failed: {e!r}"[:300])
            fns = None
        if fns is not None:
            kernels["flashinfer" + ("_tc" if tc else "")] = (None, fns)
    return kernels


def time_layout_kernels(lname: str, kernels: dict, n_layers: int, nbytes: int, res: dict):
    """Eager time per layer of each kernel (layers rotated) and its largest difference from ours."""
    outs = {}
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


@section("attn_layout")
def bench_attn_layout(name: str):
    """Decode attention at the offline 1k/1k shape (batch 56, 1.5k context) as the engine lays its KV out: the
    1024 prompt tokens of each request in consecutive slots, the decoded ones interleaved across the batch (each
    step allocates one slot per request), vs every request's slots consecutive (what attn_sweep times). Our
    kernel and FlashInfer's decode (when installed, with and without tensor cores) over the same pool, all eager
    with 4 layers' KV rotated; outputs compared with ours."""
    # Need triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention import triton_backend as tb
    from sglang_backend.runtime.layers.attention.triton_ops import decode_attention as da

    dtype, H, Hkv, D = attn_shape(name)
    bs, ctx, prompt, n_layers = 56, 1536, 1024, 4
    n_slots = bs * ctx + 1
    kv = [(torch.randn(n_slots, Hkv, D, device="cuda", dtype=dtype),
           torch.randn(n_slots, Hkv, D, device="cuda", dtype=dtype)) for _ in range(n_layers)]
    rows = torch.arange(bs, device="cuda")
    seq = torch.full((bs,), ctx, device="cuda")
    q = torch.randn(bs, H, D, device="cuda", dtype=dtype)
    nbytes = 2 * bs * ctx * Hkv * D * q.element_size()
    counters = torch.zeros(bs * H, dtype=torch.int32, device="cuda")
    # The engine's split count and scratch for this batch size (no cascade: nothing is shared).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = KernelConfigs.from_json(TUNED) if TUNED else load_kernel_configs("cuda")
    # one stage-1 program per (request, KV head, split)
    splits = tb.num_kv_splits(bs, Hkv, sms, configs.target_programs_per_sm)
    mid_o = torch.empty(bs, H, splits, D, device="cuda", dtype=torch.float32)
    mid_lse = torch.empty(bs, H, splits, device="cuda", dtype=torch.float32)
    res = {}
    for lname, r2t in kv_layouts(bs, ctx, prompt).items():
        o = torch.empty_like(q)
        ours = (o, [(lambda k=k, v=v: da.decode_attention_fwd(
            q, k, v, o, r2t, rows, seq, mid_o, mid_lse, splits, D**-0.5, merge_counters=counters,
            configs=configs)) for k, v in kv])
        time_layout_kernels(lname, layout_kernels(ours, q, kv, r2t, dtype, D**-0.5), n_layers, nbytes, res)
    RESULT["attn_layout"] = {"bs": bs, "ctx": ctx, "prompt": prompt, "splits": splits, "runs": res}
    del kv
    torch.cuda.empty_cache()


# gemv_sweep ---------------------------------------------------------------------------------------------------------
GEMV_CONFIGS = [(8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3), (32, 256, 8, 3), (4, 1024, 4, 3), (16, 256, 4, 2),
                (32, 128, 4, 3), (64, 128, 8, 3), (8, 1024, 8, 2)]


def gemv_shape_row(gemv, n: int, k: int, dtype) -> dict:
    """Bytes per second of cuBLAS and of each Triton GEMV config for one (n, k) weight (3 weights rotated)."""
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
    for c in GEMV_CONFIGS:
        try:
            row[str(c)] = nbytes / statistics.median(cuda_time(run(lambda w: gemv(x, w, config=c)), 30, 5))
        except Exception as e:  # noqa: BLE001
            log(f"gemv {c} failed: {e!r}"[:200])
    del ws
    return row


@section("gemv_sweep")
def bench_gemv_sweep(name: str):
    """Single-row linears (decode at batch 1): cuBLAS vs the Triton GEMV, weights rotated past the L2."""
    # Needs triton: deferred so that this module imports without it.
    from sglang_backend.runtime.layers.attention.triton_ops.gemv import gemv

    cfg = MODELS[name]["config"]
    dtype = getattr(torch, MODELS[name]["dtype"])
    h, i, H, Hkv, V = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["vocab_size"])
    D = head_dim(cfg)
    shapes = {"qkv": ((H + 2 * Hkv) * D, h), "o": (h, H * D), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (V, h)}
    res = {}
    for sname, (n, k) in shapes.items():
        row = gemv_shape_row(gemv, n, k, dtype)
        best = max((kk for kk in row if kk != "cublas"), key=lambda kk: row[kk])
        log(f"gemv {sname} {n}x{k}: cublas {row['cublas'] / 1e12:.2f} TB/s; best triton {best} "
            f"{row[best] / 1e12:.2f} TB/s")
        res[sname] = row
    RESULT["gemv_sweep"] = res
