"""SGLangLM sends the DSPy program's session without user code: every call inside one run of a module (on one
thread) carries the same session id, so the engine pins the program's KV between its steps."""

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

    def program_sessions() -> set[str]:  # this test's: other modules' programs on the engine may still hold pins
        return {s for s in pins.pins if s.startswith("dspy:")} - earlier

    earlier = {s for s in pins.pins if s.startswith("dspy:")}
    before = smollm_engine.get_stats()["session_pins_taken"]
    with dspy.context(lm=lm):
        TwoStep()(question="What is 2 + 2?")
        assert smollm_engine.get_stats()["session_pins_taken"] == before + 2
        sessions = program_sessions()
        assert len(sessions) == 1  # both steps: one program, one session
        # (ended now: the adaptive time to live, twice the short gap between the steps, may pass during the rest)
        assert smollm_engine.end_session(sessions.pop()) is True
        lm("Outside any module.")  # no program: no session, no pin
        assert smollm_engine.get_stats()["session_pins_taken"] == before + 2
        fixed = SGLangLM(runtime=smollm_engine, max_tokens=4, cache=False, session_id="mine")
        fixed("Hi.")
        assert "mine" in pins.pins and smollm_engine.get_stats()["session_pins_taken"] == before + 3
        off = SGLangLM(runtime=smollm_engine, max_tokens=4, cache=False, auto_session=False)
        with dspy.context(lm=off):
            TwoStep()(question="What is 3 + 3?")
    assert smollm_engine.get_stats()["session_pins_taken"] == before + 3
    smollm_engine.end_session("mine")  # (or its time to live passed already)
    assert not program_sessions()
