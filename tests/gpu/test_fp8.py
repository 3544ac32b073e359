"""FP8 weights on the GPU (layers/fp8.py): the row quantizer, the FP8 GEMV in every fused form and the
``_scaled_mm`` linear against float64 references on fresh random inputs; an FP8 engine against the bf16
engine on the same dummy weights, at batch 1 (the GEMV path) and in batches, with prefix hits."""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability 8.9 (Ada, Hopper)", allow_module_level=True)

from benchmarks.gpu.kernel_checks import check_fp8  # noqa: E402

# FP8 weights carry ~3 significant bits: products of e4m3 weights with bf16 (or e4m3) activations against the
# float64 product of the same dequantized values differ only by the accumulation and output rounding.
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_kernels_match_references(dtype, seed):
    errs = check_fp8("cuda", dtype, seed=seed)
    for name, err in errs.items():
        limit = 0.0 if name.endswith("mismatch") else TOL[dtype]
        assert err <= limit, (name, err)


def _logits_run(model_dir, quantization, gemv_mode="auto"):
    from sglang_backend import Engine

    eng = Engine(model_path=model_dir, device="cuda", dtype="bfloat16", quantization=quantization,
                 gemv_mode=gemv_mode, max_total_tokens=16384, log_level="warning", check_pool_on_idle=True)
    try:
        g = torch.Generator().manual_seed(3)
        shared = torch.randint(3, 1000, (200,), generator=g).tolist()
        prompts = [shared + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 50)]
        sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        batch = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True, top_logprobs_num=5)
        one = eng.generate(input_ids=prompts[:1], sampling_params=sp, return_logprob=True, top_logprobs_num=5)
        eng.check_pool_whole()
        kinds = {str(p.dtype) for n, p in eng.scheduler.model_runner.model.named_parameters() if n.endswith("proj.weight")}
        return batch + one, kinds
    finally:
        eng.shutdown()
        gc.collect()
        torch.cuda.empty_cache()


def test_fp8_engine_tracks_bf16(tmp_path):
    """Online FP8 on a dummy model: the first token (prefill through ``_scaled_mm``) is one of the bf16 model's
    top 5 and scores within 0.3 nats of its best (FP8 moves logits by tenths: a pick may change only at such a
    near-tie); decoding is deterministic (a second engine gives the same tokens, at batch 2 through
    ``_scaled_mm`` and at batch 1 through the fused FP8 GEMVs in CUDA graphs)."""
    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

    # Two layers at init std 0.1: deeper or larger-init random models amplify activations until per-token FP8
    # rounding reorders their (flat) next-token distributions by more than a near-tie.
    cfg = dummy_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048, initializer_range=0.1)
    model_dir = save_dummy_hf_model(cfg, str(tmp_path), seed=0)
    ref, ref_kinds = _logits_run(model_dir, "none")
    out, kinds = _logits_run(model_dir, "fp8")
    again, _ = _logits_run(model_dir, "fp8")
    assert ref_kinds == {"torch.bfloat16"} and kinds == {"torch.float8_e4m3fn"}
    for r, o, a in zip(ref, out, again):
        ref_top = {tok: lp for lp, tok, *_ in r["meta_info"]["output_top_logprobs"][0]}
        first = o["output_ids"][0]
        assert first in ref_top, (first, ref_top)
        assert max(ref_top.values()) - ref_top[first] < 0.3, (first, ref_top)
        assert o["output_ids"] == a["output_ids"]
