"""The engine-vs-HF benchmark runs end to end in smoke mode (tiny dummy model) and writes sane JSON."""

from __future__ import annotations

import json
import math
import time

import pytest

from benchmarks import bench_engine_vs_hf as bench
from benchmarks.common import Timer, format_table, summarize, write_json


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_smoke_run_writes_well_formed_json(tmp_path, capsys):
    out = tmp_path / "results" / "engine_vs_hf_smoke.json"
    returned = bench.main(["--smoke", "--no-progress", "--output", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned, default=str))

    cfg = data["config"]
    assert cfg["smoke"] is True
    assert cfg["batch_sizes"] == [1, 2] and cfg["input_len"] == 8 and cfg["output_len"] == 8 and cfg["repeats"] == 1
    assert data["env"]["cpu_count"] >= 1 and data["env"]["torch"]

    assert [r["batch_size"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        for system in ("ours", "hf"):
            m = r[system]
            assert m["total_s"]["n"] == 1 and _positive(m["total_s"]["median"])
            assert _positive(m["ttft_s"]["median"])
            assert _positive(m["tokens_per_s"])
            expected = r["batch_size"] * cfg["output_len"] / m["total_s"]["median"]
            assert math.isclose(m["tokens_per_s"], expected, rel_tol=1e-9)
        for key in ("tokens_per_s", "ttft"):
            assert _positive(r["ratios"][key]), (key, r["ratios"])
        assert r["ratios"]["decode_tokens_per_s"] is None or _positive(r["ratios"]["decode_tokens_per_s"])
        assert r["correctness"]["outputs_match"] is True, r["correctness"]
        assert r["correctness"]["same_rule"]["num_rows"] == r["batch_size"]
        assert "timed_ignore_eos_vs_hf" in r["correctness"]
    assert set(data["ratios"]) == {"1", "2"}
    assert data["outputs_match"] is True
    assert data["ours_cached_tokens"] == 0  # distinct prompts + flush between runs: no radix reuse

    printed = capsys.readouterr().out
    assert "ours tok/s" in printed and "HF tok/s" in printed


def test_prompts_are_exact_length_distinct_and_seeded():
    ids = list(range(10, 500))
    a = bench.make_prompts(16, 64, ids, seed=3)
    assert a == bench.make_prompts(16, 64, ids, seed=3)
    assert a != bench.make_prompts(16, 64, ids, seed=4)
    assert all(len(p) == 64 for p in a)
    assert len({p[0] for p in a}) == 16  # no two prompts share a prefix
    assert all(t in set(ids) for p in a for t in p)


def test_compare_outputs_flags_eos_splits():
    same = bench.compare_outputs([[5, 6], [7, 8]], [[5, 6], [7, 8]], eos_ids={2})
    assert same["outputs_match"] and same["num_mismatched_rows"] == 0
    diff = bench.compare_outputs([[5, 2], [7, 8]], [[5, 9], [7, 8]], eos_ids={2})
    assert not diff["outputs_match"] and diff["num_mismatched_rows"] == 1
    assert diff["mismatches"][0] == {"row": 0, "position": 1, "ours": 2, "hf": 9, "ours_token_is_eos": True}


def test_common_helpers(tmp_path):
    with Timer() as t:
        time.sleep(0.02)
    assert 0.02 <= t.elapsed < 1.0, t.elapsed
    with pytest.raises(RuntimeError, match="before start"):
        Timer().stop()
    s = summarize([3.0, 1.0, 2.0])
    assert s["median"] == 2.0 and s["min"] == 1.0 and s["max"] == 3.0 and s["n"] == 3
    path = write_json({"a": 1}, str(tmp_path / "x" / "y.json"))
    assert json.loads(open(path).read()) == {"a": 1}
    table = format_table(["a", "b"], [[1, 2.5], [None, 1234.5]])
    assert "2.500" in table and "-" in table and "1234.5" in table
