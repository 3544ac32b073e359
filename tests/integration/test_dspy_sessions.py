"""SGLangLM sends the DSPy program's session without user code: every call inside one run of the outermost module
carries the same session id, so the engine pins the program's KV between its steps; the next run of the same module
is another session, and a run's session ends (its pin released) when the run returns."""

from __future__ import annotations

import pytest

dspy = pytest.importorskip("dspy")

from sglang_dspy import SGLangLM  # noqa: E402


class TwoStep(dspy.Module):
    """A two-step program: the second call's prompt repeats the first's question."""

    def __init__(self):
        super().__init__()
        self.first = dspy.Predict("question -> answer")
        self.second = dspy.Predict("question, draft -> answer")

    def forward(self, question):
        draft = self.first(question=question).answer
        return self.second(question=question, draft=draft)


def test_calls_inside_a_program_share_a_session(smollm_engine):
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    lm = SGLangLM(runtime=smollm_engine, max_tokens=12, cache=False, max_string_length=20)
    pins = smollm_engine.scheduler.session_pins
    seen: list[set[str]] = []

    class Watched(TwoStep):
        def forward(self, question):  # the pins of this run while it runs (its first step done)
            draft = self.first(question=question).answer
            seen.append({s for s in pins.pins if s.startswith("dspy:")} - earlier)
            return self.second(question=question, draft=draft)

    earlier = {s for s in pins.pins if s.startswith("dspy:")}
    before = smollm_engine.get_stats()
    program = Watched()
    with dspy.context(lm=lm):
        program(question="What is 2 + 2?")
        program(question="What is 3 + 3?")  # the same module again: another run, another session
        stats = smollm_engine.get_stats()
        assert stats["session_pins_taken"] == before["session_pins_taken"] + 4
        assert len(seen) == 2 and all(len(s) == 1 for s in seen) and seen[0] != seen[1]
        # each run's session ended when the run returned: its pin released at once, not at its time to live
        assert stats["session_pins_ended"] == before["session_pins_ended"] + 2
        assert not ({s for s in pins.pins if s.startswith("dspy:")} - earlier)
        lm("Outside any module.")  # no program: no session, no pin
        assert smollm_engine.get_stats()["session_pins_taken"] == before["session_pins_taken"] + 4
        fixed = SGLangLM(runtime=smollm_engine, max_tokens=4, cache=False, session_id="mine")
        fixed("Hi.")
        assert "mine" in pins.pins and smollm_engine.get_stats()["session_pins_taken"] == before["session_pins_taken"] + 5
        off = SGLangLM(runtime=smollm_engine, max_tokens=4, cache=False, auto_session=False)
        with dspy.context(lm=off):
            TwoStep()(question="What is 3 + 3?")
    assert smollm_engine.get_stats()["session_pins_taken"] == before["session_pins_taken"] + 5
    smollm_engine.end_session("mine")  # (or its time to live passed already)


def test_a_program_run_on_worker_threads_is_one_session_per_example(smollm_engine):
    """``Evaluate`` runs examples on a thread pool: each example is its own run and session, ended after it."""
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    lm = SGLangLM(runtime=smollm_engine, max_tokens=8, cache=False, max_string_length=12)
    before = smollm_engine.get_stats()
    devset = [dspy.Example(question=f"What is {i} + {i}?", answer=str(2 * i)).with_inputs("question")
              for i in range(4)]
    with dspy.context(lm=lm):
        dspy.Evaluate(devset=devset, metric=lambda e, p, trace=None: 0.0, num_threads=2,
                      display_progress=False)(dspy.Predict("question -> answer"))
    stats = smollm_engine.get_stats()
    assert stats["session_pins_taken"] - before["session_pins_taken"] == 4
    assert stats["session_pins_ended"] - before["session_pins_ended"] == 4
    assert not any(s.startswith("dspy:") for s in smollm_engine.scheduler.session_pins.pins)


def test_the_program_runs_callback_survives_copies_and_pickles_of_dspy_settings():
    import copy
    import pickle

    from sglang_dspy import lm as lm_module

    lm_module._install_program_runs()
    runs = lm_module._PROGRAM_RUNS
    assert runs in dspy.settings.callbacks
    assert copy.deepcopy(runs) is runs and pickle.loads(pickle.dumps(runs)) is runs
    assert copy.deepcopy(dspy.settings.callbacks)[-1] is runs
