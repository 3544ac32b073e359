"""The second KV tier (mem_cache/host_pool.py, RadixCache with ``host=``): evicted KV is copied to host memory and
kept in the tree, a later hit copies it back bit-identical instead of computing it, the host evicts its least
recently used copies when full, and the scheduler gives the same greedy tokens with the tier on as without it."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_backend.runtime.mem_cache.host_pool import HostKVPool
from sglang_backend.runtime.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from sglang_backend.runtime.mem_cache.radix_cache import RadixCache
from sglang_backend.runtime.server_args import ServerArgs
from tests.unit.test_scheduler import (  # noqa: F401 - assets, make_sched, reference_outputs: fixtures
    SMALL_POOL, WORKLOAD, assets, check_variant_really_applied, make_sched, new_req, drain, rand_ids,
    reference_outputs, run_workload)

LAYERS, HEADS, DIM = 3, 2, 4


class Tiered:
    """A radix tree over a real (CPU) KV pool with a host tier; ``put`` caches a sequence whose KV is random."""

    def __init__(self, device_tokens: int, host_tokens: int, page_size: int = 1):
        self.kv = MHATokenToKVPool(device_tokens, torch.float32, HEADS, DIM, LAYERS, "cpu", page_size)
        self.alloc = TokenToKVPoolAllocator(device_tokens, page_size)
        self.host = HostKVPool(self.kv, host_tokens)
        self.tree = RadixCache(ReqToTokenPool(4, 64), self.alloc, page_size, self.host)
        self.truth: dict[tuple, torch.Tensor] = {}  # token path -> its KV (layers x K/V x tokens x heads x dim)

    def slots(self, n: int) -> torch.Tensor | None:
        short = n - self.alloc.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.alloc.alloc(n)

    def kv_at(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.stack([self.kv.k_buffer[i][slots], self.kv.v_buffer[i][slots]]) for i in range(LAYERS)])

    def put(self, ids: list[int]) -> None:
        """Caches ``ids``: matched part reused, the rest gets fresh slots holding fresh random KV."""
        match = self.tree.match_prefix(ids)
        if match.last_host_node is not None:
            assert self.tree.load_back(match.last_host_node, self.slots)
            match = self.tree.match_prefix(ids)
        have = len(match.device_indices)
        self.tree.inc_lock_ref(match.last_node)
        fresh = self.slots(len(ids) - have)
        self.tree.dec_lock_ref(match.last_node)
        for i in range(LAYERS):
            self.kv.k_buffer[i][fresh] = torch.randn(len(fresh), HEADS, DIM)
            self.kv.v_buffer[i][fresh] = torch.randn(len(fresh), HEADS, DIM)
        slots = torch.cat([match.device_indices, fresh])
        self.truth[tuple(ids)] = self.kv_at(slots).clone()
        present = self.tree.insert(ids, slots)
        assert present == have
        self.tree.check_invariants()

    def fetch(self, ids: list[int]) -> tuple[int, int]:
        """Matches ``ids``, loading a host part back; asserts the KV equals what was cached, bit for bit. Returns
        (device tokens matched before loading, host tokens loaded)."""
        match = self.tree.match_prefix(ids)
        on_device, on_host = len(match.device_indices), match.host_hit_len
        if match.last_host_node is not None:
            assert self.tree.load_back(match.last_host_node, self.slots)
            match = self.tree.match_prefix(ids)
            assert match.host_hit_len == 0 and len(match.device_indices) == on_device + on_host
        assert torch.equal(self.kv_at(match.device_indices), self.truth[tuple(ids)][:, :, : len(match.device_indices)])
        self.tree.check_invariants()
        return on_device, on_host


def test_evicted_kv_waits_in_host_memory_and_returns_bit_identical():
    t = Tiered(device_tokens=16, host_tokens=64)
    a, b = list(range(10, 22)), list(range(30, 42))
    t.put(a)
    t.put(b)  # 24 tokens through a 16-token pool: a's KV went to the host
    assert t.host.written_tokens > 0 and t.tree.num_evicted_tokens > 0
    assert t.fetch(a) == (0, 12)  # all of it from the host
    assert t.host.loaded_tokens == 12
    assert t.tree.evictable_size() + t.alloc.available_size() == 16
    assert sum(t.fetch(b)) == 12  # b's in turn made room (on the host now), still intact


def test_a_loaded_back_node_keeps_its_host_copy_so_evicting_it_again_copies_nothing():
    t = Tiered(device_tokens=16, host_tokens=64)
    a, b = list(range(10, 22)), list(range(30, 42))
    t.put(a)
    t.put(b)
    t.fetch(a)
    written = t.host.written_tokens
    t.tree.evict(16)
    assert t.host.written_tokens == written  # a went back to its host copy; b was on the host already
    assert t.fetch(a) == (0, 12)


def test_one_eviction_makes_one_host_copy_and_walks_only_the_device_part():
    """Evicting several nodes in one call copies them to the host in one transfer (not one per node, each a
    gather per layer), and finding the next device leaves never walks the host-only part of the tree."""
    t = Tiered(device_tokens=40, host_tokens=128)
    seqs = [list(range(s, s + 8)) for s in (100, 200, 300, 400)]
    for ids in seqs:
        t.put(ids)
    copies = []
    real_backup = t.host.backup
    t.host.backup = lambda device_slots, host_slots: (copies.append(len(device_slots)), real_backup(device_slots, host_slots))
    assert t.tree.evict(24) == 24  # the three least recently used sequences
    assert copies == [24]
    walked = list(t.tree._device_nodes())
    assert [n.key for n in walked] == [seqs[3]] and all(len(n.value) for n in walked)
    for ids in seqs:
        t.fetch(ids)  # bit-identical, loaded back from the host where evicted


def test_shared_prefix_split_between_tiers():
    """Two sequences sharing 8 tokens: the shared part stays on the device (the newest sequence uses it) while the
    older one's own tail sits on the host; its match is 8 on the device + 6 on the host."""
    t = Tiered(device_tokens=32, host_tokens=64)
    shared = list(range(100, 108))
    x, y, z = shared + list(range(1, 7)), shared + list(range(50, 56)), list(range(60, 74))
    t.put(x)
    t.put(y)
    t.put(z)  # evicts x's tail (LRU leaf) to the host; shared and y stay
    t.tree.evict(6)
    assert t.fetch(y)[0] >= 8
    on_device, on_host = t.fetch(x)
    assert on_device >= 8 and on_device + on_host == len(x)


def test_full_host_drops_its_least_recently_used_copies_and_their_nodes():
    t = Tiered(device_tokens=12, host_tokens=24)
    s0, s1, s2, s3 = (list(range(s, s + 12)) for s in (100, 200, 300, 400))
    for ids in (s0, s1, s2, s3):
        t.put(ids)  # each evicts the one before to the host; s3's arrival drops the oldest copy, s0's
    assert t.tree.num_host_evicted_tokens == 12
    gone = t.tree.match_prefix(s0)
    assert gone.host_hit_len == 0 and len(gone.device_indices) == 0
    # Loading s1 back evicts s3 to the host, which drops the least recently used copy left, s2's.
    assert t.fetch(s1) == (0, 12)
    assert t.tree.num_host_evicted_tokens == 24
    assert t.tree.match_prefix(s2).host_hit_len == 0
    assert t.fetch(s3) == (0, 12)


def test_inserting_over_host_only_nodes_takes_the_new_slots():
    """A request that computed tokens the host also holds (it ran without loading them) hands its slots to the
    host-only nodes: they are on the device again and the insert reports them as not yet cached there."""
    t = Tiered(device_tokens=16, host_tokens=64)
    a = list(range(10, 22))
    t.put(a)
    t.tree.evict(12)
    assert t.tree.match_prefix(a).host_hit_len == 12
    slots = t.slots(12)
    assert t.tree.insert(a, slots) == 0
    match = t.tree.match_prefix(a)
    assert torch.equal(match.device_indices, slots) and match.host_hit_len == 0
    t.tree.check_invariants()


def test_pages_of_four():
    t = Tiered(device_tokens=16, host_tokens=32, page_size=4)
    a, b = list(range(10, 22)), list(range(30, 42))
    t.put(a)
    t.put(b)
    assert t.fetch(a) == (0, 12)


def test_reset_frees_the_host():
    t = Tiered(device_tokens=16, host_tokens=64)
    t.put(list(range(10, 22)))
    t.put(list(range(30, 42)))
    t.tree.reset()
    assert t.host.available_size() == 64 and t.alloc.available_size() == 16


def test_random_workload_keeps_every_invariant():
    rng = random.Random(0)
    t = Tiered(device_tokens=48, host_tokens=40)
    stems = [[rng.randrange(3, 50) for _ in range(rng.randint(2, 10))] for _ in range(5)]
    for _ in range(120):
        ids = rng.choice(stems) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 14))]
        if tuple(ids) in t.truth and rng.random() < 0.5:
            t.fetch(ids)
        else:
            t.put(ids)
    assert t.host.loaded_tokens > 0 and t.tree.num_host_evicted_tokens > 0


class SlowCopy:
    """An asynchronous copy as an event that is done once ``finish`` is called."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def finish(self) -> None:
        self.done = True


def test_an_asynchronous_load_locks_its_path_and_flags_it_until_its_copy_is_done(monkeypatch):
    t = Tiered(device_tokens=32, host_tokens=64)
    rng = random.Random(5)
    first, other = [rng.randrange(3, 50) for _ in range(20)], [rng.randrange(3, 50) for _ in range(20)]
    t.put(first)
    t.put(other)  # evicts most of ``first`` to the host
    match = t.tree.match_prefix(first)
    assert match.host_hit_len > 0
    copy = SlowCopy()
    real_restore = t.host.restore
    monkeypatch.setattr(t.host, "restore", lambda h, d, wait=True: (real_restore(h, d), copy)[1])
    assert t.tree.load_back(match.last_host_node, t.slots, wait=False)
    loaded = t.tree.match_prefix(first)
    assert loaded.host_hit_len == 0 and len(loaded.device_indices) == 20
    assert t.tree.loading_on_path(loaded.last_node) and not t.tree.loading_on_path(t.tree.root_node)
    assert t.tree.protected_size() == match.host_hit_len  # the loaded nodes are locked: nothing may evict them
    assert t.tree.evict(64) <= 20 - match.host_hit_len
    assert t.tree.poll_loads() == 1 and t.tree.loading_on_path(loaded.last_node)
    copy.finish()
    assert t.tree.poll_loads() == 0 and not t.tree.loading_on_path(loaded.last_node)
    assert t.tree.protected_size() == 0 and t.tree.host_report()["kv_host_loads_in_flight"] == 0
    t.tree.check_invariants()
    assert not t.tree.wait_for_load()


def test_an_asynchronous_load_keeps_its_request_out_of_the_batch_until_done(make_sched, monkeypatch):
    """The request whose prefix copies back is passed over (others run) until its copy is done; then it is admitted
    with the whole prefix cached, and its tokens equal a synchronous load's."""
    rng = random.Random(7)
    history, others = rand_ids(rng, 90), [rand_ids(rng, 100) for _ in range(3)]

    def returning(sched):
        for rid, ids in (("agent1", history), *((f"other{i}", o) for i, o in enumerate(others))):
            sched.add_request(new_req(sched, rid, ids, max_new_tokens=2))
            drain(sched)
        again = new_req(sched, "agent2", history + [7, 8], max_new_tokens=4, ignore_eos=True)
        bystander = new_req(sched, "bystander", rand_ids(rng, 10), max_new_tokens=4, ignore_eos=True)
        sched.add_request(again)
        sched.add_request(bystander)
        return again, bystander

    sync = make_sched(max_total_tokens=160, kv_host_size=1024, kv_host_load="sync")
    expected, _ = returning(sync)
    drain(sync)
    sched = make_sched(max_total_tokens=160, kv_host_size=1024, kv_host_load="async")
    copies = []
    real_restore = sched.tree_cache.host.restore

    def slow_restore(host_slots, device_slots, wait=True):
        assert not wait
        real_restore(host_slots, device_slots)
        copies.append(SlowCopy())
        return copies[-1]

    monkeypatch.setattr(sched.tree_cache.host, "restore", slow_restore)
    again, bystander = returning(sched)
    sched.step()  # the load starts; the bystander's prefill runs without waiting for it
    assert len(copies) == 1 and again not in sched.running and bystander in sched.running
    assert sched.get_stats()["kv_host_loads_in_flight"] == 1
    sched.step()
    assert again not in sched.running  # still copying
    copies[0].finish()
    sched.step()
    assert again in sched.running and again.cached_tokens == 90
    drain(sched)
    assert again.output_ids == expected.output_ids and sched.get_stats()["kv_host_loads_in_flight"] == 0


def test_an_aborted_request_s_load_still_ends(make_sched, monkeypatch):
    rng = random.Random(8)
    history = rand_ids(rng, 90)
    sched = make_sched(max_total_tokens=128, kv_host_size=1024, kv_host_load="async")
    copies = []
    real_restore = sched.tree_cache.host.restore
    monkeypatch.setattr(sched.tree_cache.host, "restore",
                        lambda h, d, wait=True: (real_restore(h, d), copies.append(SlowCopy()), copies[-1])[2])
    for rid, ids in (("agent1", history), ("other", rand_ids(rng, 120))):
        sched.add_request(new_req(sched, rid, ids, max_new_tokens=2))
        drain(sched)
    sched.add_request(new_req(sched, "agent2", history + [5], max_new_tokens=2))
    sched.add_request(new_req(sched, "bystander", rand_ids(rng, 8), max_new_tokens=3, ignore_eos=True))
    sched.step()  # the load starts, the bystander runs
    assert len(copies) == 1 and sched.abort_request("agent2") is not None
    assert sched.get_stats()["kv_host_loads_in_flight"] == 1 and not copies[0].done
    drain(sched)  # the bystander finishes; then, with nothing else to do, the scheduler waits for the copy
    assert copies[0].done and not sched.has_work() and sched.get_stats()["kv_host_loads_in_flight"] == 0


# The scheduler ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [
    dict(kv_host_size=512),
    dict(kv_host_size=24),  # smaller than what is evicted: the host drops copies too
    dict(kv_host_size=256, page_size=4, chunked_prefill_size=16),
    dict(kv_host_size=512, kv_host_load="async"),
    dict(kv_host_size=24, kv_host_load="async", page_size=4, chunked_prefill_size=16),
], ids=["host512", "host24", "host256-page4-chunked16", "host512-async", "host24-async-page4-chunked16"])
def test_outputs_identical_with_the_host_tier_under_pressure(make_sched, reference_outputs, variant):
    sched = make_sched(max_total_tokens=SMALL_POOL, **variant)
    assert run_workload(sched, WORKLOAD) == reference_outputs
    stats = sched.get_stats()
    assert stats["kv_host_written_tokens"] > 0 and stats["kv_host_loaded_tokens"] > 0, stats
    if variant["kv_host_size"] < 100:
        assert stats["kv_host_evicted_tokens"] > 0, stats
    check_variant_really_applied(sched, variant)


@pytest.mark.parametrize("load", ["sync", "async"])
def test_a_returning_prompt_is_loaded_from_the_host_not_computed(make_sched, load):
    rng = random.Random(3)
    history, tail = rand_ids(rng, 90), rand_ids(rng, 5)
    others = [rand_ids(rng, 100) for _ in range(3)]  # other users' prompts push the agent's KV out of the pool

    def agent_returns(sched):
        for rid, ids in (("agent1", history), *((f"other{i}", o) for i, o in enumerate(others))):
            sched.add_request(new_req(sched, rid, ids, max_new_tokens=2))
            drain(sched)
        again = new_req(sched, "agent2", history + tail, max_new_tokens=4, ignore_eos=True)
        sched.add_request(again)
        drain(sched)
        return again

    tiered = make_sched(max_total_tokens=128, kv_host_size=1024, kv_host_load=load)
    again = agent_returns(tiered)
    assert again.cached_tokens == 90
    assert tiered.get_stats()["kv_host_loaded_tokens"] == 90
    plain = agent_returns(make_sched(max_total_tokens=128))  # without the tier the history is computed again
    assert plain.cached_tokens == 0
    assert again.output_ids == plain.output_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_host_size=-1), "kv_host_size must be >= 0"),
    (dict(kv_host_size=64, disable_radix_cache=True), "needs the radix cache"),
    (dict(kv_host_size=64, table_cache=True), "needs the radix cache"),
    (dict(kv_host_size=64, tp_size=2), "tp_size > 1"),
])
def test_bad_host_tier_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="x", **kwargs)


def test_metrics_show_the_host_tier():
    from sglang_backend.runtime.entrypoints.metrics import ServerMetrics

    base = dict(num_running=0, num_waiting=0, max_total_num_tokens=100, free_tokens=100, evictable_tokens=0,
                cache_hit_rate=0.5, num_generated_tokens=0)
    assert b"kv_host_used_tokens 0.0" in ServerMetrics().render(base)  # no tier: the gauges stay at zero
    text = ServerMetrics().render(dict(base, kv_host_used_tokens=70, kv_host_loaded_tokens=300,
                                       kv_host_written_tokens=410)).decode()
    lines = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("sglang_backend_kv_host"))
    assert lines == {"sglang_backend_kv_host_used_tokens": "70.0", "sglang_backend_kv_host_loaded_tokens": "300.0",
                     "sglang_backend_kv_host_written_tokens": "410.0"}


@pytest.mark.parametrize("host", [0, 2048])
def test_with_a_host_tier_a_session_pin_gives_way_to_a_waiting_request(make_sched, host):
    """Two requests arrive together while an agent's 150-token sequence is pinned in a 256-token pool: the second
    fits only if the pin goes. With a host tier it goes at once (its KV survives in host memory and the agent's
    next call loads it back); without one the pin holds while the first runs, and the second waits."""
    rng = random.Random(5)
    sched = make_sched(max_total_tokens=256, kv_host_size=host, session_ttl=60, session_pin_max_fraction=0.8)
    history = rand_ids(rng, 150)
    first = new_req(sched, "agent1", history, max_new_tokens=4, ignore_eos=True)
    first.session_id = "agent"
    sched.add_request(first)
    drain(sched)
    assert sched.get_stats()["session_pinned_tokens"] == 153
    others = [new_req(sched, f"o{i}", rand_ids(rng, n), max_new_tokens=2) for i, n in enumerate((60, 120))]
    for r in others:
        sched.add_request(r)
    sched.step()  # the first prefill batch
    admitted = sum(r.req_pool_idx is not None or r.finished() for r in others)
    drain(sched)
    stats = sched.get_stats()
    if host:
        assert admitted == 2 and stats["session_pins_released_for_memory"] == 1, stats
        again = new_req(sched, "agent2", history + first.output_ids[:3] + rand_ids(rng, 4), max_new_tokens=2)
        again.session_id = "agent"
        sched.add_request(again)
        drain(sched)
        assert again.cached_tokens == 153 and sched.get_stats()["kv_host_loaded_tokens"] > 0
    else:
        assert admitted == 1, stats  # (the pin goes later, once nothing runs and the request still cannot)
    sched.handle_control("end_session", "agent")


def test_a_few_tokens_hit_in_host_memory_do_not_put_a_request_ahead_of_older_ones(make_sched):
    """Evaluate's shape: every prompt is one shared prefix (the demos) plus its own text. With the tier, evicted texts
    stay in the tree as host-only children of the prefix's node, one per first token, so a newcomer whose text begins
    with a token seen before "hits" a token or two of an unrelated text there. That coincidence must not count as a
    cached prefix: requests that match the same device prefix keep their arrival order (counting it put newer requests
    ahead of an older one round after round: one Evaluate example waited ~35 s behind 50 later ones), and nothing is
    loaded back for it. The outputs are those without the tier."""
    rng = random.Random(11)
    prefix = rand_ids(rng, 48)
    seen = rng.sample(range(3, 500), 3)  # the first tokens of earlier examples' texts
    fresh = next(t for t in range(3, 500) if t not in seen)
    earlier = [prefix + [first] + rand_ids(rng, 40) for first in seen]
    oldest = prefix + [fresh] + rand_ids(rng, 40)
    newer = [prefix + [first] + rand_ids(rng, 40) for first in seen[:2]]

    def evaluate(sched) -> tuple[list[str], list[list[int]]]:
        for i, ids in enumerate(earlier):  # one at a time: each evicts the text of the one before
            sched.add_request(new_req(sched, f"earlier{i}", ids, max_new_tokens=2))
            drain(sched)
        waiting = [new_req(sched, "oldest", oldest, max_new_tokens=3, ignore_eos=True)]
        waiting += [new_req(sched, f"newer{i}", ids, max_new_tokens=3, ignore_eos=True) for i, ids in enumerate(newer)]
        for req in waiting:
            sched.add_request(req)
        if sched.host_tier:  # the newer ones' texts begin in host memory: a one-token coincidence, not a prefix
            matches = [sched.tree_cache.match_prefix(r.origin_input_ids) for r in waiting]
            assert [(len(m.device_indices), m.host_hit_len) for m in matches] == [(48, 0), (48, 1), (48, 1)]
        admitted = []
        while sched.has_work():
            sched.step()
            admitted += [r.rid for r in sched.running if r.rid not in admitted]
        return admitted, [r.output_ids for r in waiting]

    tiered = make_sched(max_total_tokens=112, kv_host_size=1024, max_running_requests=1)
    order, outputs = evaluate(tiered)
    stats = tiered.get_stats()
    assert stats["kv_host_written_tokens"] > 0
    assert order == ["oldest", "newer0", "newer1"], order
    assert stats["kv_host_loaded_tokens"] == 0
    assert evaluate(make_sched(max_total_tokens=112, max_running_requests=1)) == (order, outputs)
