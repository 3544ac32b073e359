"""GGUF block weights kept as blocks: the native kernels against gguf-py's dequantization on fresh random
inputs, the loader's choice of which layers keep blocks, and the converted embedded model."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_backend.runtime.layers import gguf_quant, native
from sglang_backend.runtime.model_loader.loader import gguf_block_types
from sglang_backend.runtime.server_args import ServerArgs
from tests.conftest import make_engine

needs_kernels = pytest.mark.skipif(not gguf_quant.kernels_available(), reason="native kernels do not build here")
TYPES = list(gguf_quant.FORMATS)


# Where each format keeps its fp16 scales (byte offsets in a block): random blocks get finite ones there.
_HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(gguf_type: str, rows: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes as blocks (every quant, sub-block scale, min and high-bit pattern), fp16 scales finite."""
    _, columns, nbytes = gguf_quant.FORMATS[gguf_type]
    blocks = torch.randint(0, 256, (rows, in_features // columns, nbytes), generator=gen, dtype=torch.uint8)
    for offset in _HALF_FIELDS[gguf_type]:
        scale = (torch.rand(rows, in_features // columns, generator=gen) * 2e-2 - 1e-2).half()
        blocks[:, :, offset:offset + 2] = scale.view(torch.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def _weight_shape(gguf_type: str, rows: int, in_features: int) -> tuple[int, int]:
    """in_features rounded up to whole blocks (256 columns for the K-quants)."""
    columns = gguf_quant.block_columns(gguf_type)
    return rows, -(-in_features // columns) * columns


@needs_kernels
@pytest.mark.parametrize("gguf_type", TYPES)
# (13, 96): an odd number of blocks per row (Q4_0 / Q4_1 at one row pair blocks up, the last with itself)
@pytest.mark.parametrize("rows,in_features", [(37, 64), (13, 96), (300, 576), (64, 1536)])
@pytest.mark.parametrize("make", ["quantize", "random"])
def test_matmul_equals_dequantized_reference(gguf_type, rows, in_features, make):
    rows, in_features = _weight_shape(gguf_type, rows, in_features)
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    if make == "quantize":
        blocks = gguf_quant.quantize(torch.randn(rows, in_features, generator=gen), gguf_type)
    else:
        blocks = _random_blocks(gguf_type, rows, in_features, gen)
    assert blocks.shape == (rows, gguf_quant.row_bytes(gguf_type, in_features))
    assert gguf_quant.GGUFBlocks(gguf_type, blocks).shape == (rows, in_features)
    reference = gguf_quant._reference_dequantize(blocks, gguf_type, in_features)
    # Each weight rounds exactly as gguf-py's dequantize.
    assert torch.equal(gguf_quant.dequantize(blocks, gguf_type, in_features), reference)
    bias = torch.randn(rows, generator=gen)
    # 1 row (the fused GEMV), 2-17 (the 4 x 3 tiles, with tails), above MAX_NATIVE_ROWS (dequantize + sgemm)
    for m in (1, 2, 3, 5, 17, gguf_quant.MAX_NATIVE_ROWS + 3):
        x = torch.randn(m, in_features, generator=gen)
        want = x @ reference.T
        got = gguf_quant.matmul(x, blocks, gguf_type)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * max(1.0, want.abs().max().item()))
        torch.testing.assert_close(gguf_quant.matmul(x, blocks, gguf_type, bias), want + bias, rtol=1e-5,
                                   atol=1e-4 * max(1.0, want.abs().max().item()))
    # leading batch dims are kept
    x3 = torch.randn(2, 3, in_features, generator=gen)
    assert gguf_quant.matmul(x3, blocks, gguf_type).shape == (2, 3, rows)


@needs_kernels
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1"])
def test_one_row_nibble_pairs_round_like_float_products(gguf_type):
    """Q4_0 / Q4_1 at one activation row multiply quants by x scaled by powers of two (see gguf_blocks.c,
    pair_gemv): for activations over many magnitudes the error stays float rounding, relative to sum |w x|."""
    gen = torch.Generator().manual_seed(5)
    blocks = _random_blocks(gguf_type, 41, 352, gen)  # 11 blocks: an odd one at the end
    w = gguf_quant._reference_dequantize(blocks, gguf_type, 352).double()
    for low, high in ((-30.0, 3.0), (-3.0, 3.0), (2.0, 6.0)):
        x = torch.randn(1, 352, generator=gen) * 10 ** (torch.rand(1, 352, generator=gen) * (high - low) + low)
        got = gguf_quant.matmul(x, blocks, gguf_type).double()
        bound = (w.abs() @ x.double().abs().T).T
        assert ((got - x.double() @ w.T).abs() <= 1e-6 * bound).all()


@needs_kernels
@pytest.mark.parametrize("gguf_type", TYPES)
def test_wide_tiles_equal_the_256_bit_tiles(gguf_type):
    """Several activation rows on an AVX-512 CPU take gemm_rows_wide (gguf_blocks.c): two 256-bit tiles' FMAs side
    by side, so every output is bit for bit the 256-bit path's, for any tail of weight rows (groups of 6, whole
    8-row chunks per thread) and of activation rows (tiles of 8), and both equal the dequantized float matmul."""
    kernels, code = native.kernels(), gguf_quant.FORMATS[gguf_type][0]
    if not kernels.native_wide(-1):
        pytest.skip("this CPU has no AVX-512: gguf_matmul takes the 256-bit tiles only")
    gen = torch.Generator().manual_seed(11)
    for rows, in_features in ((37, 96), (6, 64), (13, 576), (203, 1536), (1, 288)):
        rows, in_features = _weight_shape(gguf_type, rows, in_features)
        blocks = _random_blocks(gguf_type, rows, in_features, gen)
        reference = gguf_quant._reference_dequantize(blocks, gguf_type, in_features)
        for m in (2, 3, 7, 8, 9, 16, 17, 31, 32):
            x = torch.randn(m, in_features, generator=gen)
            outs = []
            for wide in (1, 0):
                y = torch.full((m, rows), float("nan"))
                try:
                    assert kernels.native_wide(wide) == wide
                    kernels.gguf_matmul(code, x.data_ptr(), m, in_features, blocks.data_ptr(), rows, y.data_ptr(), 2)
                finally:
                    kernels.native_wide(1)
                outs.append(y)
            assert torch.equal(outs[0], outs[1]), (rows, in_features, m)
            want = x @ reference.T
            torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-4 * max(1.0, want.abs().max().item()))


@needs_kernels
@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0"])
def test_matmul_same_for_any_thread_count(gguf_type):
    """The worker pool hands out chunks of rows (thread_pool.c): every row is computed once, the same way, whatever
    the thread count, including fewer threads than the pool already has workers."""
    gen = torch.Generator().manual_seed(9)
    blocks = _random_blocks(gguf_type, 203, 576, gen)
    kernels, code = native.kernels(), gguf_quant.FORMATS[gguf_type][0]
    for m in (1, 5):
        x = torch.randn(m, 576, generator=gen)
        outs = []
        for threads in (1, 2, 5, 3, 2):
            y = torch.full((m, 203), float("nan"))
            kernels.gguf_matmul(code, x.data_ptr(), m, 576, blocks.data_ptr(), 203, y.data_ptr(), threads)
            outs.append(y)
        assert all(torch.equal(outs[0], y) for y in outs[1:])


@pytest.mark.parametrize("gguf_type,error", [("Q4_K", 0.1), ("Q5_K", 0.05), ("Q6_K", 0.03)])
def test_k_quantizer_round_trips(gguf_type, error):
    """Our K-quant quantizer (gguf-py has none) makes blocks gguf-py dequantizes back to about the weights."""
    w = torch.randn(20, 512, generator=torch.Generator().manual_seed(1)) * 0.05
    back = gguf_quant._reference_dequantize(gguf_quant.quantize(w, gguf_type), gguf_type, 512)
    assert (back - w).norm() / w.norm() < error
    with pytest.raises(ValueError, match="whole blocks of 256"):
        gguf_quant.quantize(torch.randn(4, 320), gguf_type)


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q5_0"])
def test_symmetric_blocks_convert_into_q8_0_exactly(gguf_type):
    gen = torch.Generator().manual_seed(5)
    for blocks in (gguf_quant.quantize(torch.randn(9, 96, generator=gen), gguf_type),
                   _random_blocks(gguf_type, 9, 96, gen)):
        source = gguf_quant.GGUFBlocks(gguf_type, blocks)
        wide = source.convert("Q8_0")
        assert wide.gguf_type == "Q8_0" and wide.shape == (9, 96)
        assert torch.equal(wide.dequantize(), source.dequantize())
        assert torch.equal(gguf_quant._reference_dequantize(wide.data, "Q8_0", 96), source.dequantize())
    assert source.convert(gguf_type) is source
    with pytest.raises(ValueError, match="exactly"):
        gguf_quant.GGUFBlocks("Q4_1", gguf_quant.quantize(torch.randn(2, 32), "Q4_1")).convert("Q8_0")
    assert gguf_quant.common_format({gguf_type, "Q8_0"}) == "Q8_0"
    assert gguf_quant.common_format({gguf_type}) == gguf_type
    assert gguf_quant.common_format({gguf_type, "Q4_1"}) is None and gguf_quant.common_format({"Q4_1", "Q8_0"}) is None


def test_block_sizes_match_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # deferred: gguf is slow to import

    for name, (type_id, columns, nbytes) in gguf_quant.FORMATS.items():
        assert GGMLQuantizationType(type_id).name == name
        assert GGML_QUANT_SIZES[GGMLQuantizationType(type_id)] == (columns, nbytes)
    assert gguf_quant.can_keep("Q4_K", 512) and not gguf_quant.can_keep("Q4_K", 640)
    assert gguf_quant.can_keep("Q5_0", 640) and not gguf_quant.can_keep("Q2_K", 512)


@needs_kernels
def test_embedding_rows_and_bad_ids():
    blocks = gguf_quant.quantize(torch.randn(50, 64), "Q8_0")
    reference = gguf_quant._reference_dequantize(blocks, "Q8_0", 64)
    ids = torch.tensor([[3, 0], [49, 3]])
    assert torch.equal(gguf_quant.embedding(ids, blocks, "Q8_0", 64), reference[ids])
    with pytest.raises(IndexError, match="out of range"):
        gguf_quant.embedding(torch.tensor([50]), blocks, "Q8_0", 64)


def test_kernels_off_without_a_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SGLANG_BACKEND_CACHE", str(tmp_path))
    with caplog.at_level("WARNING"):
        assert native.load.__wrapped__() is None
    if "avx2" in native.cpu_flags():
        assert "native kernels off" in caplog.text


def test_kernels_off_with_an_unwritable_cache(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(native, "kernels_dir", lambda: str(blocker / "kernels"))  # under a file: cannot exist
    with caplog.at_level("WARNING"):
        assert native.load.__wrapped__() is None
    if "avx2" in native.cpu_flags():
        assert "cannot build" in caplog.text


def test_block_matmul_without_kernels_dequantizes(monkeypatch):
    """No kernels here: the same answer from a dequantized copy."""
    blocks = gguf_quant.quantize(torch.randn(40, 64), "Q4_0")
    x = torch.randn(3, 64)
    want = x @ gguf_quant._reference_dequantize(blocks, "Q4_0", 64).T
    monkeypatch.setattr(native, "kernels", lambda: None)
    torch.testing.assert_close(gguf_quant.matmul(x, blocks, "Q4_0"), want, rtol=1e-5, atol=1e-4)


def test_quantization_choice_is_checked():
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServerArgs(quantization="q4")


@needs_kernels
def test_quantized_layers_keep_blocks_and_match_dequantized_load(tiny_quantized_dir):
    """Every layer whose checkpoint pieces share one block type keeps blocks; layer 1's qkv (q Q4_1, k Q8_0)
    and the float norms do not. --quantization none dequantizes everything: same greedy tokens, logprobs within
    1e-4."""
    types = gguf_block_types(tiny_quantized_dir)
    assert types["model.layers.1.self_attn.k_proj.weight"] == "Q8_0"
    prompts = [[5, 9, 200, 31, 7] * k for k in (1, 3, 7)]
    params = {"max_new_tokens": 12, "temperature": 0}
    outs = {}
    for quantization in ("auto", "none"):
        engine = make_engine(tiny_quantized_dir, quantization=quantization)
        try:
            runner = engine.scheduler.model_runner
            if quantization == "auto":
                assert "model.layers.1.self_attn.qkv_proj.weight" not in runner.quantized_params
                assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj.weight",
                        "model.embed_tokens.weight", "lm_head.weight"} <= set(runner.quantized_params)
                layer0 = runner.model.model.layers[0]
                assert layer0.self_attn.qkv_proj.weight.dtype == torch.uint8
                assert layer0.self_attn.qkv_proj.gguf_type == "Q4_1"
            else:
                assert runner.quantized_params == []
            outs[quantization] = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                                 logprob_start_len=0)
            engine.check_pool_whole()
        finally:
            engine.shutdown()
    for q, d in zip(outs["auto"], outs["none"]):
        assert q["output_ids"] == d["output_ids"]
        for (a, _, _), (b, _, _) in zip(q["meta_info"]["input_token_logprobs"][1:],
                                        d["meta_info"]["input_token_logprobs"][1:]):
            assert abs(a - b) < 1e-4


def _generate(path: str, quantization: str, prompts, params) -> tuple[list, dict[str, str]]:
    """The outputs with logprobs, and the block format of each parameter that keeps blocks."""
    engine = make_engine(path, quantization=quantization)
    try:
        out = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
        engine.check_pool_whole()
        runner = engine.scheduler.model_runner
        return out, {name: runner.model.get_submodule(name.rsplit(".", 1)[0]).gguf_type
                     for name in runner.quantized_params}
    finally:
        engine.shutdown()


@needs_kernels
def test_kquant_model_keeps_blocks_and_matches_dequantized_load(tiny_kquant_dir):
    """A tiny model in Q4_K / Q5_K / Q6_K (and Q5_0 / Q5_1) blocks: every linear and the embedding keep them, and
    the greedy tokens and every logprob (prompt and output) equal the dequantized float32 model's within 1e-4."""
    types = gguf_block_types(tiny_kquant_dir)
    assert {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"} == set(types.values())
    prompts = [[5, 9, 200, 31, 7] * k for k in (1, 3, 7)]
    params = {"max_new_tokens": 12, "temperature": 0}
    quantized, kept = _generate(tiny_kquant_dir, "auto", prompts, params)
    dequantized, none_kept = _generate(tiny_kquant_dir, "none", prompts, params)
    # qkv (layer 1's: Q5_0 q and k with a Q8_0 v, kept as Q8_0), o, gate_up, down per layer; embedding, lm_head
    assert not none_kept and len(kept) == 2 * 4 + 2
    assert kept["model.layers.1.self_attn.qkv_proj.weight"] == "Q8_0"
    assert kept["model.layers.0.self_attn.qkv_proj.weight"] == "Q4_K" and kept["lm_head.weight"] == "Q6_K"
    for q, d in zip(quantized, dequantized):
        assert q["output_ids"] == d["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            pairs = list(zip(q["meta_info"][key], d["meta_info"][key]))
            assert pairs and all(a[0] is None and b[0] is None or abs(a[0] - b[0]) < 1e-4 for a, b in pairs)


@needs_kernels
def test_converted_embedded_model_keeps_its_blocks(smollm_dir):
    """The embedded SmolLM2 GGUF (Q4_1 linears, Q8_0 embedding) converts to a directory about its own size,
    with every linear and the embedding stored as blocks."""
    from sglang_backend.runtime.model_loader.embedded import embedded_gguf_path

    types = gguf_block_types(smollm_dir)
    assert types["model.embed_tokens.weight"] == "Q8_0"
    linears = [n for n in types if ".layers." in n]
    assert len(linears) == 30 * 7 and {types[n] for n in linears} == {"Q4_1"}
    size = sum(os.path.getsize(os.path.join(smollm_dir, f)) for f in os.listdir(smollm_dir))
    assert size <= 1.1 * os.path.getsize(embedded_gguf_path())


@needs_kernels
@pytest.mark.parametrize("which", ["tiny_gemma3_dir", "tiny_qwen3_dir"])
def test_native_cpu_kernels_match_the_torch_path(which, request):
    """The C kernels (RMSNorm, decode attention read in place from the pool; Gemma 3's sliding windows too) give
    the torch path's greedy tokens and logprobs within 1e-4, over a batch of mixed lengths."""
    path = request.getfixturevalue(which)
    prompts = [[5, 9, 200, 31, 7] * k for k in (1, 3, 7)]
    params = {"max_new_tokens": 16, "temperature": 0}
    outs = []
    for disable in (False, True):
        engine = make_engine(path, disable_native_cpu_kernels=disable)
        try:
            assert engine.scheduler.model_runner.kernel_options.native_cpu is not disable
            outs.append(engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True))
            engine.check_pool_whole()
        finally:
            engine.shutdown()
    for a, b in zip(*outs):
        assert a["output_ids"] == b["output_ids"]
        for (x, _, _), (y, _, _) in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]):
            assert abs(x - y) < 1e-4


@needs_kernels
def test_kernels_from_two_threads_at_once():
    """The worker pool runs one job at a time; callers on several threads each get their own right answer."""
    import threading

    blocks = gguf_quant.quantize(torch.randn(512, 256), "Q4_1")
    reference = gguf_quant._reference_dequantize(blocks, "Q4_1", 256)
    errors = []

    def work(seed: int):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(50):
            x = torch.randn(1 + seed % 3, 256, generator=gen)
            if (gguf_quant.matmul(x, blocks, "Q4_1") - x @ reference.T).abs().max() > 1e-3:
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def _attention_reference(q, k_buf, v_buf, rows, token_req, token_len, scale, cap, window):
    """Per query token: softmax over its visible positions of its request, in float64."""
    tokens, H, D = q.shape
    group = H // k_buf.shape[1]
    out = torch.empty(tokens, H, D, dtype=torch.float64)
    for t in range(tokens):
        length = int(token_len[t])
        first = max(0, length - window) if window else 0
        slots = rows[int(token_req[t]), first:length]
        for h in range(H):
            k = k_buf[slots, h // group].double()
            s = (k @ q[t, h].double()) * scale
            if cap:
                s = cap * torch.tanh(s / cap)
            out[t, h] = torch.softmax(s, 0) @ v_buf[slots, h // group].double()
    return out


def _attention_case(gen, H: int, Hkv: int, D: int, pool_rows: int, lengths: list[int], new: list[int], width: int):
    """Random inputs of the native paged attention: a pool of ``pool_rows`` K/V slots, each request's ``lengths[b]``
    slots scattered over it (a table ``width`` wide), its last ``new[b]`` tokens as queries (causal)."""
    k_buf = torch.randn(pool_rows, Hkv, D, generator=gen)
    v_buf = torch.randn(pool_rows, Hkv, D, generator=gen)
    rows = torch.zeros(len(lengths), width, dtype=torch.int64)
    for b, n in enumerate(lengths):
        rows[b, :n] = torch.randperm(pool_rows, generator=gen)[:n]
    token_req = torch.tensor([b for b, n in enumerate(new) for _ in range(n)])
    token_len = torch.tensor([total - n + 1 + i for total, n in zip(lengths, new) for i in range(n)])
    q = torch.randn(len(token_req), H, D, generator=gen)
    return k_buf, v_buf, rows, token_req, token_len, q


@needs_kernels
@pytest.mark.parametrize("D", [16, 20, 64, 128])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (7, 0.0), (0, 30.0)])
def test_paged_attention_equals_reference(D, window, cap):
    """The native attention on fresh random inputs: GQA (6 heads over 2), requests of different lengths whose
    slots are scattered over the pool, several new tokens per request (causal), windows and softcaps."""
    gen = torch.Generator().manual_seed(D * 100 + window)
    H, Hkv = 6, 2
    k_buf, v_buf, rows, token_req, token_len, q = _attention_case(gen, H, Hkv, D, 400, [3, 40, 129], [1, 5, 17], 160)
    out = torch.empty_like(q)
    scale = D ** -0.5
    native.kernels().paged_attention(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), rows.data_ptr(), rows.shape[1],
                                     token_req.data_ptr(), token_len.data_ptr(), len(token_req), H, Hkv, D, scale,
                                     cap, window, out.data_ptr(), 2)
    want = _attention_reference(q, k_buf, v_buf, rows, token_req, token_len, scale, cap, window)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("H,Hkv,D", [(6, 2, 64), (9, 3, 64), (4, 2, 128), (6, 2, 128), (6, 6, 64), (8, 2, 64)])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (7, 0.0), (0, 30.0)])
def test_grouped_attention_equals_per_head(H, Hkv, D, window, cap):
    """On AVX-512, groups of 2 or 3 query heads are computed together (paged_attention.c, attend_group): bit for
    bit the per-head 256-bit result, for key counts that leave remainders of the 8-key steps; other groupings
    (1, 4 heads) keep the per-head path either way."""
    kernels = native.kernels()
    if not kernels.native_wide(-1):
        pytest.skip("this CPU has no AVX-512: the per-head path only")
    gen = torch.Generator().manual_seed(H * 1000 + D + window)
    k_buf, v_buf, rows, token_req, token_len, q = _attention_case(gen, H, Hkv, D, 900, [3, 40, 129, 750],
                                                                  [1, 5, 17, 1], 800)
    outs = []
    for wide in (1, 0):
        out = torch.full_like(q, float("nan"))
        try:
            kernels.native_wide(wide)
            kernels.paged_attention(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), rows.data_ptr(), rows.shape[1],
                                    token_req.data_ptr(), token_len.data_ptr(), len(token_req), H, Hkv, D, D ** -0.5,
                                    cap, window, out.data_ptr(), 2)
        finally:
            kernels.native_wide(1)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    want = _attention_reference(q, k_buf, v_buf, rows, token_req, token_len, D ** -0.5, cap, window)
    torch.testing.assert_close(outs[0].double(), want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 100])
def test_native_rmsnorm_equals_reference(rows):
    """RMSNorm with and without the residual add (1 row, and enough rows to split over the pool); the caller's
    residual is left untouched, as the reference's ``residual + x`` leaves it."""
    from sglang_backend.runtime.layers.kernel_options import KernelOptions
    from sglang_backend.runtime.layers.layernorm import RMSNorm

    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    x, residual = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    before = residual.clone()
    opts = KernelOptions(native_cpu=True)
    torch.testing.assert_close(norm(x, opts=opts), norm(x), rtol=1e-5, atol=1e-5)
    (got, got_res), (want, want_res) = norm(x, residual, opts), norm(x, residual)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_res, want_res) and torch.equal(residual, before)


@needs_kernels
def test_kernels_work_in_a_forked_child():
    """A child forked after the pool's workers started gets a pool of its own (no wait on the parent's)."""
    import multiprocessing

    blocks = gguf_quant.quantize(torch.randn(256, 64), "Q8_0")
    x = torch.randn(2, 64)
    want = gguf_quant.matmul(x, blocks, "Q8_0")  # the parent's workers exist from here on
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as children:
        got = children.apply_async(gguf_quant.matmul, (x, blocks, "Q8_0")).get(timeout=60)
    torch.testing.assert_close(got, want)


@needs_kernels
def test_native_rope_store_equals_reference():
    """Rotary in place on q and k of the fused qkv rows (HF's rotate-half arithmetic), k and v into their slots."""
    from transformers import LlamaConfig

    from sglang_backend.runtime.layers.rotary_embedding import RotaryEmbedding, apply_rotary

    H, Hkv, D, T = 4, 2, 16, 5
    rotary = RotaryEmbedding(LlamaConfig(hidden_size=H * D, num_attention_heads=H, max_position_embeddings=64), D)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen)
    positions = torch.tensor([0, 7, 8, 30, 63])
    loc = torch.tensor([9, 2, 5, 0, 11])
    k_buf, v_buf = torch.zeros(12, Hkv, D), torch.zeros(12, Hkv, D)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    ref = rotary.for_batch(positions, torch.float32, fused=False, max_positions=0)
    want_q = apply_rotary(q.reshape(T, H, D), ref.cos, ref.sin).reshape(T, -1)
    want_k = apply_rotary(k.reshape(T, Hkv, D), ref.cos, ref.sin)
    want_v = v.reshape(T, Hkv, D).clone()
    table = rotary.table(64, "cpu")
    native.kernels().rope_store_kv(qkv.data_ptr(), T, H, Hkv, D, positions.data_ptr(), table.data_ptr(),
                                   loc.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), 2)
    torch.testing.assert_close(qkv[:, : H * D], want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_buf[loc], want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_buf[loc], want_v)
    assert k_buf[[1, 3, 4]].abs().sum() == 0  # other slots untouched
