"""The CPU's one-token decoder path (models/llama.py forward_one_token over layers/native/one_token.c): each
fused call equals its separate steps, and a batch-1 generation through it equals the layer-by-layer path; with every
layer's linears kept as blocks, the whole decoder runs in one call (LlamaModel.native_one_token, decoder_one_token),
which gives the per-layer calls' very logprobs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_backend.runtime.layers import gguf_quant
from sglang_backend.runtime.layers.kernel_options import KernelOptions
from sglang_backend.runtime.layers.layernorm import RMSNorm
from sglang_backend.runtime.models.llama import LlamaModel
from tests.conftest import _quantized_dir, block_types, make_engine

needs_kernels = pytest.mark.skipif(not gguf_quant.kernels_available(), reason="native kernels do not build here")
NATIVE = KernelOptions(native_cpu=True)


@needs_kernels
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("K,N", [(192, 96), (160, 42)])
def test_gemv_fused_equals_the_separate_steps(gguf_type, q8, K, N):
    """Also with 8-bit activations (q8): the normed row is what gets quantized, the epilogues act on the result
    (8 outputs at a time, and a tail: N = 42, 21 after the SiLU-mul)."""
    gen = torch.Generator().manual_seed(K + N)
    blocks = gguf_quant.quantize(torch.randn(N, K, generator=gen) * 0.1, gguf_type)
    x = torch.randn(1, K, generator=gen) * 3
    norm = RMSNorm(K, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(K, generator=gen))
        normed = norm(x, opts=NATIVE)
        # RMSNorm prologue: the same norm and matmul kernels, so the same bits
        assert torch.equal(gguf_quant.gemv_fused(x, blocks, gguf_type, norm=norm, q8=q8),
                           gguf_quant.matmul(normed, blocks, gguf_type, q8=q8))
        # SiLU-mul epilogue over [gate; up]
        gu = gguf_quant.matmul(normed, blocks, gguf_type, q8=q8)
        want = F.silu(gu[:, : N // 2]) * gu[:, N // 2:]
        got = gguf_quant.gemv_fused(x, blocks, gguf_type, norm=norm, silu_mul=True, q8=q8)
        assert got.shape == (1, N // 2)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        # residual-add epilogue, in place
        residual = torch.randn(1, N, generator=gen)
        want = residual + gguf_quant.matmul(x, blocks, gguf_type, q8=q8)
        out = gguf_quant.gemv_fused(x, blocks, gguf_type, residual=residual, q8=q8)
        assert out is residual and torch.equal(residual, want)


@needs_kernels
def test_one_token_path_equals_layer_by_layer(tiny_quantized_dir, monkeypatch):
    """Batch-1 decoding of a model with block weights: the fused one-token path (taken: the fused calls are
    counted; a layer of float linears keeps the whole-decoder call off) gives the layer-by-layer path's tokens and
    logprobs."""
    calls = []
    fused = gguf_quant.gemv_fused
    monkeypatch.setattr(gguf_quant, "gemv_fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompt = [[5, 9, 200, 31, 7, 44, 3]]
    outs = []
    for one_token in (True, False):
        if not one_token:
            monkeypatch.setattr(KernelOptions, "one_token_path", lambda self, x: False)
        engine = make_engine(tiny_quantized_dir)
        try:
            outs.append(engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True)[0])
            engine.check_pool_whole()
        finally:
            engine.shutdown()
        if one_token:
            assert calls, "the one-token path was not taken"
    a, b = outs
    assert a["output_ids"] == b["output_ids"]
    for (x, _, _), (y, _, _) in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]):
        assert abs(x - y) < 1e-5


# Every linear of every layer as blocks of a format with an 8-bit-activation kernel (the embedding, the norms and the
# LM head as in tiny_quantized_dir's mix).
_all_blocks_type = block_types((("q_proj", "Q4_1"), ("k_proj", "Q4_1"), ("v_proj", "Q4_1"), ("o_proj", "Q4_0"),
                                ("gate_proj", "Q8_0"), ("up_proj", "Q8_0"), ("down_proj", "Q5_1"),
                                ("embed_tokens", "Q8_0"), ("lm_head", "Q4_0")))


@pytest.fixture(scope="module")
def tiny_all_blocks_dir(tmp_path_factory, tiny_gqa_dir) -> str:
    return _quantized_dir(tmp_path_factory, "tiny_all_blocks", tiny_gqa_dir, _all_blocks_type)


@needs_kernels
@pytest.mark.parametrize("quant", ["none", "q8"])
def test_whole_decoder_call_equals_the_per_layer_calls(tiny_all_blocks_dir, monkeypatch, quant):
    """Every layer in one native call (taken: counted) gives the per-layer fused calls' tokens and the very same
    logprobs (the same kernels in the same order), with float32 and with 8-bit activations; and the layer-by-layer
    path's tokens. Prompts of several lengths: the attention reads 8-key groups and a tail."""
    calls = []
    whole = gguf_quant.decoder_one_token
    monkeypatch.setattr(gguf_quant, "decoder_one_token", lambda *a, **k: calls.append(1) or whole(*a, **k))
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 9, 200, 31, 7, 44, 3], [11] * 20, list(range(40, 77))]

    def generate():
        engine = make_engine(tiny_all_blocks_dir, cpu_activation_quant=quant)
        try:
            outs = [engine.generate(input_ids=[p], sampling_params=params, return_logprob=True)[0] for p in prompts]
            engine.check_pool_whole()
        finally:
            engine.shutdown()
        return outs

    outs = [generate()]
    assert len(calls) >= len(prompts) * (params["max_new_tokens"] - 1), "the whole-decoder call was not taken"
    monkeypatch.setattr(LlamaModel, "native_one_token", lambda self, hidden, rope, fb: None)
    outs.append(generate())
    monkeypatch.setattr(KernelOptions, "one_token_path", lambda self, x: False)
    outs.append(generate())
    for whole_call, per_layer, layer_by_layer in zip(*outs):
        assert whole_call["output_ids"] == per_layer["output_ids"] == layer_by_layer["output_ids"]
        assert whole_call["meta_info"]["output_token_logprobs"] == per_layer["meta_info"]["output_token_logprobs"]
        for (x, _, _), (y, _, _) in zip(whole_call["meta_info"]["output_token_logprobs"],
                                        layer_by_layer["meta_info"]["output_token_logprobs"]):
            assert abs(x - y) < 1e-5
