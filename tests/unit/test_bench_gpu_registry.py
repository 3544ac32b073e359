"""benchmarks/gpu's section registry, on the CPU with fake sections: the named sections run in registry order
whatever the order given, engine sections share one engine (ablations get their own, with their overrides),
unknown names are an error listing the valid ones; and the summary table skips figures whose section did not
run (decode without the ceilings has no floor)."""

from __future__ import annotations

import contextlib

import pytest

from benchmarks import bench_gpu
from benchmarks.gpu import registry
from benchmarks.gpu.common import Context
from benchmarks.gpu.table import table


def fake_sections(calls: list) -> list[registry.Section]:
    def sec(name, engine=None):
        return registry.Section(name, lambda ctx: calls.append((name, ctx.eng)), engine)

    return [sec("a"), sec("b"), sec("e1", registry.SHARED), sec("e2", registry.SHARED),
            sec("abl", {"switch": True}), sec("e3", registry.SHARED)]


def run(names):
    calls, engines = [], []

    @contextlib.contextmanager
    def open_engine(ctx, **overrides):
        ctx.eng = f"engine{len(engines)}"
        engines.append(overrides)
        try:
            yield ctx.eng
        finally:
            calls.append(("closed", ctx.eng))
            ctx.eng = None

    ctx = Context(args=None, name="tiny", spec={}, mb={})
    registry.run_sections(ctx, names, fake_sections(calls), open_engine)
    return calls, engines


def test_sections_run_in_registry_order_sharing_one_engine():
    calls, engines = run(["e3", "abl", "e2", "a", "e1"])
    assert calls == [("a", None), ("e1", "engine0"), ("e2", "engine0"), ("closed", "engine0"),
                     ("abl", "engine1"), ("closed", "engine1"), ("e3", "engine2"), ("closed", "engine2")]
    assert engines == [{}, {"switch": True}, {}]


def test_no_engine_without_an_engine_section():
    calls, engines = run(["b", "a"])
    assert calls == [("a", None), ("b", None)] and engines == []


def test_unknown_section_names_the_valid_ones():
    with pytest.raises(registry.UnknownSection, match=r"unknown section\(s\) nope.*valid sections: a, b, e1, e2"):
        run(["a", "nope"])


def test_registry_names_are_unique_and_documented():
    names = [s.name for s in registry.SECTIONS]
    assert len(names) == len(set(names))
    assert all(f"* {n}" in bench_gpu.__doc__ or f" {n}," in bench_gpu.__doc__ or f" {n}:" in bench_gpu.__doc__
               for n in names)
    # What benchmarks/ab_gpu.py runs.
    registry.select(["ceilings", "runner", "shared", "offline"])


def test_cli_rejects_an_unknown_section(capsys):
    with pytest.raises(SystemExit) as e:
        bench_gpu.main(["--only", "runner,bogus"])
    assert e.value.code == 2
    assert "valid sections: ceilings" in capsys.readouterr().err


def test_table_skips_missing_figures():
    # runner without ceilings: no floor, no ratio, no matmul rate.
    d = {"step_s": 0.005, "floor_s": None, "ratio_to_floor": None, "step_synced_s": 0.006, "step_eager_s": 0.007}
    result = {"ours": {"decode_bs1": d, "decode_bs1_off_pdl": d, "decode_bs64": d,
                       "prefill_8x1024": {"time_s": 0.2, "achieved_flops": 5e14, "fraction_of_matmul_rate": None,
                                          "matmul_rate": None}},
              "env": {"device": "fake"}}
    text = table("tiny", result)
    assert "decode step bs=1" in text and "variant bs1_off_pdl" in text and "prefill 8x1024" in text


def test_moe_floor_counts_the_experts_a_batch_touches():
    """The MoE shape's batch-1 floor reads the dense part plus top-k experts per layer (Qwen3-30B-A3B runs about
    3B of its 30B parameters a token), and a large batch approaches every expert."""
    from benchmarks.gpu.common import MODELS, model_bytes, weight_bytes_at

    dense = model_bytes(MODELS["qwen3-8b"]["config"], 2)
    assert weight_bytes_at(dense, 64) == weight_bytes_at(dense, 1) == dense["weight_bytes"]
    moe = model_bytes(MODELS["qwen3-30b-a3b"]["config"], 2)
    assert 2.9e9 < moe["read_params"] < 3.3e9
    assert weight_bytes_at(moe, 1) == pytest.approx(moe["weight_bytes"])
    every_expert = moe["weight_bytes"] + moe["layers"] * (moe["experts"] - moe["top_k"]) * moe["expert_bytes"]
    assert weight_bytes_at(moe, 1) < weight_bytes_at(moe, 8) < weight_bytes_at(moe, 256) <= every_expert
    assert weight_bytes_at(moe, 4096) == pytest.approx(every_expert)
