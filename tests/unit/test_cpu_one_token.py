"""The CPU's one-token decoder path (models/llama.py forward_one_token over layers/native/one_token.c): each
fused call equals its separate steps, and a batch-1 generation through it equals the layer-by-layer path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_backend.runtime.layers import gguf_quant
from sglang_backend.runtime.layers.kernel_options import KernelOptions
from sglang_backend.runtime.layers.layernorm import RMSNorm
from tests.conftest import make_engine

needs_kernels = pytest.mark.skipif(not gguf_quant.kernels_available(), reason="native kernels do not build here")
NATIVE = KernelOptions(native_cpu=True)


@needs_kernels
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("q8", [False, True])
def test_gemv_fused_equals_the_separate_steps(gguf_type, q8):
    """Also with 8-bit activations (q8): the normed row is what gets quantized, the epilogues act on the result."""
    gen = torch.Generator().manual_seed(0)
    K, N = 192, 96
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
    counted) gives the layer-by-layer path's tokens and logprobs."""
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
