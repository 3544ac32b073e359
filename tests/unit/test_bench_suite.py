"""The benchmark suite (issue 8): ``bench all --smoke`` runs every workload under every baseline on a tiny
dummy model and reports well-formed numbers; the table-cache ("no tree") ablation reuses only whole entries."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from benchmarks.suite.main import main

    out = tmp_path_factory.mktemp("suite")
    rows = main(["all", "--smoke", "--output", str(out), "--no-progress"])
    return out, rows


def test_every_workload_runs_and_reports(smoke):
    from benchmarks.suite import workloads

    out, rows = smoke
    meta = json.loads((out / "meta.json").read_text())
    ran = {r["workload"] for r in rows}
    # Every workload ran, or (DSPy only) was skipped with its reason.
    assert ran | set(meta["skipped"]) == set(workloads.NAMES)
    assert set(meta["skipped"]) <= {"dspy_rag"}
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)
    for r in rows:
        where = (r["workload"], r["baseline"], r["mode"])
        assert r["errors"] == 0 and r["completed"] == r["programs"] > 0, (where, r["first_error"])
        assert r["programs_per_s"] > 0 and r["latency_s_mean"] > 0, where
        if r["hit_rate"] is None:  # the HF peer has no cache
            assert r["baseline"].startswith("hf_")
            continue
        assert 0.0 <= r["hit_rate"] <= 1.0 and 0.0 <= r["optimal_hit_rate"] <= 1.0, where
        assert r["optimal_hit_rate"] >= r["hit_rate"] - 1e-9, where
        if r["baseline"] == "no_cache":
            assert r["hit_rate"] == 0.0, where
    baselines = {r["baseline"] for r in rows}
    assert baselines == {"full", "no_cache", "no_tree", "fcfs", "random", "no_frontend_parallel", "no_hints",
                         "no_jump_forward", "hf_sequential", "hf_batched"}
    by = {(r["workload"], r["baseline"], r["mode"]): r for r in rows}
    # The shared prefixes are found: the full system hits on every workload with reuse.
    for w in ran:
        assert by[(w, "full", "throughput")]["hit_rate"] > 0.2, w
    # Jump-forward appends forced JSON text without a forward pass per token.
    assert by[("json_decode", "full", "throughput")]["num_jump_forward"] > 0
    assert by[("json_decode", "no_jump_forward", "throughput")]["num_jump_forward"] == 0
    if importlib.util.find_spec("matplotlib") is not None:  # the test extra pins it; plots are optional
        for png in ("fig5_throughput.png", "fig6_latency.png", "fig8c_ablation.png", "fig13_hit_rate.png"):
            assert (out / png).stat().st_size > 1000, png
    assert "speedup" in (out / "summary.md").read_text()


def test_bench_cli_lists_workloads(capsys):
    from benchmarks.suite import workloads
    from sglang_backend.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in workloads.NAMES)
    with pytest.raises(ValueError, match="unknown workload"):
        main(["bench", "no_such_workload", "--smoke"])


def test_table_cache_reuses_only_whole_entries(tiny_gqa_dir):
    from sglang_backend import Engine

    rng = random.Random(0)
    header = [rng.randrange(10, 500) for _ in range(60)]
    sp = {"max_new_tokens": 4, "ignore_eos": True}
    engine = Engine(model_path=tiny_gqa_dir, table_cache=True, check_pool_on_idle=True, max_total_tokens=4000)
    try:
        first = engine.generate(input_ids=header + [7] * 20, sampling_params=sp)
        # Shares the 60-token header with the cached entry, but not the whole entry: nothing reused.
        other = engine.generate(input_ids=header + [9] * 20, sampling_params=sp)
        assert other["meta_info"]["cached_tokens"] == 0
        # The next turn contains the whole first sequence (prompt + output): all of it is reused.
        turn2 = header + [7] * 20 + first["output_ids"] + [5] * 10
        assert engine.generate(input_ids=turn2, sampling_params=sp)["meta_info"]["cached_tokens"] == 83
        # A header sent alone (a prefix hint) becomes an entry: later prompts reuse it whole.
        engine.generate(input_ids=header, sampling_params={"max_new_tokens": 0})
        assert engine.generate(input_ids=header + [11] * 5, sampling_params=sp)["meta_info"]["cached_tokens"] == 60
        # Under memory pressure entries are evicted and the pool stays whole.
        engine.generate(input_ids=[[rng.randrange(10, 500) for _ in range(300)] for _ in range(30)], sampling_params=sp)
        assert engine.get_stats()["num_evicted_tokens"] > 0
        engine.scheduler.tree_cache.check_invariants()
        engine.check_pool_whole()
    finally:
        engine.shutdown()


def test_optimal_hit_rate_credits_decoded_tokens():
    from sglang_backend.runtime.managers.schedule_policy import optimal_hit_rate

    # Turn 2 = turn 1's prompt + its answer (all but the last answer token have KV from decoding) + a new token.
    turn1, answer, turn2 = [1, 2, 3], [4, 5, 6], [1, 2, 3, 4, 5, 9]
    assert optimal_hit_rate([(None, turn1), (None, turn2)]) == pytest.approx(1 - 6 / 9)
    assert optimal_hit_rate([(None, turn1, answer), (None, turn2, [7])]) == pytest.approx(1 - 4 / 9)
    # The last generated token (6) was never fed back: a prompt containing it must compute it.
    assert optimal_hit_rate([(None, turn1, answer), (None, [1, 2, 3, 4, 5, 6], [])]) == pytest.approx(1 - 4 / 9)
    # Decoded tokens of another namespace are not shared.
    assert optimal_hit_rate([(None, turn1, answer), ("other", turn2, [])]) == pytest.approx(0.0)
