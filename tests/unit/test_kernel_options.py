"""Kernel choices are ServerArgs flags resolved into one KernelOptions object; tuned launch configurations are
per-device JSON files (issue 22). CPU only: what resolves to what, and what the files may hold."""

from __future__ import annotations

import argparse
import json

import pytest

from sglang_backend.runtime.layers.attention.base import AttentionBackend
from sglang_backend.runtime.layers.attention.torch_native import TorchNativeAttnBackend
from sglang_backend.runtime.layers.kernel_options import (CONFIG_DIR, KernelConfigs, KernelOptions,
                                                          load_kernel_configs)
from sglang_backend.runtime.server_args import ServerArgs


def test_cpu_resolves_to_the_torch_reference_whatever_the_flags():
    for kw in ({}, {"gemv_mode": "fused_rope"}, {"gemv_mode": "on", "attention_merge": "stage2"}):
        opts = KernelOptions.resolve(ServerArgs(**kw), "cpu")
        assert not opts.fused_ops and opts.gemv_mode == "off" and not opts.pdl
        assert opts.configs == KernelConfigs()


def test_flags_are_generated_and_validated():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--gemv-mode", "fused", "--pdl", "off", "--attention-merge", "stage2", "--kernel-config", "k.json"]))
    assert (args.gemv_mode, args.pdl, args.attention_merge, args.kernel_config) == ("fused", "off", "stage2", "k.json")
    assert not args.disable_fused_ops
    with pytest.raises(SystemExit):
        parser.parse_args(["--gemv-mode", "sometimes"])
    with pytest.raises(ValueError, match="gemv_mode"):
        ServerArgs(gemv_mode="sometimes")
    with pytest.raises(ValueError, match="attention_merge"):
        ServerArgs(attention_merge="later")
    with pytest.raises(ValueError, match="pdl"):
        ServerArgs(pdl="sometimes")
    with pytest.raises(ValueError, match="disable_fused_ops"):
        ServerArgs(gemv_mode="fused", disable_fused_ops=True)
    with pytest.raises(ValueError, match="resolved"):
        KernelOptions(gemv_mode="auto")


def test_config_files(tmp_path):
    defaults = KernelConfigs()
    assert defaults.gemv_config(11008, 4096, False) == (4, 1024, 4, 3)
    assert defaults.decode_config(True, 1) == (64, 2, 1, True)
    assert defaults.decode_config(False, 64) == (128, 4, 2, False)
    # Partial files keep the defaults for what they do not name.
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"gemv_shapes": {"22016,4096,1": [2, 2048, 4, 3]},
                                "decode_gqa": {"large": [64, 8, 3, True]}, "target_programs_per_sm": 2.0}))
    c = load_kernel_configs("cpu", str(path))
    assert c.gemv_config(22016, 4096, True) == (2, 2048, 4, 3)
    assert c.gemv_config(22016, 4096, False) == defaults.gemv
    assert c.decode_config(False, 64) == (64, 8, 3, True) and c.decode_config(False, 1) == (64, 4, 2, True)
    assert c.target_programs_per_sm == 2.0 and c.decode_mha == defaults.decode_mha
    # A cascade batch's per-request part takes the "cascade" entry where a file names one, else the batch size's.
    assert c.decode_config(False, 64, cascade=True) == (64, 8, 3, True)
    path.write_text(json.dumps({"decode_gqa": {"cascade": [32, 2, 1, False]}}))
    c = load_kernel_configs("cpu", str(path))
    assert c.decode_config(False, 64, cascade=True) == (32, 2, 1, False)
    assert c.decode_config(False, 64) == defaults.decode_config(False, 64)
    assert c.decode_config(True, 64, cascade=True) == defaults.decode_config(True, 64)
    assert KernelConfigs.from_json(json.loads(json.dumps(c.to_json()))) == c
    path.write_text(json.dumps({"gemv_config": [1, 2, 3, 4]}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_kernel_configs("cpu", str(path))
    # The shipped per-device files parse.
    shipped = sorted(CONFIG_DIR.glob("*.json"))
    assert shipped
    for f in shipped:
        KernelConfigs.from_json(json.loads(f.read_text()))
    assert load_kernel_configs("cpu") == defaults  # no GPU: the defaults


def test_attention_backends_declare_their_capabilities():
    for name in ("supports_fused_kv_store", "supports_cuda_graph", "num_cascade_steps"):
        assert hasattr(AttentionBackend, name)
    b = TorchNativeAttnBackend()
    assert not b.supports_fused_kv_store and not b.supports_cuda_graph
    assert b.decode_graph_variants(8) == (False,)
    b.update_shared_prefix(None, None, [1], 1)  # nothing to refresh


def test_gemv_needs_the_fused_kernels():
    assert KernelOptions(fused_ops=True, gemv_mode="fused_rope").fused_gemv
    assert not KernelOptions(fused_ops=True, gemv_mode="on").fused_gemv
    with pytest.raises(ValueError, match="needs fused_ops"):
        KernelOptions(gemv_mode="on")


def test_auto_merge_and_pdl_differ_for_one_token_batches_of_gqa_models():
    """``auto``: a GQA model's one-token batches use the stage-2 merge kernel and no PDL, larger batches the merge
    folded into stage 1 (and PDL on a GPU); MHA models use the latter throughout; explicit choices hold for every
    batch; kernel variants made with dataclasses.replace keep the one-token rule."""
    import dataclasses

    gqa = KernelOptions.resolve(ServerArgs(), "cpu", grouped_query=True)
    assert gqa.attention_merge == "fused" and gqa.for_tokens(64) is gqa
    one = gqa.for_tokens(1)
    assert one.attention_merge == "stage2" and not one.pdl and one.for_tokens(1) is one
    mha = KernelOptions.resolve(ServerArgs(), "cpu", grouped_query=False)
    assert mha.for_tokens(1) is mha and mha.attention_merge == "fused"
    fixed = KernelOptions.resolve(ServerArgs(attention_merge="fused"), "cpu", True)
    assert fixed.for_tokens(1).attention_merge == "fused"
    staged = KernelOptions.resolve(ServerArgs(attention_merge="stage2"), "cpu", False)
    assert staged.for_tokens(1).attention_merge == staged.for_tokens(8).attention_merge == "stage2"
    variant = dataclasses.replace(gqa, gemv_mode="off")
    assert variant.for_tokens(1).attention_merge == "stage2" and variant.for_tokens(1).gemv_mode == "off"
    with pytest.raises(ValueError, match="attention_merge"):
        KernelOptions(attention_merge="auto")  # resolved options never say auto
    with pytest.raises(ValueError, match="attention_merge"):
        KernelOptions(one_token_merge="auto")
