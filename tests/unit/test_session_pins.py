"""Session pins (mem_cache/session_pins.py): a finished request's KV stays locked for its session's next call,
until its time to live, the session's end, or memory need; bounded; the pool is whole once they go."""

from __future__ import annotations

import random
import time
import types

import pytest

from tests.unit.test_scheduler import assets, drain, new_req, rand_ids  # noqa: F401 - assets: a fixture
from tests.unit.test_scheduler import make_sched as any_sched  # noqa: F401 - a fixture (pool whole afterwards)


@pytest.fixture
def make_sched(any_sched):
    """Schedulers on the tiny model; every test ends its sessions, so nothing may stay pinned afterwards."""
    made = []

    def make(**kwargs):
        made.append(any_sched(**kwargs))
        return made[-1]

    yield make
    for sched in made:
        assert sched.session_pins is None or not sched.session_pins.pins


def run(sched, rid: str, ids: list[int], session_id: str | None = None, **params):
    req = new_req(sched, rid, ids, max_new_tokens=params.pop("max_new_tokens", 4), ignore_eos=True, **params)
    req.session_id = session_id
    sched.add_request(req)
    drain(sched)
    return req


def fill_pool(sched, rng, n: int, length: int) -> None:
    """n unrelated requests that need the pool's memory: LRU eviction takes whatever is not locked."""
    for i in range(n):
        run(sched, f"filler{i}", rand_ids(rng, length))


def test_pinned_session_prefix_survives_pressure_that_evicts_an_unpinned_one(make_sched):
    rng = random.Random(0)
    pinned_prompt, plain_prompt = rand_ids(rng, 60), rand_ids(rng, 60)
    sched = make_sched(max_total_tokens=256, session_ttl=60)
    first = run(sched, "a1", pinned_prompt, session_id="agent")
    run(sched, "b1", plain_prompt)
    stats = sched.get_stats()
    # 60 prompt + 4 output tokens; the last output token has no KV (it was never an input)
    assert stats["session_pinned_sessions"] == 1 and stats["session_pinned_tokens"] == 63
    fill_pool(sched, rng, 6, 100)  # 6 x 104 tokens through a 256-token pool
    assert sched.tree_cache.num_evicted_tokens > 0
    # The agent's next call extends its previous sequence: all of it is still cached; the plain one's is gone.
    again = run(sched, "a2", first.all_ids + rand_ids(rng, 8), session_id="agent")
    plain = run(sched, "b2", plain_prompt + rand_ids(rng, 8))
    assert again.cached_tokens == 63
    assert plain.cached_tokens < 60
    assert sched.get_stats()["session_reused_tokens"] == 63
    assert sched.handle_control("end_session", "agent") is True
    assert sched.get_stats()["session_pinned_tokens"] == 0


def test_pin_moves_to_the_sessions_latest_sequence(make_sched):
    rng = random.Random(1)
    sched = make_sched(max_total_tokens=1024, session_ttl=60)
    first = run(sched, "t1", rand_ids(rng, 20), session_id="chat")
    second = run(sched, "t2", first.all_ids + rand_ids(rng, 10), session_id="chat")
    assert sched.get_stats()["session_pinned_tokens"] == len(second.all_ids) - 1
    assert sched.get_stats()["session_pins_taken"] == 2
    # Only the latest sequence is locked: the tree's protected size is exactly the pin.
    assert sched.tree_cache.protected_size() == len(second.all_ids) - 1
    assert sched.handle_control("end_session", "chat") is True
    assert sched.handle_control("end_session", "chat") is False  # nothing left to end


def test_pins_expire_after_their_time_to_live(make_sched):
    rng = random.Random(2)
    sched = make_sched(max_total_tokens=1024, session_ttl=0.2)
    run(sched, "x", rand_ids(rng, 30), session_id="s")
    assert sched.get_stats()["session_pinned_sessions"] == 1
    # Pins are the one lock allowed at idle: accounted, the pool is whole; the pin is all that is locked.
    assert sched.tree_cache.protected_size() == sched.session_pins.pinned_tokens() == 33
    sched.check_pool_whole()
    time.sleep(0.3)
    stats = sched.get_stats()
    assert stats["session_pinned_sessions"] == 0 and stats["session_pins_expired"] == 1


def test_adaptive_time_to_live_follows_the_gaps(make_sched):
    rng = random.Random(3)
    sched = make_sched(max_total_tokens=1024, session_ttl_max=30)
    assert sched.session_pins.ttl() == 10.0  # no gap seen yet
    prev = run(sched, "g0", rand_ids(rng, 10), session_id="loop")
    for i in range(3):
        time.sleep(0.05)
        prev = run(sched, f"g{i + 1}", prev.all_ids + rand_ids(rng, 4), session_id="loop")
    gaps = list(sched.session_pins.gaps)
    assert len(gaps) == 3 and all(0.04 <= g < 2.0 for g in gaps)
    p90 = sorted(gaps)[int(0.9 * len(gaps))]
    assert sched.session_pins.ttl() == min(max(2 * p90, 1.0), 30.0)  # twice the gaps' p90, within [1 s, max]
    sched.session_pins.gaps.extend([100.0] * 10)  # long gaps: capped at session_ttl_max
    assert sched.session_pins.ttl() == 30.0
    sched.handle_control("end_session", "loop")


def test_pins_are_bounded_oldest_released_first(make_sched):
    rng = random.Random(4)
    sched = make_sched(max_total_tokens=400, session_ttl=60, session_pin_max_fraction=0.25)  # 100 tokens
    for name in ("s1", "s2", "s3"):
        run(sched, name, rand_ids(rng, 36), session_id=name)  # 39 tokens each
    stats = sched.get_stats()
    assert stats["session_pinned_sessions"] == 2 and stats["session_pinned_tokens"] == 78
    assert list(sched.session_pins.pins) == ["s2", "s3"] and stats["session_pins_over_bound"] == 1
    run(sched, "big", rand_ids(rng, 120), session_id="s4")  # alone past the bound: not pinned
    assert "s4" not in sched.session_pins.pins
    for name in ("s2", "s3"):
        sched.handle_control("end_session", name)


def test_waiting_request_that_needs_pinned_memory_gets_it(make_sched):
    """Pins never block the server: a request that cannot fit while nothing runs releases them (oldest first)."""
    rng = random.Random(5)
    sched = make_sched(max_total_tokens=200, session_ttl=60, session_pin_max_fraction=1.0)
    run(sched, "p1", rand_ids(rng, 76), session_id="a")
    run(sched, "p2", rand_ids(rng, 76), session_id="b")
    assert sched.get_stats()["session_pinned_tokens"] == 158
    big = run(sched, "big", rand_ids(rng, 100), max_new_tokens=8)
    assert big.finished_reason["type"] == "length" and len(big.output_ids) == 8
    stats = sched.get_stats()
    assert stats["session_pins_released_for_memory"] >= 1 and list(sched.session_pins.pins) in (["b"], [])
    for name in list(sched.session_pins.pins):
        sched.handle_control("end_session", name)


def test_aborted_and_sessionless_requests_take_no_pin(make_sched):
    rng = random.Random(6)
    sched = make_sched(max_total_tokens=1024, session_ttl=60)
    run(sched, "plain", rand_ids(rng, 20))
    req = new_req(sched, "gone", rand_ids(rng, 20), max_new_tokens=50, ignore_eos=True)
    req.session_id = "s"
    sched.add_request(req)
    sched.step()
    assert sched.abort_request("gone") is not None
    drain(sched)
    assert sched.get_stats()["session_pins_taken"] == 0


def test_no_pins_without_a_tree_or_with_ttl_zero(make_sched):
    rng = random.Random(7)
    for kwargs in (dict(disable_radix_cache=True), dict(session_ttl=0)):
        sched = make_sched(max_total_tokens=1024, **kwargs)
        assert sched.session_pins is None
        run(sched, "r", rand_ids(rng, 20), session_id="s")
        assert "session_pinned_tokens" not in sched.get_stats()
        assert sched.handle_control("end_session", "s") is False


def test_flush_forgets_pins(make_sched):
    rng = random.Random(8)
    sched = make_sched(max_total_tokens=1024, session_ttl=60)
    run(sched, "r", rand_ids(rng, 20), session_id="s")
    assert sched.flush_cache()
    assert sched.get_stats()["session_pinned_sessions"] == 0


def test_a_chunked_prompt_that_meets_pinned_memory_mid_way_gets_it(make_sched):
    """As above with the prompt chunked: the first chunks fit beside the pins, a later one does not; the pins
    are released for it (the loop does not die with 'out of KV memory')."""
    rng = random.Random(15)
    sched = make_sched(max_total_tokens=200, session_ttl=60, session_pin_max_fraction=1.0, chunked_prefill_size=16)
    run(sched, "p1", rand_ids(rng, 76), session_id="a")
    run(sched, "p2", rand_ids(rng, 76), session_id="b")
    assert sched.get_stats()["session_pinned_tokens"] == 158
    big = run(sched, "big", rand_ids(rng, 100), max_new_tokens=8)
    assert big.finished_reason["type"] == "length" and len(big.output_ids) == 8
    assert sched.get_stats()["session_pins_released_for_memory"] >= 1
    for name in list(sched.session_pins.pins):
        sched.handle_control("end_session", name)


def test_gaps_longer_than_the_time_to_live_still_raise_it():
    """An agent's fast model-to-model steps and slow tool calls: the slow gaps outlast the pins (which expire),
    yet are measured, so the adaptive time to live grows to cover them instead of staying at the 1 s floor."""
    from sglang_backend.runtime.mem_cache.session_pins import MIN_TTL_S, SessionPins

    class Tree:  # the lock calls SessionPins makes, counted
        root_node = object()
        locks = 0

        def inc_lock_ref(self, node):
            Tree.locks += 1

        def dec_lock_ref(self, node):
            Tree.locks -= 1

    now = [0.0]
    pins = SessionPins(Tree(), max_tokens=1000, ttl=None, ttl_max=60.0, clock=lambda: now[0])
    node = types.SimpleNamespace(value=[0] * 10, parent=Tree.root_node)
    for step in range(10):
        pins.on_arrival("agent")
        now[0] += 0.1  # the model call
        pins.pin("agent", node, 10)
        gap = 6.0 if step % 3 == 2 else 0.05  # every third gap is a slow tool call
        now[0] += gap
        pins.expire()
        if gap > pins.ttl():
            assert "agent" not in pins.pins  # expired while the tool ran
    assert max(pins.gaps) == 6.0  # the slow gaps were measured although their pins had gone
    assert pins.ttl() == 12.0 > MIN_TTL_S  # twice the p90
    pins.end("agent")
    pins.on_arrival("agent")  # an ended session starts afresh: no gap from before its end
    assert len(pins.gaps) == 9 and Tree.locks == 0


def test_a_session_whose_calls_only_share_a_prefix_pins_only_that_prefix(make_sched):
    """An ``Evaluate`` thread: each call = the same demos + a new example. Pinning a whole call would hold KV the next
    call never reads; after a call reuses only the demos, the session's pins hold just them, until a call extends
    its predecessor again."""
    rng = random.Random(4)
    demos = rand_ids(rng, 40)
    sched = make_sched(max_total_tokens=512, session_ttl=60)
    first = run(sched, "e1", demos + rand_ids(rng, 20), session_id="eval")
    assert sched.session_pins.pins["eval"].tokens == 63  # the whole first call (the last output token has no KV)
    second = run(sched, "e2", demos + rand_ids(rng, 20), session_id="eval")
    assert second.cached_tokens == 40 and sched.session_pins.pins["eval"].tokens == 40  # the demos only
    again = run(sched, "e3", demos + rand_ids(rng, 20), session_id="eval")  # the demos again: the pin stays cut
    assert again.cached_tokens == 40 and sched.session_pins.pins["eval"].tokens == 40
    third = run(sched, "e4", again.all_ids + rand_ids(rng, 5), session_id="eval")  # a call that extends: whole pins
    assert third.cached_tokens == 63 and sched.session_pins.pins["eval"].tokens == len(third.all_ids) - 1
    assert first.output_ids and sched.handle_control("end_session", "eval") is True
