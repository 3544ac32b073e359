"""End to end on the GPU: greedy outputs with the triton backend (CUDA graphs on and off) equal the
torch_native backend's, prefix hits included, and the KV pool is whole afterwards."""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _peaked_model(tmp_path_factory, hidden_size: int, **extra) -> str:
    """A small random Llama (GQA, 8 query heads, 2 KV heads) whose logits have clear winners (larger init
    std), so greedy decoding is insensitive to rounding-level differences between attention implementations."""
    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

    out = str(tmp_path_factory.mktemp("gpu_dummy"))
    cfg = dummy_config(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048,
                       initializer_range=0.2, **extra)
    return save_dummy_hf_model(cfg, out, seed=0)


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory):  # head size 32
    return _peaked_model(tmp_path_factory, 256)


@pytest.fixture(scope="module")
def peaked_model_dir_hd64(tmp_path_factory):  # head size 64 (FlashInfer's prefill has no 32)
    return _peaked_model(tmp_path_factory, 512)


@pytest.fixture(scope="module")
def peaked_qwen3_dir(tmp_path_factory):  # per-head q/k norms before rotary
    return _peaked_model(tmp_path_factory, 256, model_type="qwen3")


def _prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 1000, (300,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 40, 130)]
    prompts += [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 17, 600)]
    return prompts


def _shared_prompts():
    """Ten requests behind one 300-token prefix: decode batches of >= 8 can run in cascade mode."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 1000, (300,), generator=g).tolist()
    return [shared + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 2, 3, 5, 9, 17, 33, 64, 100, 129)]


def _run(model_dir, dtype, prompts=None, **kwargs):
    from sglang_backend import Engine

    eng = Engine(model_path=model_dir, device="cuda", dtype=dtype, max_total_tokens=65536, max_running_requests=16,
                 check_pool_on_idle=True, log_level="warning", **kwargs)
    sp = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    try:
        prompts = prompts or _prompts()
        first = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
        first = [(r["output_ids"], r["meta_info"]["output_top_logprobs"]) for r in first]
        # Second pass: the prompts are now cached (prefix hits for every request).
        second = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=sp)]
        stats = eng.get_stats()
        stats["cascade_steps"] = getattr(eng.scheduler.model_runner.attn_backend, "num_cascade_steps", 0)
        eng.check_pool_whole()
    finally:
        eng.shutdown()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return first, second, stats


# Greedy outputs must be identical, except that in bf16 a request may part ways at a near-tie of the reference:
# its top-2 logprobs closer than this. bf16 keeps 8 mantissa bits, so logits of magnitude 8-16 (these models')
# are spaced 0.0625 apart, and another attention implementation's rounding moves them by a step or two: on an
# H100, FlashInfer (head size 64) parted from torch_native at token 29 of 32 at a gap of 0.125, two steps.
NEAR_TIE = {"float16": 0.0, "float32": 0.0, "bfloat16": 0.2}


def _same_greedy(ref, ref_top, out, dtype, what):
    for i, (a, b, tops) in enumerate(zip(ref, out, ref_top)):
        if a == b:
            continue
        j = next(k for k in range(len(a)) if a[k] != b[k])
        gap = tops[j][0][0] - tops[j][1][0]
        assert gap < NEAR_TIE[dtype], (
            f"{what}: request {i} differs from torch_native at token {j} where the reference's top-2 gap is "
            f"{gap:.4f} (not a near-tie)\n{a}\n{b}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_triton_matches_torch_native(peaked_model_dir, dtype):
    ref, ref2, _ = _run(peaked_model_dir, dtype, attention_backend="torch_native")
    tri, tri2, stats = _run(peaked_model_dir, dtype, attention_backend="triton")
    eager, eager2, _ = _run(peaked_model_dir, dtype, attention_backend="triton", disable_cuda_graph=True)
    assert stats["cache_hit_rate"] > 0.3
    ref_ids, ref_top = [r[0] for r in ref], [r[1] for r in ref]
    assert ref2 == ref_ids
    _same_greedy(ref_ids, ref_top, [r[0] for r in tri], dtype, "triton + CUDA graphs")
    _same_greedy(ref_ids, ref_top, tri2, dtype, "triton + CUDA graphs, cached prefixes")
    _same_greedy(ref_ids, ref_top, [r[0] for r in eager], dtype, "triton eager")
    _same_greedy(ref_ids, ref_top, eager2, dtype, "triton eager, cached prefixes")
    # CUDA graphs replay the same kernels as eager: identical tokens whatever the dtype.
    assert [r[0] for r in tri] == [r[0] for r in eager] or dtype == "bfloat16"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_chunk_matches_torch_native(peaked_model_dir, dtype):
    """enable_mixed_chunk: the running requests decode inside 16-token prefill chunks, as one-token extends through
    the triton extend kernel: torch_native's greedy tokens."""
    ref, _, _ = _run(peaked_model_dir, dtype, attention_backend="torch_native")
    out, out2, stats = _run(peaked_model_dir, dtype, attention_backend="triton", chunked_prefill_size=16,
                            enable_mixed_chunk=True)
    assert stats["num_mixed_batches"] > 0
    ref_ids, ref_top = [r[0] for r in ref], [r[1] for r in ref]
    _same_greedy(ref_ids, ref_top, [r[0] for r in out], dtype, "triton, mixed chunks")
    _same_greedy(ref_ids, ref_top, out2, dtype, "triton, mixed chunks, cached prefixes")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flashinfer_matches_torch_native(peaked_model_dir_hd64, peaked_model_dir, dtype):
    """--attention-backend flashinfer (needs the flashinfer-python package): prefill/append over cached
    prefixes and decode through FlashInfer's paged wrappers give torch_native's greedy tokens; a head size
    FlashInfer has no kernels for is refused with a clear error when the engine starts."""
    pytest.importorskip("flashinfer")
    ref, ref2, _ = _run(peaked_model_dir_hd64, dtype, attention_backend="torch_native")
    out, out2, stats = _run(peaked_model_dir_hd64, dtype, attention_backend="flashinfer")
    assert stats["cache_hit_rate"] > 0.3
    ref_ids, ref_top = [r[0] for r in ref], [r[1] for r in ref]
    _same_greedy(ref_ids, ref_top, [r[0] for r in out], dtype, "flashinfer")
    _same_greedy(ref_ids, ref_top, out2, dtype, "flashinfer, cached prefixes")
    with pytest.raises(ValueError, match="head sizes"):
        _run(peaked_model_dir, dtype, attention_backend="flashinfer")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fa3_matches_torch_native(peaked_model_dir_hd64, dtype):
    """--attention-backend fa3 (needs FlashAttention 3 from vLLM's wheel, Hopper): cold prompts (the contiguous
    path), prompts over cached prefixes and 16-token chunks (the paged path, one-token pages) give torch_native's
    greedy tokens, decode being the triton backend's; fp32 is refused with a clear error when the engine starts."""
    pytest.importorskip("vllm.vllm_flash_attn")
    ref, ref2, _ = _run(peaked_model_dir_hd64, dtype, attention_backend="torch_native")
    out, out2, stats = _run(peaked_model_dir_hd64, dtype, attention_backend="fa3")
    chunked, chunked2, _ = _run(peaked_model_dir_hd64, dtype, attention_backend="fa3", chunked_prefill_size=16)
    assert stats["cache_hit_rate"] > 0.3
    ref_ids, ref_top = [r[0] for r in ref], [r[1] for r in ref]
    _same_greedy(ref_ids, ref_top, [r[0] for r in out], dtype, "fa3")
    _same_greedy(ref_ids, ref_top, out2, dtype, "fa3, cached prefixes")
    _same_greedy(ref_ids, ref_top, [r[0] for r in chunked], dtype, "fa3, chunked prefill")
    _same_greedy(ref_ids, ref_top, chunked2, dtype, "fa3, chunked prefill, cached prefixes")
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        _run(peaked_model_dir_hd64, "float32", attention_backend="fa3")


def test_flashinfer_kv_page_indices():
    """The page list FlashInfer reads: each request's first seq_len slots of its req_to_token row."""
    from sglang_backend.runtime.layers.attention.flashinfer_backend import kv_page_indices

    table = (torch.arange(5 * 700, device="cuda") * 3 + 1).view(5, 700)
    lens = [1, 300, 700]
    indptr, idx = kv_page_indices(table, torch.tensor([4, 0, 2], device="cuda"), lens)
    assert indptr.tolist() == [0, 1, 301, 1001] and idx.dtype == torch.int32
    assert torch.equal(idx.cpu(), torch.cat([table[4, :1], table[0, :300], table[2, :700]]).int().cpu())


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_batch1_gemv_modes_and_pdl_match_torch_native(peaked_model_dir, dtype):
    """Decode at batch 1 (one request at a time) through cuBLAS, the Triton GEMV, the fused GEMV (norm
    prologue, SiLU-mul / residual epilogues) and the fused GEMV with rotary + KV store, each with and without
    programmatic dependent launch (--gemv-mode, --pdl)."""
    prompts = _prompts()[:1]  # a 305-token prompt: 32 decode steps at batch 1
    ref = [_run(peaked_model_dir, dtype, [p], attention_backend="torch_native")[0][0] for p in prompts]
    ref_ids, ref_top = [r[0] for r in ref], [r[1] for r in ref]
    for mode in ("off", "on", "fused", "fused_rope"):
        for use_pdl in (True, False):
            out = [_run(peaked_model_dir, dtype, [p], attention_backend="triton", gemv_mode=mode,
                        pdl="on" if use_pdl else "off")[0][0][0] for p in prompts]
            _same_greedy(ref_ids, ref_top, out, dtype, f"batch 1, gemv {mode}, pdl {use_pdl}")
    # Stage-2 merge kernel instead of the merge folded into stage 1.
    out = [_run(peaked_model_dir, dtype, [p], attention_backend="triton", attention_merge="stage2")[0][0][0]
           for p in prompts]
    _same_greedy(ref_ids, ref_top, out, dtype, "batch 1, stage-2 merge")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_qwen3_qk_norm_in_rotary_matches_torch_native(peaked_qwen3_dir, dtype):
    """Qwen3's per-head q/k norms run inside the rotary kernel (fused ops): the same greedy tokens as torch_native,
    in a batch with cached prefixes and at batch 1 through each GEMV mode (none folds rotary for Qwen3)."""
    ref, ref2, _ = _run(peaked_qwen3_dir, dtype, attention_backend="torch_native")
    ref_ids, ref_top = [r[0] for r in ref], [r[1] for r in ref]
    tri, tri2, _ = _run(peaked_qwen3_dir, dtype, attention_backend="triton")
    _same_greedy(ref_ids, ref_top, [r[0] for r in tri], dtype, "qwen3 triton batch")
    _same_greedy(ref_ids, ref_top, tri2, dtype, "qwen3 triton batch, cached prefixes")
    one = _prompts()[:1]
    for mode in ("off", "fused", "fused_rope"):
        out = _run(peaked_qwen3_dir, dtype, one, attention_backend="triton", gemv_mode=mode)[0][0][0]
        _same_greedy(ref_ids[:1], ref_top[:1], [out], dtype, f"qwen3 batch 1, gemv {mode}")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cascade_decode_matches_torch_native(peaked_model_dir, dtype):
    prompts = _shared_prompts()
    ref, ref2, _ = _run(peaked_model_dir, dtype, prompts, attention_backend="torch_native")
    ref_ids, ref_top = [r[0] for r in ref], [r[1] for r in ref]
    every = {"cascade_min_saved_reads": 0}  # cascade whenever a first slot is shared
    for kwargs in (every, {**every, "disable_cuda_graph": True}, {"disable_cascade_attention": True}, {}):
        out, out2, stats = _run(peaked_model_dir, dtype, prompts, attention_backend="triton", **kwargs)
        assert stats["cache_hit_rate"] > 0.5
        # Batches of >= 8 requests behind the shared prefix run in cascade mode when asked to; by default not: 300
        # shared tokens x 9 other requests save fewer reads (2,700) than cascade_min_saved_reads.
        assert (stats["cascade_steps"] > 0) == ("cascade_min_saved_reads" in kwargs), stats["cascade_steps"]
        _same_greedy(ref_ids, ref_top, [r[0] for r in out], dtype, f"triton {kwargs}")
        _same_greedy(ref_ids, ref_top, out2, dtype, f"triton {kwargs}, cached prefixes")


def test_overlap_schedule_matches_sync(peaked_model_dir):
    """Overlapped decode (the host work of step N during step N+1) gives the same tokens, finish reasons and
    KV accounting as the synchronous loop: mixed max_new_tokens, stop tokens hit mid-way, streaming, and
    sampling with seeds."""
    from sglang_backend import Engine

    prompts = _prompts() + _shared_prompts()

    def params(ref=None):
        out = []
        for i in range(len(prompts)):
            sp = {"max_new_tokens": [1, 2, 7, 32][i % 4], "temperature": 0}
            if i % 3 == 1:
                sp = {"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": i}
            if ref is not None and i % 5 == 2 and len(ref[i]["output_ids"]) > 4:
                sp["stop_token_ids"] = [ref[i]["output_ids"][3]]  # ends the request mid-way
            out.append(sp)
        return out

    results = {}
    for overlap in (False, True):
        eng = Engine(model_path=peaked_model_dir, device="cuda", dtype="float16", attention_backend="triton",
                     max_total_tokens=65536, max_running_requests=32, check_pool_on_idle=True, log_level="warning",
                     disable_overlap_schedule=not overlap)
        try:
            assert (eng.scheduler.overlap is not None) == overlap
            ref = eng.generate(input_ids=prompts, sampling_params=params())
            out = eng.generate(input_ids=prompts, sampling_params=params(ref))
            streamed = [c for c in eng.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 9,
                                                                                      "temperature": 0}, stream=True)]
            eng.check_pool_whole()
            results[overlap] = ([r["output_ids"] for r in ref], [r["output_ids"] for r in out],
                                [r["meta_info"]["finish_reason"] for r in out], streamed[-1]["output_ids"])
        finally:
            eng.shutdown()
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    assert results[True] == results[False]


def _extend_logits(model_dir, dtype, fused: bool):
    """Logits of a 3-request prefill through ModelRunner (triton attention), fused layer kernels on or off
    (--disable-fused-ops: the torch reference modules)."""
    from sglang_backend.runtime.model_loader.loader import load_model_assets
    from sglang_backend.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode
    from sglang_backend.runtime.model_executor.model_runner import ModelRunner
    from sglang_backend.runtime.server_args import ServerArgs

    sa = ServerArgs(model_path=model_dir, device="cuda", dtype=dtype, attention_backend="triton",
                    max_total_tokens=8192, max_running_requests=8, disable_cuda_graph=True,
                    disable_fused_ops=not fused)
    _, config, _ = load_model_assets(sa)
    mr = ModelRunner(sa, config, model_dir)
    assert mr.kernel_options.fused_ops == fused
    lens = [37, 100, 5]
    rows = [mr.req_to_token_pool.alloc() for _ in lens]
    slots = mr.token_to_kv_pool_allocator.alloc(sum(lens))
    off = 0
    for r, n in zip(rows, lens):
        mr.req_to_token_pool.write(r, 0, slots[off : off + n])
        off += n
    ids = torch.randint(3, 1000, (sum(lens),), generator=torch.Generator().manual_seed(0)).cuda()
    fb = ForwardBatch(ForwardMode.EXTEND, ids, torch.cat([torch.arange(n) for n in lens]).cuda(), slots.cuda(),
                      torch.tensor(rows, device="cuda"), torch.tensor(lens, device="cuda"), lens,
                      extend_prefix_lens_cpu=[0, 0, 0], extend_seq_lens_cpu=lens,
                      logits_indices=torch.arange(sum(lens), device="cuda"))
    out = mr.forward(fb).double().cpu()
    del mr
    gc.collect()
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_layers_accuracy(peaked_model_dir, dtype):
    """The fused layer kernels are as accurate as the reference torch modules: both compared with an fp32 run."""
    ref = _extend_logits(peaked_model_dir, "float32", fused=False)
    fused = _extend_logits(peaked_model_dir, dtype, fused=True)
    plain = _extend_logits(peaked_model_dir, dtype, fused=False)
    err_fused = float((fused - ref).norm() / ref.norm())
    err_plain = float((plain - ref).norm() / ref.norm())
    assert err_fused <= 1.25 * err_plain + 1e-3, (err_fused, err_plain)
