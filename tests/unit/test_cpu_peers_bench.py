"""benchmarks/peers/cpu.py: the metrics, medians, ratios and report on fake numbers (no llama.cpp, no engine)."""

from __future__ import annotations

import math

import pytest

from benchmarks.peers import cpu


def test_stream_metrics_decode_rate_excludes_the_first_token():
    m = cpu.stream_metrics(10.0, [10.5, 10.6, 10.7, 10.9])
    assert m["ttft_s"] == pytest.approx(0.5)
    assert m["decode_tok_per_s"] == pytest.approx(3 / 0.4)
    assert m["n_out"] == 4
    assert cpu.stream_metrics(0.0, [1.0])["decode_tok_per_s"] is None


def test_completion_metrics():
    m = cpu.completion_metrics(0.0, [1.0, 2.0, 4.0], n_new=8)
    assert m["wall_s"] == 4.0
    assert m["requests_per_s"] == pytest.approx(0.75)
    assert m["output_tok_per_s"] == pytest.approx(6.0)
    assert m["p50_completion_s"] == 2.0


def test_well_formed():
    assert cpu.well_formed([[1, 2], [3, 4]], 2, 2, vocab=5)
    assert not cpu.well_formed([[1, 2], [3]], 2, 2, vocab=5)
    assert not cpu.well_formed([[1, 5], [3, 4]], 2, 2, vocab=5)
    assert not cpu.well_formed([[1, 2]], 2, 2, vocab=5)


def test_parse_kv():
    assert cpu.parse_kv(["a=1", "b=0.5", "c=true", "quantization=none", "max-total-tokens=4096"]) == dict(
        a=1, b=0.5, c=True, quantization="none", max_total_tokens=4096)
    with pytest.raises(SystemExit):
        cpu.parse_kv(["novalue"])


def fake_result() -> dict:
    ours = {"decode1": [dict(decode_tok_per_s=v, ttft_s=0.1, well_formed=True, first_ids=[1, 2])
                        for v in (90, 100, 80)],
            "batch16": [dict(output_tok_per_s=v, well_formed=True) for v in (400, 300, 500)],
            "shared_prefix": [dict(requests_per_s=v, p50_completion_s=2.0, well_formed=True) for v in (4, 5, 6)]}
    llama = {"decode1": [dict(decode_tok_per_s=v, ttft_s=0.2, well_formed=True, first_ids=[1, 3])
                         for v in (50, 40, 60)],
             "batch16": [dict(output_tok_per_s=v, well_formed=True) for v in (200, 200, 200)],
             "shared_prefix": [{"sequential": dict(requests_per_s=v, p50_completion_s=3.0, well_formed=True),
                                "batched": dict(requests_per_s=v + 1, p50_completion_s=1.0, well_formed=True)}
                               for v in (1, 2, 3)]}
    sections = {}
    for s in cpu.SECTIONS:
        sections[s] = cpu.summarize_section(s, ours[s], llama[s])
        sections[s]["params"] = {"n_new": 8}
    sections["decode1"]["first_ids"] = cpu.first_ids_check({"ours": ours["decode1"], "llamacpp": llama["decode1"]})
    return dict(model="m", date="2026-01-01 00:00", smoke=True, rounds=3, sections=sections,
                machine=dict(cpu_model="cpu", threads=2, cpus_allowed=2),
                versions=dict(ours="abc", llama_cpp="0.3.36", torch="2"))


def test_summary_medians_ratios_and_best_llamacpp_variant():
    r = fake_result()
    d1, b16, sp = (r["sections"][s] for s in cpu.SECTIONS)
    assert d1["ours"]["median"]["decode_tok_per_s"] == 90
    assert d1["llamacpp"]["median"]["decode_tok_per_s"] == 50
    assert d1["ratio_ours_over_llamacpp"]["decode_tok_per_s"] == pytest.approx(1.8)
    assert d1["ours"]["median"]["well_formed"] is True
    assert "first_ids" not in d1["ours"]["median"]  # lists are raw data, not medians
    assert b16["ratio_ours_over_llamacpp"]["output_tok_per_s"] == pytest.approx(2.0)
    assert sp["llamacpp"]["variant"] == "batched"
    assert sp["llamacpp"]["median"]["requests_per_s"] == 3
    assert sp["ratio_ours_over_llamacpp"]["requests_per_s"] == pytest.approx(5 / 3)
    assert set(sp["llamacpp"]["variants"]) == {"sequential", "batched"}
    assert r["sections"]["decode1"]["first_ids"] == dict(equal=False, first_diff=1, ours=[1, 2], llamacpp=[1, 3])


def test_markdown_and_png(tmp_path):
    r = fake_result()
    md = cpu.render_markdown(r)
    assert "| workload | ours | llama.cpp | ours / llama.cpp |" in md
    assert "| decode1: decode tok/s, batch 1 | 90 | 50 | 1.800 |" in md
    assert "(batched)" in md
    rows = cpu.table_rows(r)
    assert len(rows) == len(cpu.ROWS) and all(math.isfinite(x["ratio"]) for x in rows)
    cpu.plot(r, str(tmp_path / "x.png"))
    assert (tmp_path / "x.png").stat().st_size > 1000
