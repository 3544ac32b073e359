"""benchmarks/programs/dspy_agents.py: the DSPy agent loop the benchmark runs (with DSPy's DummyLM, no server)."""

from __future__ import annotations

import pytest

dspy = pytest.importorskip("dspy")

from benchmarks.programs import dspy_agents  # noqa: E402


def test_agent_calls_the_lm_once_per_step_and_carries_every_observation():
    answers = [{"thought": f"think {k}", "action": f"act {k}"} for k in range(3)]
    lm = dspy.utils.DummyLM(answers)
    seen = []

    def tool(k):
        seen.append(k)
        return f"observation {k}"

    with dspy.context(lm=lm):
        out = dspy_agents.make_agent_class(dspy)()(task="a task", tool=tool, steps=3)
    assert seen == [0, 1, 2] and len(lm.history) == 3
    assert out.history.splitlines() == ["Step 1: think 0 Action: act 0", "Observation: observation 0",
                                        "Step 2: think 1 Action: act 1", "Observation: observation 1",
                                        "Step 3: think 2 Action: act 2", "Observation: observation 2"]
    # each call re-sends the history so far: the last call's prompt holds the first two observations
    last = str(lm.history[-1]["messages"])
    assert "observation 0" in last and "observation 1" in last and "observation 2" not in last


def test_routes_and_arguments():
    assert set(dspy_agents.ROUTES) == {"sglang", "sglang_no_tier", "sglang_radix_only", "openai"}
    with pytest.raises(SystemExit):
        dspy_agents.main(["--routes", "nope"])


def test_rounds_rotate_and_variants_are_summarised_against_the_base():
    from benchmarks.common import rotated, variant_medians

    assert [rotated(["a", "b", "c"], r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]
    runs = [dict(v="base", t=10.0, rate=1.0), dict(v="base", t=30.0, rate=3.0), dict(v="fast", t=5.0, rate=4.0)]
    s = variant_medians(runs, "v", ["base", "fast"], ("t", "rate"), "base", "t", "rate")
    assert s["base"] == {"t": 20.0, "rate": 2.0, "p50_speedup_over_base": 1.0, "throughput_over_base": 1.0}
    assert s["fast"]["p50_speedup_over_base"] == 4.0 and s["fast"]["throughput_over_base"] == 2.0
    assert "p50_speedup_over_base" not in variant_medians(runs, "v", ["fast"], ("t", "rate"), "base", "t", "rate")["fast"]
