"""Stateful property test: RadixCache against a brute-force model.

The model is a plain dict ``(namespace, prefix tuple up to a page end) -> the page's KV slots`` with one
entry per cached page (so it is prefix-closed), plus the tick of each page's last access. Simulated requests go
through the same hooks the scheduler uses (match + lock, allocate with eviction, extend, cache
unfinished/finished). After every step we check:

* the tree's content (every cached prefix and its slot) equals the model, and matches agree;
* the incremental sizes equal a recount, and protected == pages locked by running requests;
* every KV page is owned exactly once: by the tree, the free list, or a running request;
* evictions free only unlocked pages, at least what was asked (when possible), in LRU order.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_backend.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sglang_backend.runtime.mem_cache.radix_cache import RadixCache

MAX_REQS = 4
CTX = 48

# Common heads (so prompts share whole pages and diverge inside a later page) + a tail over a tiny alphabet.
HEADS = [[], [7, 7, 7, 7, 8, 8], [7, 7, 7, 7, 8, 8, 8, 8, 9], [5, 6]]
tokens_st = st.builds(
    lambda head, tail: head + tail, st.sampled_from(HEADS), st.lists(st.integers(0, 2), max_size=8)
).filter(bool)
ns_st = st.sampled_from([None, "img"])
pick_st = st.integers(0, MAX_REQS - 1)


class Req:
    def __init__(self, tokens, extra_key):
        self.tokens = list(tokens)
        self.extra_key = extra_key
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 24

    def __init__(self):
        super().__init__()
        ps = self.ps = self.page_size
        self.req_pool = ReqToTokenPool(MAX_REQS, CTX)
        self.alloc = TokenToKVPoolAllocator(self.num_pages * ps, ps)
        self.cache = RadixCache(self.req_pool, self.alloc, ps)
        self.model: dict[tuple, int] = {}
        self.atime: dict[tuple, int] = {}
        self.clock = 0
        self.running: list[Req] = []

    # ------------------------------------------------------------------ the model
    # One entry per cached *page* (with page_size 1: per token), keyed by the whole prefix up to the
    # page's end, so [0,0,0,0] and [0,0,0,1] are different pages even though they share tokens.

    def _page(self, ns, tokens, j):
        """Model key of the j-th page (0-based) of ``tokens``."""
        return (ns, tuple(tokens[: (j + 1) * self.ps]))

    def _aligned(self, n):
        return n - n % self.ps

    def model_match(self, tokens, ns):
        """Matched length in tokens."""
        j = 0
        while (j + 1) * self.ps <= len(tokens) and self._page(ns, tokens, j) in self.model:
            j += 1
        return j * self.ps

    def model_slots(self, tokens, ns, n):
        return [s for j in range(n // self.ps) for s in self.model[self._page(ns, tokens, j)]]

    def model_touch(self, tokens, ns, n):
        self.clock += 1
        for j in range(n // self.ps):
            self.atime[self._page(ns, tokens, j)] = self.clock

    def model_insert(self, tokens, ns, kv):
        ps, aligned = self.ps, self._aligned(len(tokens))
        present = self.model_match(tokens, ns)
        for j in range(present // ps, aligned // ps):
            self.model[self._page(ns, tokens, j)] = tuple(kv[j * ps : (j + 1) * ps].tolist())
        self.model_touch(tokens, ns, aligned)
        return present

    def locked_pages(self):
        return {
            self._page(r.extra_key, r.tokens, j) for r in self.running for j in range(len(r.prefix_indices) // self.ps)
        }

    def tree_content(self):
        ps, content = self.ps, {}
        for d in self.cache.debug_nodes():
            start = len(d["path"]) - len(d["key"])
            for j in range(len(d["key"]) // ps):
                content[(d["extra_key"], d["path"][: start + (j + 1) * ps])] = tuple(d["value"][j * ps : (j + 1) * ps])
        return content

    # ------------------------------------------------------------------ driving the cache

    def checked_evict(self, n):
        before = self.tree_content()
        assert before == self.model
        nodes_before = self.cache.debug_nodes()
        evictable = self.cache.evictable_size()
        locked = self.locked_pages()
        freed = self.cache.evict(n)
        after = self.tree_content()
        removed = before.keys() - after.keys()
        assert all(before[k] == v for k, v in after.items()), "eviction moved a surviving slot"
        assert len(removed) * self.ps == freed
        assert freed >= min(n, evictable), "stopped evicting while it could and had not freed enough"
        assert not removed & locked, "evicted a locked prefix"
        # LRU: nothing evicted is newer than an unlocked leaf that survived.
        parents = {(ns, p[: -self.ps]) for ns, p in after}
        survivors = [k for k in after if k not in parents and k not in locked]
        if removed and survivors:
            assert max(self.atime[k] for k in removed) <= min(self.atime[k] for k in survivors)
        # No more than needed: before the last node went (the newest; among equals, the ancestor),
        # fewer than n tokens had been freed.
        alive = {(d["extra_key"], d["path"]) for d in self.cache.debug_nodes()}
        gone = [d for d in nodes_before if (d["extra_key"], d["path"]) not in alive]
        if gone:
            last = max(gone, key=lambda d: (d["last_access_time"], -d["depth"]))
            assert freed - len(last["key"]) < n, "evicted more than asked for"
        self.model = after
        self.atime = {k: t for k, t in self.atime.items() if k in after}

    def alloc_kv(self, need, last_loc=-1):
        kv = self.alloc.alloc_extend(last_loc, need)
        if kv is None:
            self.checked_evict(need + self.ps)
            kv = self.alloc.alloc_extend(last_loc, need)
        return kv

    def check_match(self, tokens, ns):
        n = self.model_match(tokens, ns)
        m = self.cache.match_prefix(tokens, ns)
        assert m.device_indices.tolist() == self.model_slots(tokens, ns, n)
        self.model_touch(tokens, ns, n)
        return m

    # ------------------------------------------------------------------ rules

    @rule(tokens=tokens_st, ns=ns_st)
    def match(self, tokens, ns):
        self.check_match(tokens, ns)

    @rule(tokens=tokens_st, ns=ns_st)
    def insert_fresh(self, tokens, ns):
        kv = self.alloc_kv(len(tokens))
        if kv is None:
            return
        expected = self.model_insert(tokens, ns, kv)
        assert self.cache.insert(tokens, kv, ns) == expected
        # Our copies of the cached part are duplicates; the unaligned tail was never cached.
        self.alloc.free(torch.cat([kv[:expected], kv[self._aligned(len(tokens)) :]]))
        kv.zero_()  # the tree must have copied the slots, not kept a view of our buffer

    @precondition(lambda self: len(self.running) < MAX_REQS)
    @rule(tokens=tokens_st, ns=ns_st)
    def start_request(self, tokens, ns):
        req = Req(tokens, ns)
        m = self.check_match(tokens, ns)
        self.cache.inc_lock_ref(m.last_node)
        req.prefix_indices, req.last_node = m.device_indices, m.last_node
        req.req_pool_idx = self.req_pool.alloc()
        self.running.append(req)  # the lock is live: eviction inside alloc_kv must respect it
        self.req_pool.write(req.req_pool_idx, 0, req.prefix_indices)
        kv = self.alloc_kv(len(tokens) - len(req.prefix_indices))
        if kv is None:  # pool too full even after eviction: give the request back
            self.running.remove(req)
            self.cache.dec_lock_ref(req.last_node)
            self.req_pool.free(req.req_pool_idx)
            return
        self.req_pool.write(req.req_pool_idx, len(req.prefix_indices), kv)

    @precondition(lambda self: self.running)
    @rule(pick=pick_st, new=tokens_st)
    def decode(self, pick, new):
        req = self.running[pick % len(self.running)]
        new = new[:4]
        if len(req.tokens) + len(new) > CTX:
            return
        n = len(req.tokens)
        last_loc = int(self.req_pool.req_to_token[req.req_pool_idx, n - 1]) if n else -1
        kv = self.alloc_kv(len(new), last_loc)
        if kv is None:
            return
        self.req_pool.write(req.req_pool_idx, n, kv)
        req.tokens += new

    @precondition(lambda self: self.running)
    @rule(pick=pick_st)
    def cache_unfinished(self, pick):
        req = self.running[pick % len(self.running)]
        kv = self.req_pool.req_to_token[req.req_pool_idx, : len(req.tokens)].clone()
        self.model_insert(req.tokens, req.extra_key, kv)
        self.cache.cache_unfinished_req(req, req.tokens)
        aligned = self._aligned(len(req.tokens))
        self.model_touch(req.tokens, req.extra_key, aligned)  # the re-match
        expected = self.model_slots(req.tokens, req.extra_key, aligned)
        assert req.prefix_indices.tolist() == expected
        assert self.req_pool.req_to_token[req.req_pool_idx, :aligned].tolist() == expected

    @precondition(lambda self: self.running)
    @rule(pick=pick_st)
    def finish(self, pick):
        self._finish(self.running[pick % len(self.running)])

    def _finish(self, req):
        kv = self.req_pool.req_to_token[req.req_pool_idx, : len(req.tokens)].clone()
        self.model_insert(req.tokens, req.extra_key, kv)
        self.running.remove(req)
        self.cache.cache_finished_req(req, req.tokens)
        assert req.req_pool_idx is None and req.last_node is None

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        self.checked_evict(n)

    @precondition(lambda self: not self.running)
    @rule()
    def flush(self):
        self.cache.reset()
        self.model, self.atime = {}, {}
        assert self.alloc.available_size() == self.alloc.size

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tree_matches_model(self):
        self.cache.check_invariants()
        assert self.tree_content() == self.model

    @invariant()
    def access_order_matches_model(self):
        # The tree's LRU clock must order pages exactly as the model's: equal model ticks <-> equal node
        # times, and a later model tick <-> a later node time.
        ps, times = self.ps, []
        for d in self.cache.debug_nodes():
            start = len(d["path"]) - len(d["key"])
            for j in range(len(d["key"]) // ps):
                page = (d["extra_key"], d["path"][: start + (j + 1) * ps])
                times.append((self.atime[page], d["last_access_time"]))
        times.sort()
        for (m1, t1), (m2, t2) in zip(times, times[1:]):
            assert (m1 == m2) == (t1 == t2) and t1 <= t2, "LRU order differs from the model"

    @invariant()
    def sizes_are_exact(self):
        locked = self.locked_pages()
        ps = self.ps
        assert self.cache.protected_size() == len(locked) * ps
        assert self.cache.evictable_size() == (len(self.model) - len(locked)) * ps
        assert self.cache.total_size() == len(self.model) * ps

    @invariant()
    def requests_hold_their_locked_prefix(self):
        for r in self.running:
            n = len(r.prefix_indices)
            assert n % self.ps == 0
            assert r.prefix_indices.tolist() == self.model_slots(r.tokens, r.extra_key, n)
            assert self.req_pool.req_to_token[r.req_pool_idx, :n].tolist() == r.prefix_indices.tolist()
        assert self.req_pool.available_size() == MAX_REQS - len(self.running)

    @invariant()
    def every_page_owned_exactly_once(self):
        ps = self.ps
        self.alloc.debug_check_no_duplicates()
        tree_pages = set()
        for page in self.model.values():
            assert [s // ps for s in page] == [page[0] // ps] * ps, "a tree page mixes KV pages"
            assert [s % ps for s in page] == list(range(ps)), "token i of a page is not at offset i"
            tree_pages.add(page[0] // ps)
        assert len(tree_pages) == len(self.model), "two tree pages share a KV page"
        owners = [tree_pages, set(self.alloc.free_pages.tolist())]
        for r in self.running:
            own = self.req_pool.req_to_token[r.req_pool_idx, len(r.prefix_indices) : len(r.tokens)]
            owners.append({s // ps for s in own.tolist()})
        total = sum(len(o) for o in owners)
        union = set().union(*owners)
        assert total == len(union), "a KV page has two owners"
        assert union == set(range(1, self.num_pages + 1)), "a KV page was lost"

    def teardown(self):
        # Finish everything: at idle every slot is free or cached-and-evictable.
        for r in list(self.running):
            self._finish(r)
        self.tree_matches_model()
        self.every_page_owned_exactly_once()
        assert self.cache.protected_size() == 0
        assert self.alloc.available_size() + self.cache.evictable_size() == self.alloc.size


class RadixMachinePage4(RadixMachine):
    page_size = 4
    num_pages = 12


_settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestRadixCachePage1 = RadixMachine.TestCase
TestRadixCachePage1.settings = _settings
TestRadixCachePage4 = RadixMachinePage4.TestCase
TestRadixCachePage4.settings = _settings
