"""Opt-in 8-bit activations for GGUF block weights on the CPU (``--cpu-activation-quant q8``, issue 27): the C
kernels (gguf_blocks.c gguf_matmul_q8) against a numpy reference that rounds the activations the same way and
multiplies in float64 (the fused one-token forms: test_cpu_one_token.py), the knob's route, and an engine run
against a pure-torch model of the same rounding."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sglang_backend.runtime.layers import gguf_quant
from sglang_backend.runtime.layers.kernel_options import KernelOptions
from sglang_backend.runtime.server_args import ServerArgs
from tests.conftest import make_engine
from tests.unit.test_gguf_quant import _random_blocks

needs_kernels = pytest.mark.skipif(not gguf_quant.kernels_available(), reason="native kernels do not build here")
NATIVE = KernelOptions(native_cpu=True)


def reference_q8(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' rounding in numpy, float32 throughout: per block of 32, d = amax / 127, q = rint(x * (1 / d))
    (ties to even; 0 where d is 0). Returns int8 q [M, K] and d [M, K / 32]."""
    x = x.detach().float().numpy()
    rows, columns = x.shape
    blocks = x.reshape(rows, columns // 32, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None])
    assert q.dtype == np.float32 and np.abs(q).max(initial=0) <= 127
    return q.astype(np.int8).reshape(rows, columns), d.astype(np.float32)


def reference_q8_matmul(x: torch.Tensor, blocks: torch.Tensor, gguf_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rounded as the kernels round it) @ W.T in float64, W dequantized; and the same with |x| and |W| (the
    scale the float32 result's rounding errors are relative to)."""
    q, d = reference_q8(x)
    xd = torch.from_numpy((q.reshape(*d.shape, 32).astype(np.float64) * d[..., None]).reshape(q.shape))
    w = gguf_quant.dequantize(blocks, gguf_type, x.shape[-1]).double()
    return xd @ w.T, xd.abs() @ w.abs().T


def assert_matches_reference(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    bound = 1e-5 * scale + 1e-30
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"


@needs_kernels
def test_activation_rounding_equals_the_reference():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 160, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.5]).reshape(5, 1)
    x[1, 32:64] = 0  # an all-zero block: d = 0, q = 0
    x[2, 64:96] = torch.arange(32) - 15.5  # halves: amax 15.5 -> ties round to even after the scaling
    x[3, 96:128] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26)  # d = 1: exact ties
    q, d, s = gguf_quant.quantize_activations_q8(x)
    want_q, want_d = reference_q8(x)
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(d.numpy(), want_d)
    want_s = want_d * want_q.reshape(*want_d.shape, 32).astype(np.int64).sum(-1).astype(np.float32)
    assert np.array_equal(s.numpy(), want_s)
    assert q[3, 96:102].tolist() == [127, 0, 2, 2, 0, -2]
    assert not q[1, 32:64].any() and d[1, 1] == 0


@needs_kernels
@pytest.mark.parametrize("gguf_type", gguf_quant.Q8_ACTIVATION_FORMATS)
@pytest.mark.parametrize("rows,in_features", [(37, 96), (300, 576), (13, 32), (9, 288), (5, 512)])
@pytest.mark.parametrize("make", ["quantize", "random"])
def test_q8_matmul_equals_reference(gguf_type, rows, in_features, make):
    """Odd row counts (not whole 8-row groups), odd block counts, block counts in whole groups of 8 and not (one
    activation row: the GEMV's 8-block groups and their masked tail), 1 to MAX_NATIVE_ROWS activation rows (the 4-row
    tiles with tails); above that the dequantized float path, as without q8. Random blocks hold every quant (Q8_0's
    -128 too: the widest integer products)."""
    gen = torch.Generator().manual_seed(rows + in_features)
    if make == "quantize":
        blocks = gguf_quant.quantize(torch.randn(rows, in_features, generator=gen) * 0.1, gguf_type)
    else:
        blocks = _random_blocks(gguf_type, rows, in_features, gen)
    bias = torch.randn(rows, generator=gen)
    for m in (1, 2, 3, 4, 5, 17, gguf_quant.MAX_NATIVE_ROWS):
        x = torch.randn(m, in_features, generator=gen) * 2
        want, scale = reference_q8_matmul(x, blocks, gguf_type)
        assert_matches_reference(gguf_quant.matmul(x, blocks, gguf_type, q8=True), want, scale)
        got = gguf_quant.matmul(x.reshape(1, m, in_features), blocks, gguf_type, bias, q8=True)
        assert got.shape == (1, m, rows)
        assert_matches_reference(got[0] - bias, want, scale + bias.abs().double())
    x = torch.randn(gguf_quant.MAX_NATIVE_ROWS + 1, in_features, generator=gen)
    assert torch.equal(gguf_quant.matmul(x, blocks, gguf_type, q8=True), gguf_quant.matmul(x, blocks, gguf_type))


@needs_kernels
def test_q8_differs_from_float_and_kquants_keep_float_activations():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 256, generator=gen)
    q4 = gguf_quant.quantize(torch.randn(16, 256, generator=gen), "Q4_1")
    assert not torch.equal(gguf_quant.matmul(x, q4, "Q4_1", q8=True), gguf_quant.matmul(x, q4, "Q4_1"))
    kq = gguf_quant.quantize(torch.randn(16, 256, generator=gen), "Q4_K")
    assert "Q4_K" not in gguf_quant.Q8_ACTIVATION_FORMATS
    assert torch.equal(gguf_quant.matmul(x, kq, "Q4_K", q8=True), gguf_quant.matmul(x, kq, "Q4_K"))


def test_the_knob_reaches_the_kernel_options():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--cpu-activation-quant", "q8"]))
    assert args.cpu_activation_quant == "q8" and ServerArgs().cpu_activation_quant == "none"
    with pytest.raises(ValueError, match="cpu_activation_quant"):
        ServerArgs(cpu_activation_quant="q4")
    with pytest.raises(ValueError, match="needs native_cpu"):
        KernelOptions(cpu_activation_quant="q8")
    opts = KernelOptions.resolve(args, "cpu")
    assert opts.q8_activations == opts.native_cpu  # on wherever the C kernels are
    assert not KernelOptions.resolve(ServerArgs(cpu_activation_quant="q8", disable_native_cpu_kernels=True),
                                     "cpu").q8_activations
    assert not KernelOptions.resolve(ServerArgs(), "cpu").q8_activations


# --- the engine against a pure-torch model of the same rounding ---

def _torch_q8_matmul(x, blocks, gguf_type, bias=None, q8=False, *, native_matmul):
    """gguf_quant.matmul's q8 path in torch: the reference rounding, float64 products, float32 result."""
    rows = x.numel() // x.shape[-1]
    if not q8 or gguf_type not in gguf_quant.Q8_ACTIVATION_FORMATS or rows > gguf_quant.MAX_NATIVE_ROWS:
        return native_matmul(x, blocks, gguf_type, bias)
    out, _ = reference_q8_matmul(x.reshape(rows, x.shape[-1]), blocks, gguf_type)
    out = out.float() if bias is None else out.float() + bias
    return out.reshape(*x.shape[:-1], blocks.shape[0])


def _torch_q8_gemv_fused(x, blocks, gguf_type, *, norm=None, silu_mul=False, residual=None, q8=False):
    out = gguf_quant.matmul(x if norm is None else norm(x, opts=NATIVE), blocks, gguf_type, q8=q8)
    if silu_mul:
        out = F.silu(out[:, : out.shape[1] // 2]) * out[:, out.shape[1] // 2:]
    return out if residual is None else residual.add_(out)


@needs_kernels
def test_engine_q8_equals_a_torch_model_of_the_rounding(tiny_quantized_dir, monkeypatch):
    """Greedy decoding of the tiny quantized model (Q4_0, Q4_1, Q8_0 blocks and a float layer) with q8 activations:
    the C kernels give the tokens of the same model with every q8 matmul done in torch (float64), logprobs close;
    and they stay close to the float32-activation run's."""
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 9, 200, 31, 7, 44, 3], [11, 12, 13], [300, 2, 90, 91, 92, 8, 8, 8, 17, 60]]
    calls = []
    native_fused = gguf_quant.gemv_fused

    def generate(quant: str):
        engine = make_engine(tiny_quantized_dir, cpu_activation_quant=quant)
        try:
            outs = [engine.generate(input_ids=[p], sampling_params=params, return_logprob=True)[0] for p in prompts]
            engine.check_pool_whole()  # batch 1: the one-token path
            outs.append(engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True))
        finally:
            engine.shutdown()
        return outs

    monkeypatch.setattr(gguf_quant, "gemv_fused", lambda *a, **k: calls.append(k.get("q8")) or native_fused(*a, **k))
    ours, floats = generate("q8"), generate("none")
    assert calls and any(calls) and not all(calls)  # the fused calls took q8, then not
    native_matmul = gguf_quant.matmul
    monkeypatch.setattr(gguf_quant, "matmul",
                        lambda *a, **k: _torch_q8_matmul(*a, **k, native_matmul=native_matmul))
    monkeypatch.setattr(gguf_quant, "gemv_fused", _torch_q8_gemv_fused)
    torch_ref = generate("q8")

    def flat(outs):
        return outs[:-1] + list(outs[-1])

    for a, b, f in zip(flat(ours), flat(torch_ref), flat(floats)):
        assert a["output_ids"] == b["output_ids"]
        for (x, _, _), (y, _, _), (z, _, _) in zip(a["meta_info"]["output_token_logprobs"],
                                                   b["meta_info"]["output_token_logprobs"],
                                                   f["meta_info"]["output_token_logprobs"]):
            assert abs(x - y) < 1e-4
            if a["output_ids"] == f["output_ids"]:
                assert abs(x - z) < 0.1
