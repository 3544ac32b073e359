"""FP8 weights on the CPU (torch's ``_scaled_mm`` runs there too): the per-channel weight and per-row activation
quantizers, the FP8 linear against float64 references, FP8 checkpoints (per-tensor and per-channel scales)
loaded exactly, served dequantized (``auto`` on the CPU: greedy tokens equal HF transformers on the
dequantized weights) or kept as FP8 (``--quantization fp8``), and online FP8 from a float checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_backend.runtime.layers import fp8
from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model


def test_quantize_weight_per_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.rand(48, 1, generator=g) * 5
    w[7] = 0  # an all-zero row stays zero, with a finite scale
    q, s = fp8.quantize_weight(w)
    assert q.dtype == fp8.FP8 and s.shape == (48,) and torch.isfinite(s).all()
    assert torch.equal(q.float().abs().amax(1)[torch.arange(48) != 7], torch.full((47,), fp8.FP8_MAX))
    deq = fp8.dequantize(q, s, torch.float32)
    assert deq[7].abs().max() == 0
    assert float((deq - w).norm() / w.norm()) < 0.05  # e4m3: 3 mantissa bits


def test_linear_matches_float64_reference():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    q, s = fp8.quantize_weight(w)
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=g) * 3
        xq, xs = fp8.quantize_rows_reference(x)
        ref = (xq.double() * xs.double()) @ (q.double() * s.double()[:, None]).T + b.double()
        out = fp8.linear(x, q, s, b)
        assert out.dtype == torch.float32 and out.shape == (rows, 32)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-6
    assert fp8.linear(torch.empty(0, 64), q, s).shape == (0, 32)


def _fp8_checkpoint(src: str, dst: str, per_tensor: bool) -> dict:
    """``src``'s float checkpoint with every decoder linear weight quantized to e4m3 (``weight_scale``: one per
    tensor or one per row) and an FP8 ``quantization_config``. Returns the dequantized weights by name."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    state, out, deq = load_file(os.path.join(src, "model.safetensors")), {}, {}
    for name, t in state.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            if per_tensor:
                scale = (t.float().abs().max() / fp8.FP8_MAX).reshape(())
                q = (t.float() / scale).clamp(-448, 448).to(fp8.FP8)
            else:
                q, scale = fp8.quantize_weight(t)
                scale = scale[:, None]  # [rows, 1], as compressed-tensors stores it
            out[name], out[name + "_scale"] = q, scale
            out[name.replace(".weight", ".input_scale")] = torch.tensor(1.0)  # static scales: ignored
            deq[name] = (q.float() * scale).to(t.dtype)
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return deq


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    cfg = dummy_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512,
                       initializer_range=0.2)
    return save_dummy_hf_model(cfg, str(tmp_path_factory.mktemp("fp8_float")), seed=0)


def _engine(model_dir, **kw):
    from sglang_backend import Engine

    return Engine(model_path=model_dir, device="cpu", log_level="warning", max_total_tokens=4096, **kw)


PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 200, 4, 300, 5, 400]]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("per_tensor", [True, False], ids=["per_tensor", "per_channel"])
def test_fp8_checkpoint_dequantized_on_cpu_equals_hf(float_dir, tmp_path, per_tensor):
    from transformers import AutoModelForCausalLM

    fp8_dir = str(tmp_path / "fp8")
    deq = _fp8_checkpoint(float_dir, fp8_dir, per_tensor)
    hf = AutoModelForCausalLM.from_pretrained(float_dir, torch_dtype=torch.float32)
    hf.load_state_dict({**hf.state_dict(), **{k: v.float() for k, v in deq.items()}})
    want = []
    for p in PROMPTS:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        want.append(ids[0, len(p):].tolist())
    eng = _engine(fp8_dir)  # auto on the CPU: dequantized at load
    try:
        mr = eng.scheduler.model_runner
        qkv = mr.model.model.layers[0].self_attn.qkv_proj.weight
        assert qkv.dtype == torch.float32 and not mr.fp8_weights
        ref_q = torch.cat([deq[f"model.layers.0.self_attn.{n}_proj.weight"].float() for n in "qkv"])
        assert torch.equal(qkv, ref_q)
        got = [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        eng.check_pool_whole()
    finally:
        eng.shutdown()
    assert got == want


def test_fp8_checkpoint_kept_as_fp8(float_dir, tmp_path):
    """``--quantization fp8`` keeps the checkpoint's e4m3 weights as they are; per-tensor scales of q, k and v
    become each part's rows of the fused layer's per-row scales."""
    fp8_dir = str(tmp_path / "fp8")
    _fp8_checkpoint(float_dir, fp8_dir, per_tensor=True)
    state = load_file(os.path.join(fp8_dir, "model.safetensors"))
    eng = _engine(fp8_dir, quantization="fp8")
    try:
        attn = eng.scheduler.model_runner.model.model.layers[1].self_attn
        assert attn.qkv_proj.weight.dtype == fp8.FP8
        names = [f"model.layers.1.self_attn.{n}_proj.weight" for n in "qkv"]
        want_q = torch.cat([state[n] for n in names])
        assert torch.equal(attn.qkv_proj.weight.view(torch.uint8), want_q.view(torch.uint8))
        want_s = torch.cat([state[n + "_scale"].expand(state[n].shape[0]) for n in names])
        assert torch.equal(attn.qkv_proj.weight_scale, want_s)
        out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert all(len(r["output_ids"]) == 12 for r in out)
        eng.check_pool_whole()
    finally:
        eng.shutdown()


def test_online_fp8_tracks_float(float_dir):
    """Online FP8 from the float checkpoint: the layers' logits stay close to the float model's."""
    outs = {}
    for q in ("none", "fp8"):
        eng = _engine(float_dir, quantization=q)
        try:
            kinds = {str(p.dtype) for n, p in eng.scheduler.model_runner.model.named_parameters() if n.endswith("proj.weight")}
            r = eng.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                             top_logprobs_num=5)
            outs[q] = (kinds, [x["meta_info"]["output_top_logprobs"][0] for x in r])
        finally:
            eng.shutdown()
    assert outs["none"][0] == {"torch.float32"} and outs["fp8"][0] == {"torch.float8_e4m3fn"}
    for a, b in zip(outs["none"][1], outs["fp8"][1]):
        assert a[0][1] == b[0][1]  # same top token
        assert abs(a[0][0] - b[0][0]) < 0.1


def test_unsupported_quantization_configs_are_refused(float_dir, tmp_path):
    cfg = json.load(open(os.path.join(float_dir, "config.json")))
    for qc, match in (({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
                      ({"quant_method": "awq", "bits": 4}, "not supported")):
        d = tmp_path / qc["quant_method"]
        d.mkdir()
        for f in os.listdir(float_dir):
            (d / f).write_bytes(open(os.path.join(float_dir, f), "rb").read())
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        with pytest.raises(Exception, match=match):
            _engine(str(d))


def test_fp8_on_a_model_without_fp8_layers_is_refused(tmp_path):
    from sglang_backend.runtime.models.llava import dummy_llava_config, save_dummy_llava  # a second model family

    d = save_dummy_llava(dummy_llava_config(), str(tmp_path), seed=0)
    with pytest.raises(Exception, match="decoder-only"):
        _engine(d, quantization="fp8")
