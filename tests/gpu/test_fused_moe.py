"""The Triton fused-MoE kernels (layers/attention/triton_ops/fused_moe.py) against the torch reference (the CPU
path's arithmetic, layers.moe.torch_moe, run in fp32 on the GPU) on fresh random inputs, uneven expert loads
included; the alignment on its own; the SparseMoE layer's CUDA path; and a CUDA-graph capture whose replays
with other routings give the eager results (the kernels never read anything back to the host)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from benchmarks.bench_moe import TOL, check_align, moe_inputs, moe_reference, rel_err  # noqa: E402
from sglang_backend.runtime.layers.attention.triton_ops.fused_moe import (  # noqa: E402
    DEFAULT_MOE_CONFIGS, fused_moe, moe_config, topk_softmax)
from sglang_backend.runtime.layers.moe import SparseMoE, torch_moe  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]
# (E, k, H, I): Mixtral-like and Qwen3-MoE-like routing at small sizes that are not multiples of the tiles.
SMALL = [(8, 2, 200, 120), (128, 8, 136, 72)]
TOKENS = [1, 3, 64, 257, 2048]


def _check(T, E, k, H, I, dtype, skew, config=None, seed=None):
    seed = random.randrange(1 << 30) if seed is None else seed
    x, w13, w2, experts, w = moe_inputs(T, H, I, E, k, dtype, "cuda", seed, skew=skew)
    out = fused_moe(x, w13, w2, experts, w, config=config)
    ref = moe_reference(x, w13, w2, experts, w)
    err = rel_err(out, ref)
    # The torch loop in the same dtype (what HF computes): the kernel rounds where it does, so it should be
    # about as close to fp32; the summation order of the GEMMs is all that differs.
    err_torch = rel_err(moe_reference(x, w13, w2, experts, w, dtype), ref)
    detail = f"seed={seed} T={T} E={E} k={k} H={H} I={I} {dtype} skew={skew} config={config}"
    assert err < TOL[dtype], f"{detail}: rel err {err:.3g} (torch {dtype} path {err_torch:.3g})"
    assert err <= max(1.5 * err_torch, TOL[dtype] / 4), f"{detail}: {err:.3g} vs torch {dtype} path {err_torch:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "E{}k{}H{}I{}".format(*s))
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("skew", [False, True], ids=["even", "skewed"])
def test_fused_moe_matches_reference(dtype, shape, T, skew):
    _check(T, *shape, dtype, skew)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_fused_moe_qwen3_moe_shape(dtype, T):
    _check(T, 128, 8, 2048, 768, dtype, skew=T > 1)


@pytest.mark.parametrize("config", [c for _, c in DEFAULT_MOE_CONFIGS], ids=str)
def test_every_default_config_compiles_and_matches(config):
    """Each built-in config at every size (shared memory and registers fit; masks on ragged N and K)."""
    for T in (3, 300):
        _check(T, 8, 2, 200, 120, torch.bfloat16, skew=True, config=config)


def test_fused_moe_float32_is_ieee():
    # fp32 inputs run the dot in IEEE fp32 (no TF32), as torch's fp32 matmul does by default.
    x, w13, w2, experts, w = moe_inputs(100, 136, 72, 8, 2, torch.float32, "cuda", random.randrange(1 << 30))
    assert rel_err(fused_moe(x, w13, w2, experts, w), moe_reference(x, w13, w2, experts, w)) < TOL[torch.float32]


@pytest.mark.parametrize("shape", [(8, 2, 37), (128, 8, 1), (128, 8, 500)])
def test_moe_align_on_the_gpu(shape):
    E, k, T = shape
    for block_m in (16, 64):
        check_align(torch.randint(0, E, (T, k), device="cuda"), E, block_m)
        check_align(torch.randint(0, 3, (T, k), device="cuda") * (E // 3), E, block_m)  # most experts empty


def test_sparse_moe_layer_uses_the_kernel_on_cuda():
    torch.manual_seed(random.randrange(1 << 30))
    layer = SparseMoE(136, 72, 8, 2, renormalize=True).cuda().to(torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(33, 136, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        experts, weights = layer.route(x)
        ref = torch_moe(x.float(), layer.w13.float(), layer.w2.float(), experts, weights.float())
        out = layer(x)
    assert SparseMoE.cuda_graph_safe
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("shape", [(8, 2, 200, 120), (128, 8, 136, 72)], ids=["E8k2", "E128k8"])
def test_cuda_graph_replay_matches_eager(shape):
    """Captured once; replayed with other tokens and other routings (skewed, then even) written into the
    same input buffers; each replay equals an eager call on those inputs, bit for bit."""
    E, k, H, I = shape
    dtype, T = torch.bfloat16, 24
    seed = random.randrange(1 << 30)
    x, w13, w2, experts, w = moe_inputs(T, H, I, E, k, dtype, "cuda", seed)
    config = moe_config(T, E, k, H, I)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile off the capture
        fused_moe(x, w13, w2, experts, w, config=config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, experts, w, config=config)
    for i, skew in enumerate([True, False, True]):
        x2, _, _, experts2, w2_router = moe_inputs(T, H, I, E, k, dtype, "cuda", seed + 1 + i, skew=skew,
                                                   weights=(w13, w2))
        x.copy_(x2)
        experts.copy_(experts2)
        w.copy_(w2_router)
        graph.replay()
        eager = fused_moe(x, w13, w2, experts, w, config=config)
        assert torch.equal(out, eager), f"seed={seed} replay {i}"
        assert rel_err(out, moe_reference(x, w13, w2, experts, w)) < TOL[dtype]


def test_engine_moe_greedy_with_and_without_cuda_graphs(tmp_path):
    """A small Qwen3-MoE (16 experts, top 4, fp32): the CUDA engine (fused MoE) decodes with CUDA graphs now,
    and its greedy tokens equal the eager CUDA run's and the CPU torch path's."""
    from sglang_backend import Engine  # engines only in this test (slow import)
    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

    cfg = dummy_config(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48,
                       num_hidden_layers=3, head_dim=32, initializer_range=0.2)
    path = save_dummy_hf_model(cfg, str(tmp_path))
    sp = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41]]
    outs = {}
    for name, kw in [("cpu", dict(device="cpu")),
                     ("cuda eager", dict(device="cuda", attention_backend="triton", disable_cuda_graph=True)),
                     ("cuda graphs", dict(device="cuda", attention_backend="triton"))]:
        eng = Engine(model_path=path, dtype="float32", log_level="warning", **kw)
        try:
            if name == "cuda graphs":
                assert eng.scheduler.model_runner.graph_runner is not None, "MoE model still refuses CUDA graphs"
            outs[name] = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
        finally:
            eng.shutdown()
    assert outs["cuda graphs"] == outs["cuda eager"] == outs["cpu"], outs


@pytest.mark.parametrize("E,k,renorm", [(8, 2, True), (128, 8, True), (60, 4, False), (256, 8, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_topk_softmax_matches_torch_routing(E, k, renorm, dtype):
    """The fused routing picks the experts with the top-k probabilities (as torch.topk of the fp32 softmax;
    among equal probabilities either id is right) and gives their weights as the torch arithmetic rounds them."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(301, E, generator=g)).to("cuda", dtype)
    ids, weights = topk_softmax(logits, k, renorm, dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    top, _ = torch.topk(probs, k, dim=-1)
    ref_w = top / top.sum(-1, keepdim=True) if renorm else top
    picked = probs.gather(1, ids.long())
    assert ids.dtype == torch.int32 and weights.dtype == dtype, f"seed={seed}"
    assert torch.equal(picked, top), f"seed={seed}: not the top-k probabilities (or not highest first)"
    assert torch.allclose(weights.float(), ref_w.to(dtype).float(), rtol=1e-2 if dtype != torch.float32 else 1e-6,
                          atol=0), f"seed={seed}"
    assert len({tuple(sorted(r)) for r in ids.tolist()}) > 1 and all(len(set(r)) == k for r in ids.tolist())
