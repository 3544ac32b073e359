"""Triton attention and fused-op kernels vs float64 references on fresh random inputs (GPU only)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from benchmarks.gpu.kernel_checks import TOL, check_decode, check_decode_cascade, check_extend, check_fused_ops  # noqa: E402
from sglang_backend.runtime.layers.kernel_options import KernelConfigs  # noqa: E402
from tests.gpu.interpreter_gemma3_check import check_decode_window, check_extend_window  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]
# (query heads, KV heads, head_dim): MHA, Llama-3 GQA 4, MQA, Qwen2-7B (7 per group), odd head size.
SHAPES = [(32, 32, 128), (32, 8, 128), (8, 1, 64), (28, 4, 128), (12, 4, 80), (16, 2, 256)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_attention(dtype, shape):
    rng = random.Random(hash((str(dtype), shape)) & 0xFFFF)
    for trial in range(3):
        bs = rng.choice([1, 3, 9, 17])
        seq_lens = [rng.choice([1, rng.randint(2, 200), rng.randint(200, 3000)]) for _ in range(bs)]
        splits = rng.choice([1, 4, 7, 16, 32, 64])
        seed = rng.randint(0, 1 << 30)
        for fused_merge in (False, True):  # separate stage 2; merge folded into stage 1
            err = check_decode("cuda", dtype, *shape, seq_lens, splits, seed=seed, fused_merge=fused_merge)
            assert err < TOL[dtype], (seq_lens, splits, fused_merge, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_cascade(dtype, shape):
    # A shared radix prefix (sometimes none, sometimes the whole of the shortest request) + private tails.
    rng = random.Random(hash((str(dtype), shape, "c")) & 0xFFFF)
    for trial in range(3):
        bs = rng.choice([2, 8, 33, 130])
        shared = rng.choice([0, rng.randint(1, 100), rng.randint(100, 1500)])
        seq_lens = [shared + rng.choice([1, rng.randint(2, 100), rng.randint(100, 700)]) for _ in range(bs)]
        splits, prefix_splits = rng.choice([1, 2, 8]), rng.choice([1, 3, 8])
        seed = rng.randint(0, 1 << 30)
        # Split counters given: with one per-request split, stage 1 merges the prefix partials (no stage 2).
        for fused_merge in (False, True):
            err = check_decode_cascade("cuda", dtype, *shape, seq_lens, shared, splits, prefix_splits, seed=seed,
                                       fused_merge=fused_merge)
            assert err < TOL[dtype], (seq_lens[:4], shared, splits, prefix_splits, fused_merge, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [(16, 1, 1, False), (32, 2, 1, True), (64, 4, 2, False)], ids=str)
def test_decode_cascade_small_tiles(dtype, config):
    # The per-request part of a cascade batch under the small-tile configs a "cascade" entry names, with tails
    # both shorter and longer than one tile, and the prefix kernel under another launch configuration.
    rng = random.Random(hash((str(dtype), config)) & 0xFFFF)
    seq_lens = [1024 + rng.randint(1, 200) for _ in range(40)]
    err = check_decode_cascade("cuda", dtype, 32, 8, 128, seq_lens, 1024, 1, 4, seed=rng.randint(0, 1 << 30),
                               fused_merge=True, config=config, configs=KernelConfigs(decode_prefix=(32, 64, 4, 1)))
    assert err < TOL[dtype], (config, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_extend_attention(dtype, shape):
    rng = random.Random(hash((str(dtype), shape, "e")) & 0xFFFF)
    for trial in range(3):
        bs = rng.choice([1, 2, 5])
        prefix = [rng.choice([0, rng.randint(1, 64), rng.randint(64, 1500)]) for _ in range(bs)]
        extend = [rng.choice([1, rng.randint(2, 130), rng.randint(130, 1100)]) for _ in range(bs)]
        err = check_extend("cuda", dtype, *shape, prefix, extend, seed=rng.randint(0, 1 << 30))
        assert err < TOL[dtype], (prefix, extend, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_shared_prefix(dtype):
    # Several requests whose prefix slots are the same radix-cache pages.
    err = check_extend("cuda", dtype, 32, 8, 128, [700, 700, 700, 300], [64, 1, 200, 90], shared_prefix=700, seed=3)
    assert err < TOL[dtype]


def test_fp32_kernels_exact():
    assert check_decode("cuda", torch.float32, 8, 2, 64, [5, 300, 1000], 8) < TOL[torch.float32]
    assert check_decode("cuda", torch.float32, 8, 2, 64, [5, 300, 1000], 8, fused_merge=True) < TOL[torch.float32]
    assert check_decode("cuda", torch.float32, 4, 4, 64, [5, 300], 1, fused_merge=True) < TOL[torch.float32]
    assert check_extend("cuda", torch.float32, 8, 2, 64, [0, 100], [77, 33]) < TOL[torch.float32]
    assert check_decode_cascade("cuda", torch.float32, 8, 2, 64, [300, 310, 1000], 299, 2, 4) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(32, 8, 128), (4, 1, 256), (12, 4, 80)], ids=lambda s: "x".join(map(str, s)))
def test_extend_attention_sliding_window(dtype, shape):
    # Gemma 3 local layers: windows shorter and longer than the block, the prefix, the new tokens.
    rng = random.Random(hash((str(dtype), shape, "ew")) & 0xFFFF)
    for trial in range(4):
        bs = rng.choice([1, 2, 5])
        prefix = [rng.choice([0, rng.randint(1, 64), rng.randint(64, 1500)]) for _ in range(bs)]
        extend = [rng.choice([1, rng.randint(2, 130), rng.randint(130, 1100)]) for _ in range(bs)]
        window = rng.choice([1, 7, 64, 100, 512, 4096])
        err = check_extend_window("cuda", dtype, *shape, prefix, extend, window, seed=rng.randint(0, 1 << 30))
        assert err < TOL[dtype], (prefix, extend, window, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(32, 8, 128), (4, 1, 256), (12, 4, 80), (8, 8, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_sliding_window(dtype, shape):
    rng = random.Random(hash((str(dtype), shape, "dw")) & 0xFFFF)
    for trial in range(4):
        bs = rng.choice([1, 3, 9, 17])
        seq_lens = [rng.choice([1, rng.randint(2, 200), rng.randint(200, 3000)]) for _ in range(bs)]
        splits = rng.choice([1, 4, 7, 16, 32])
        window = rng.choice([1, 7, 64, 512, 4096])
        seed = rng.randint(0, 1 << 30)
        for fused_merge in (False, True):
            err = check_decode_window("cuda", dtype, *shape, seq_lens, splits, window, seed=seed,
                                      fused_merge=fused_merge)
            assert err < TOL[dtype], (seq_lens, splits, window, fused_merge, err)


def test_sliding_window_fp32_exact():
    assert check_extend_window("cuda", torch.float32, 8, 2, 64, [0, 100, 37], [77, 33, 300], 16) < TOL[torch.float32]
    assert check_decode_window("cuda", torch.float32, 8, 2, 64, [5, 300, 1000], 8, 16) < TOL[torch.float32]
    assert check_decode_window("cuda", torch.float32, 8, 2, 64, [5, 300], 1, 16, fused_merge=True) \
        < TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_ops(dtype):
    errs = check_fused_ops("cuda", dtype)
    # One rounding step of the dtype (the reference rounds at the same points, up to summation order).
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    bad = {k: v for k, v in errs.items() if not v < tol}
    assert not bad, bad
