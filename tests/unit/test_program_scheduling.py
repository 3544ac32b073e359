"""Program-level scheduling (managers/program_service.py): waiting requests of programs served least go first, the
cache-aware order decides within a level, the starvation bound still holds, and a program's end forgets it."""

from __future__ import annotations

import random

import pytest

from sglang_backend.runtime.managers import program_service
from sglang_backend.runtime.managers.program_service import ProgramService
from tests.unit.test_scheduler import assets, drain, make_sched, new_req, rand_ids  # noqa: F401 - fixtures


class Waiting:
    def __init__(self, name: str, session_id: str | None):
        self.name, self.session_id = name, session_id


def test_levels_double_from_the_quantum_and_a_request_without_a_program_is_new():
    svc = ProgramService(quantum=100)
    for served, level in [(0, 0), (99, 0), (100, 1), (199, 1), (200, 2), (399, 2), (400, 3), (1600, 5)]:
        svc.attained["p"] = served
        assert svc.level("p") == level, served
    assert svc.level(None) == 0 and svc.level("never seen") == 0
    svc.charge(None, 500)
    svc.charge("q", 0)
    assert "q" not in svc.attained and None not in svc.attained
    svc.charge("q", 60)
    svc.charge("q", 60)
    assert svc.attained["q"] == 120 and svc.level("q") == 1
    svc.end("q")
    assert svc.level("q") == 0 and "q" not in svc.attained


def test_programs_are_forgotten_least_recently_charged_first(monkeypatch):
    monkeypatch.setattr(program_service, "MAX_PROGRAMS", 3)
    svc = ProgramService(quantum=10)
    for name in "abc":
        svc.charge(name, 10)
    svc.charge("a", 10)  # a is now the most recent
    svc.charge("d", 10)
    assert list(svc.attained) == ["c", "a", "d"]


def test_prioritise_is_stable_within_a_level_and_counts_only_rounds_it_changed():
    svc = ProgramService(quantum=100)
    order = [Waiting("old1", "old"), Waiting("new1", "new"), Waiting("old2", "old"), Waiting("none", None),
             Waiting("new2", "new")]
    assert svc.prioritise(order) is order  # nobody served yet: the policy's order as is
    svc.charge("old", 250)  # level 2
    svc.charge("new", 50)  # level 0
    assert [w.name for w in svc.prioritise(order)] == ["new1", "none", "new2", "old1", "old2"]
    assert svc.stats.num_priority_rounds == 1
    already = [Waiting("new1", "new"), Waiting("old1", "old")]
    assert svc.prioritise(already) == already and svc.stats.num_priority_rounds == 1


def run(sched, rid: str, ids: list[int], session_id: str | None = None, max_new_tokens: int = 4):
    req = new_req(sched, rid, ids, max_new_tokens=max_new_tokens, ignore_eos=True)
    req.session_id = session_id
    sched.add_request(req)
    return req


def admitted_first(sched, reqs) -> str:
    """Steps once (one prefill batch with room for one request) and returns which of ``reqs`` it admitted."""
    sched.step()
    running = [r.rid for r in reqs if r in sched.running or r.finished()]
    assert len(running) == 1, running
    return running[0]


@pytest.mark.parametrize("program_scheduling", ["attained", "off"])
def test_a_fresh_program_goes_before_a_long_one_whose_prefix_is_cached(make_sched, program_scheduling):
    rng = random.Random(0)
    sched = make_sched(max_total_tokens=1024, max_running_requests=1, program_service_quantum=64, session_ttl=0,
                       program_scheduling=program_scheduling)
    first = run(sched, "long-1", rand_ids(rng, 100), session_id="long")
    drain(sched)
    # The long program's next call: 103 tokens cached (LPM's first pick, and the first to arrive); a new program's
    # call has nothing cached.
    again = run(sched, "long-2", first.all_ids + rand_ids(rng, 8), session_id="long")
    fresh = run(sched, "short-1", rand_ids(rng, 40), session_id="short")
    expect = "short-1" if program_scheduling == "attained" else "long-2"
    assert admitted_first(sched, [again, fresh]) == expect
    drain(sched)
    assert again.cached_tokens == 103 and fresh.output_ids and again.output_ids
    if program_scheduling == "attained":
        stats = sched.get_stats()
        assert stats["program_priority_rounds"] >= 1 and stats["program_tracked"] == 2
        # the long program: 100 prompt + 4 out, then 112 - 103 uncached prompt tokens (the 8 new ones, and the first
        # call's last output token, which had no KV) + 4 out
        assert sched.programs.attained["long"] == 104 + (112 - 103) + 4
        sched.handle_control("end_session", "long")
        assert sched.programs.level("long") == 0 and "long" not in sched.programs.attained
    else:
        assert sched.programs is None and "program_priority_rounds" not in sched.get_stats()


def test_the_starvation_bound_holds_over_program_levels(make_sched):
    rng = random.Random(1)
    sched = make_sched(max_total_tokens=2048, max_running_requests=1, program_service_quantum=16, session_ttl=0,
                       starvation_limit=2)
    drain_first = run(sched, "long-1", rand_ids(rng, 40), session_id="long")
    drain(sched)
    waiting = [run(sched, "long-2", drain_first.all_ids + rand_ids(rng, 4), session_id="long")]
    waiting += [run(sched, f"new-{i}", rand_ids(rng, 20), session_id=f"new-{i}") for i in range(6)]
    order = []
    while sched.has_work():
        sched.step()
        for r in sched.running:
            if r.rid not in order:
                order.append(r.rid)
        for r in waiting:
            if r.finished() and r.rid not in order:
                order.append(r.rid)
    # passed over twice, it goes first on the third prefill round, before four newer programs
    assert order.index("long-2") == 2, order


def test_program_scheduling_knobs_are_checked():
    from sglang_backend.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="program_scheduling"):
        ServerArgs(program_scheduling="fair")
    with pytest.raises(ValueError, match="program_service_quantum"):
        ServerArgs(program_service_quantum=0)
