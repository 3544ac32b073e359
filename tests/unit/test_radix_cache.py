"""Unit tests for the radix prefix cache (RadixAttention) and its disabled twin, ChunkCache."""

from __future__ import annotations

import pytest
import torch

from sglang_backend.runtime.mem_cache.chunk_cache import ChunkCache
from sglang_backend.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sglang_backend.runtime.mem_cache.radix_cache import RadixCache


# ---------------------------------------------------------------------------------------------- helpers


class Req:
    """The duck-typed request the cache hooks expect."""

    def __init__(self, tokens, extra_key=None):
        self.tokens = list(tokens)
        self.extra_key = extra_key
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None


def make_cache(pool_size=64, page_size=1, cls=RadixCache, max_reqs=8, ctx=128):
    req_pool = ReqToTokenPool(max_reqs, ctx)
    alloc = TokenToKVPoolAllocator(pool_size, page_size)
    return cls(req_pool, alloc, page_size)


def slots(cache, n):
    """Fresh KV slots straight from the allocator (for tests that call insert directly)."""
    out = cache.token_to_kv_pool_allocator.alloc(n)
    assert out is not None
    return out


def put(cache, key, extra_key=None):
    """Insert ``key`` with fresh slots the way callers must: free our copies of what was already cached."""
    kv = slots(cache, len(key))
    present = cache.insert(key, kv, extra_key)
    cache.token_to_kv_pool_allocator.free(kv[:present])
    return present


def admit(cache, req):
    """What the scheduler does when a request is admitted: match, lock, take a request slot."""
    m = cache.match_prefix(req.tokens, req.extra_key)
    cache.inc_lock_ref(m.last_node)
    req.prefix_indices, req.last_node = m.device_indices, m.last_node
    req.req_pool_idx = cache.req_to_token_pool.alloc()
    cache.req_to_token_pool.write(req.req_pool_idx, 0, req.prefix_indices)
    return len(m.device_indices)


def alloc_rest(cache, req, upto=None):
    """Allocate KV for req.tokens[len(prefix):upto], evicting from the tree if the pool is short."""
    start = len(req.prefix_indices)
    end = len(req.tokens) if upto is None else upto
    alloc = cache.token_to_kv_pool_allocator
    need = end - start
    need_slots = -(-need // cache.page_size) * cache.page_size
    if alloc.available_size() < need_slots:
        cache.evict(need_slots - alloc.available_size())
    kv = alloc.alloc(need)
    assert kv is not None, "pool too small for the test scenario"
    cache.req_to_token_pool.write(req.req_pool_idx, start, kv)
    return kv


def run_batch(cache, token_lists):
    """Admit a batch together (all prefixes locked), compute it, then finish every request."""
    reqs = [Req(t) for t in token_lists]
    hits = [admit(cache, r) for r in reqs]
    for r in reqs:
        alloc_rest(cache, r)
    for r in reqs:
        cache.cache_finished_req(r, r.tokens)
    return hits


def assert_idle(cache):
    """At idle every KV slot is either free or cached-and-evictable, exactly once."""
    alloc = cache.token_to_kv_pool_allocator
    cache.check_invariants()
    alloc.debug_check_no_duplicates()
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.evictable_size() == alloc.size
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size


# ---------------------------------------------------------------------------------------------- match / insert / split


def test_empty_tree_matches_nothing():
    cache = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.device_indices.dtype == torch.int64 and len(m.device_indices) == 0
    assert m.last_node is cache.root_node
    assert cache.total_size() == 0
    assert len(cache.match_prefix([]).device_indices) == 0


def test_insert_then_match_returns_the_inserted_slots():
    cache = make_cache()
    kv = slots(cache, 4)
    assert cache.insert([1, 2, 3, 4], kv) == 0
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.device_indices.tolist() == kv.tolist()
    assert m.last_node.key == [1, 2, 3, 4]
    assert cache.evictable_size() == 4 and cache.total_size() == 4
    assert len(cache.match_prefix([9, 1, 2]).device_indices) == 0
    cache.check_invariants()


def test_insert_copies_slots_so_the_callers_buffer_can_be_reused():
    cache = make_cache()
    buf = slots(cache, 3)
    expected = buf.tolist()
    cache.insert([1, 2, 3], buf)
    buf.fill_(0)
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == expected


def test_insert_returns_already_present_length_and_splits():
    cache = make_cache()
    a = slots(cache, 4)
    cache.insert([1, 2, 3, 4], a)
    b = slots(cache, 3)
    assert cache.insert([1, 2, 7], b) == 2  # [1, 2] already cached; caller frees b[:2]
    assert cache.debug_tree() == {(1, 2): {(3, 4): {}, (7,): {}}}
    assert cache.total_size() == 5
    # The tree kept its own slots for the shared part and took only b[2:].
    assert cache.match_prefix([1, 2, 7]).device_indices.tolist() == a[:2].tolist() + b[2:].tolist()
    cache.token_to_kv_pool_allocator.free(b[:2])
    assert put(cache, [1, 2, 3, 4]) == 4
    assert put(cache, [1, 2]) == 2
    assert_idle(cache)


def test_match_splits_on_partial_match_and_last_node_ends_there():
    cache = make_cache()
    kv = slots(cache, 5)
    cache.insert([1, 2, 3, 4, 5], kv)
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.device_indices.tolist() == kv[:3].tolist()
    assert m.last_node.key == [1, 2, 3]
    assert cache.debug_tree() == {(1, 2, 3): {(4, 5): {}}}
    # The split node's value is the prefix's slots, the child keeps the rest.
    (child,) = m.last_node.children.values()
    assert child.value.tolist() == kv[3:].tolist()
    assert child.parent is m.last_node
    cache.check_invariants()


def test_match_exactly_at_node_boundary_does_not_split():
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3])
    assert m.last_node.key == [1, 2, 3]
    assert cache.debug_tree() == {(1, 2, 3): {(4, 5): {}}}


def test_tensor_token_ids_are_accepted():
    cache = make_cache()
    kv = slots(cache, 3)
    cache.insert(torch.tensor([5, 6, 7]), kv)
    assert cache.match_prefix(torch.tensor([5, 6, 7, 8])).device_indices.tolist() == kv.tolist()


# ---------------------------------------------------------------------------------------------- eviction


def test_evict_least_recently_used_leaf_first():
    cache = make_cache()
    put(cache, [1, 1])  # A
    put(cache, [2, 2])  # B
    put(cache, [3, 3])  # C
    cache.match_prefix([1, 1])  # touch A: B is now the oldest
    assert cache.evict(1) == 2  # whole leaf goes even if fewer tokens were asked for
    assert set(cache.debug_tree()) == {(1, 1), (3, 3)}
    cache.evict(1)
    assert set(cache.debug_tree()) == {(1, 1)}
    cache.evict(1)
    assert cache.debug_tree() == {}
    assert cache.num_evicted_tokens == 6
    assert_idle(cache)


def test_evict_stops_once_enough_is_freed():
    cache = make_cache()
    for i in range(5):
        put(cache, [i, 100 + i, 200 + i])
    assert cache.evict(4) == 6  # two leaves of 3
    assert cache.total_size() == 9
    assert set(cache.debug_tree()) == {(2, 102, 202), (3, 103, 203), (4, 104, 204)}  # the 3 newest
    assert cache.evict(0) == 0 and cache.total_size() == 9
    assert_idle(cache)


def test_evict_cascades_to_parents_that_become_leaves():
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    put(cache, [9, 9, 9, 9])
    cache.match_prefix([9, 9, 9, 9])  # the [1, 2] family is older
    # Needs 4 tokens: leaves [3] and [4] (1 each), then their parent [1, 2] (2) -- and no more.
    assert cache.evict(4) == 4
    assert cache.debug_tree() == {(9, 9, 9, 9): {}}
    assert_idle(cache)


def test_evict_takes_a_parent_before_a_newer_leaf_when_it_is_older():
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])  # [1,2] parent, children [3] [4], all old
    put(cache, [7, 7])  # newest
    assert cache.evict(3) == 4  # [3], [4], then parent [1,2] (older than [7,7])
    assert cache.debug_tree() == {(7, 7): {}}


def test_evict_everything_when_asked_for_more_than_cached():
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 5])
    assert cache.evict(1000) == 4
    assert cache.total_size() == 0
    assert cache.evict(5) == 0
    assert_idle(cache)


# ---------------------------------------------------------------------------------------------- locking


def test_locked_nodes_and_their_ancestors_are_never_evicted():
    cache = make_cache()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    put(cache, [8, 8])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4  # [1,2] + [3,4]
    assert cache.evictable_size() == 4  # [5,6] + [8,8]
    assert cache.evict(100) == 4
    assert cache.debug_tree() == {(1, 2): {(3, 4): {}}}
    assert cache.evictable_size() == 0 and cache.protected_size() == 4
    cache.check_invariants()
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    assert cache.evict(100) == 4
    assert_idle(cache)


def test_lock_ref_counts_multiple_holders():
    cache = make_cache()
    put(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evict(10) == 0
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(node)


def test_split_of_a_locked_node_keeps_sizes_and_lock_on_both_halves():
    cache = make_cache()
    put(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    upper = cache.match_prefix([1, 2, 9]).last_node  # splits the locked node
    assert upper.key == [1, 2] and node.key == [3, 4] and node.parent is upper
    assert upper.lock_ref == 1 and node.lock_ref == 1
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.check_invariants()
    cache.dec_lock_ref(node)  # the request still holds the lower half; unlocking walks through the upper
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    cache.check_invariants()


def test_locking_the_root_is_a_no_op():
    cache = make_cache()
    cache.inc_lock_ref(cache.root_node)
    cache.dec_lock_ref(cache.root_node)
    cache.inc_lock_ref(None)
    cache.dec_lock_ref(None)
    assert cache.protected_size() == 0


def test_check_invariants_catches_drifted_sizes_and_bad_children():
    cache = make_cache()
    put(cache, [1, 2, 3])
    cache.check_invariants()
    cache._evictable += 1
    with pytest.raises(AssertionError):
        cache.check_invariants()
    cache._evictable -= 1
    (node,) = cache.root_node.children.values()
    node.key = [7, 2, 3]  # now filed under the wrong first token
    with pytest.raises(AssertionError):
        cache.check_invariants()


# ---------------------------------------------------------------------------------------------- namespaces


@pytest.mark.parametrize("other", ["img-hash-1", ("lora", 3), 0])
def test_different_extra_keys_never_share(other):
    cache = make_cache()
    a = slots(cache, 3)
    cache.insert([1, 2, 3], a)  # namespace None
    assert len(cache.match_prefix([1, 2, 3], extra_key=other).device_indices) == 0
    b = slots(cache, 3)
    assert cache.insert([1, 2, 3], b, extra_key=other) == 0  # nothing shared across namespaces
    assert cache.total_size() == 6
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == a.tolist()
    assert cache.match_prefix([1, 2, 3], extra_key=other).device_indices.tolist() == b.tolist()
    assert cache.debug_tree() == {(1, 2, 3): {}}
    assert cache.debug_tree(other) == {(1, 2, 3): {}}
    # Splitting in one namespace leaves the other alone.
    cache.match_prefix([1, 9], extra_key=other)
    assert cache.debug_tree(other) == {(1,): {(2, 3): {}}}
    assert cache.debug_tree() == {(1, 2, 3): {}}
    cache.check_invariants()
    assert cache.evict(100) == 6
    assert_idle(cache)


def test_requests_in_a_namespace_share_with_each_other():
    cache = make_cache()
    r1 = Req([1, 2, 3, 4], extra_key="salt")
    admit(cache, r1)
    alloc_rest(cache, r1)
    cache.cache_finished_req(r1, r1.tokens)
    r2 = Req([1, 2, 3, 5], extra_key="salt")
    assert admit(cache, r2) == 3
    r3 = Req([1, 2, 3, 5], extra_key=None)
    assert admit(cache, r3) == 0
    for r in (r2, r3):
        alloc_rest(cache, r)
        cache.cache_finished_req(r, r.tokens)
    assert cache.debug_tree("salt") == {(1, 2, 3): {(4,): {}, (5,): {}}}
    assert cache.debug_tree(None) == {(1, 2, 3, 5): {}}
    assert_idle(cache)


# ---------------------------------------------------------------------------------------------- page_size > 1


def test_page_size_4_only_whole_pages_are_inserted_and_matched():
    cache = make_cache(pool_size=64, page_size=4)
    key = list(range(10, 20))  # 10 tokens: 2 whole pages + 2
    kv = slots(cache, 10)
    assert cache.insert(key, kv) == 0
    assert cache.total_size() == 8
    assert cache.debug_tree() == {tuple(range(10, 18)): {}}
    assert cache.match_prefix(key).device_indices.tolist() == kv[:8].tolist()
    assert len(cache.match_prefix(key[:7]).device_indices) == 4  # 7 tokens: one whole page
    assert len(cache.match_prefix(key[:3]).device_indices) == 0
    cache.check_invariants()


def test_page_size_4_divergence_inside_a_page_splits_at_the_page_boundary():
    cache = make_cache(pool_size=64, page_size=4)
    a = slots(cache, 8)
    cache.insert(list(range(8)), a)
    # Differs at token 6, inside the second page: only the first page is shared.
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 98])
    assert m.device_indices.tolist() == a[:4].tolist()
    assert m.last_node.key == [0, 1, 2, 3]
    b = slots(cache, 8)
    assert cache.insert([0, 1, 2, 3, 4, 5, 99, 98], b) == 4
    assert cache.debug_tree() == {(0, 1, 2, 3): {(4, 5, 6, 7): {}, (4, 5, 99, 98): {}}}
    cache.check_invariants()  # the two children share tokens 4,5 but not their first page
    cache.token_to_kv_pool_allocator.free(b[:4])  # caller frees its duplicate page
    assert cache.evict(100) == 12
    assert_idle(cache)


def test_page_size_4_requests_free_their_partial_tail_page():
    cache = make_cache(pool_size=32, page_size=4)
    r = Req(list(range(10)))
    admit(cache, r)
    alloc_rest(cache, r)
    assert cache.token_to_kv_pool_allocator.available_size() == 32 - 12  # 3 pages
    cache.cache_finished_req(r, r.tokens)
    assert cache.total_size() == 8  # 2 pages cached, the partial third page freed
    assert_idle(cache)
    r2 = Req(list(range(10)) + [77])
    assert admit(cache, r2) == 8
    alloc_rest(cache, r2)
    # The request's own part starts on a fresh page.
    assert int(cache.req_to_token_pool.req_to_token[r2.req_pool_idx, 8]) % 4 == 0
    cache.cache_finished_req(r2, r2.tokens)
    assert_idle(cache)


# ---------------------------------------------------------------------------------------------- request hooks


def test_cache_finished_req_frees_duplicates_tail_and_request_slot():
    cache = make_cache(pool_size=32)
    alloc = cache.token_to_kv_pool_allocator
    # Two requests with the same prompt run at the same time: neither matched the other.
    r1, r2 = Req([1, 2, 3, 4, 5]), Req([1, 2, 3, 4, 6])
    assert admit(cache, r1) == 0 and admit(cache, r2) == 0
    kv1, kv2 = alloc_rest(cache, r1), alloc_rest(cache, r2)
    assert alloc.available_size() == 22
    cache.cache_finished_req(r1, r1.tokens)
    assert r1.req_pool_idx is None and r1.last_node is None
    assert cache.total_size() == 5 and alloc.available_size() == 22
    cache.cache_finished_req(r2, r2.tokens)
    # r2's slots for [1,2,3,4] were duplicates and went back; only its last token was cached.
    assert cache.total_size() == 6
    assert alloc.available_size() == 32 - 6
    m = cache.match_prefix([1, 2, 3, 4, 6])
    assert m.device_indices.tolist() == kv1[:4].tolist() + kv2[4:].tolist()
    assert_idle(cache)


def test_cache_finished_req_with_a_matched_prefix_releases_its_lock():
    cache = make_cache(pool_size=32)
    run_batch(cache, [[1, 2, 3, 4]])
    r = Req([1, 2, 3, 4, 5, 6])
    assert admit(cache, r) == 4
    assert cache.protected_size() == 4
    alloc_rest(cache, r)
    cache.cache_finished_req(r, r.tokens)
    assert cache.protected_size() == 0
    assert cache.debug_tree() == {(1, 2, 3, 4): {(5, 6): {}}}
    assert_idle(cache)


def test_cache_unfinished_req_chunked_prefill_page_size_1():
    cache = make_cache(pool_size=32)
    r = Req(list(range(100, 110)))
    admit(cache, r)
    for end in (4, 8, 10):  # three prefill chunks
        alloc_rest(cache, r, upto=end)
        cache.cache_unfinished_req(r, r.tokens[:end])
        assert len(r.prefix_indices) == end
        row = cache.req_to_token_pool.req_to_token[r.req_pool_idx, :end]
        assert row.tolist() == r.prefix_indices.tolist()
        assert cache.match_prefix(r.tokens[:end]).device_indices.tolist() == r.prefix_indices.tolist()
        assert cache.protected_size() == end and cache.evictable_size() == 0
        cache.check_invariants()
    cache.cache_finished_req(r, r.tokens)
    assert cache.total_size() == 10
    assert_idle(cache)


def test_cache_unfinished_req_adopts_the_trees_slots_for_a_duplicate_prefix():
    cache = make_cache(pool_size=32)
    alloc = cache.token_to_kv_pool_allocator
    r1, r2 = Req([1, 2, 3, 4, 5, 6]), Req([1, 2, 3, 4, 5, 6, 7, 8])
    admit(cache, r1)
    admit(cache, r2)
    kv1 = alloc_rest(cache, r1)
    alloc_rest(cache, r2)
    cache.cache_finished_req(r1, r1.tokens)
    free_before = alloc.available_size()
    cache.cache_unfinished_req(r2, r2.tokens)
    # r2's own copies of the first 6 tokens were freed; its row now points at r1's cached slots.
    assert alloc.available_size() == free_before + 6
    row = cache.req_to_token_pool.req_to_token[r2.req_pool_idx, :8]
    assert row[:6].tolist() == kv1.tolist()
    assert r2.prefix_indices.tolist() == row.tolist()
    assert r2.last_node.key == [7, 8]
    assert cache.protected_size() == 8
    cache.check_invariants()
    # Finishing after more decode tokens caches them too.
    r2.tokens += [9]
    alloc_rest(cache, r2)
    cache.cache_finished_req(r2, r2.tokens)
    assert cache.debug_tree() == {(1, 2, 3, 4, 5, 6): {(7, 8): {(9,): {}}}}  # nodes are never merged back
    assert_idle(cache)


def test_cache_unfinished_req_page_size_4_keeps_the_partial_page_with_the_request():
    cache = make_cache(pool_size=32, page_size=4)
    alloc = cache.token_to_kv_pool_allocator
    r = Req(list(range(50, 60)))  # 10 tokens
    admit(cache, r)
    alloc_rest(cache, r, upto=6)  # first chunk: 6 tokens = 1 page + 2
    tail_slots = cache.req_to_token_pool.req_to_token[r.req_pool_idx, 4:6].tolist()
    cache.cache_unfinished_req(r, r.tokens[:6])
    assert len(r.prefix_indices) == 4 and cache.total_size() == 4
    assert cache.protected_size() == 4
    # The tail stays with the request (not in the tree, not free).
    assert cache.req_to_token_pool.req_to_token[r.req_pool_idx, 4:6].tolist() == tail_slots
    assert alloc.available_size() == 32 - 8
    # Next chunk continues in the same page.
    last = int(cache.req_to_token_pool.req_to_token[r.req_pool_idx, 5])
    kv = alloc.alloc_extend(last, 4)
    cache.req_to_token_pool.write(r.req_pool_idx, 6, kv)
    cache.cache_unfinished_req(r, r.tokens)
    assert len(r.prefix_indices) == 8 and cache.protected_size() == 8
    cache.check_invariants()
    cache.cache_finished_req(r, r.tokens)
    assert cache.total_size() == 8
    assert_idle(cache)


def test_reset_frees_every_cached_slot():
    cache = make_cache(pool_size=32)
    run_batch(cache, [[1, 2, 3], [1, 2, 4], [5, 6]])
    assert cache.total_size() == 6
    cache.reset()
    assert cache.total_size() == 0 and cache.debug_tree() == {}
    assert cache.token_to_kv_pool_allocator.available_size() == 32
    assert_idle(cache)
    assert run_batch(cache, [[1, 2, 3]]) == [0]


def test_reset_refuses_while_a_prefix_is_locked():
    cache = make_cache()
    put(cache, [1, 2])
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    with pytest.raises(AssertionError):
        cache.reset()


def test_pretty_print_runs(capsys):
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4], "img")
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "[1, 2, 3]" in out and "img" in out


# ---------------------------------------------------------------------------------------------- Fig. 3 of the paper

# Token-id stand-ins for the text segments of the paper's Fig. 3. Lengths are chosen together with the
# pool size so that memory runs out exactly where the figure evicts: node "c" in step 5, "g" and "h" in
# step 8, "i", "k" and "l" in step 9 (and nowhere else).
SEGMENTS = {
    "SYS": 4,  # "You are a helpful assistant."
    "HELLO": 4,  # "User: Hello! Assistant: Hi!"
    "T2": 14,  # chat 1, turn 2: "User: Solve this problem ... Assistant: Sure! ..."
    "WHAT": 8,  # chat 2: "User: What can you do? Assistant: I can ..."
    "STORY": 8,  # chat 2, turn 2: "User: Write a story. Assistant: Sure ..."
    "FS": 4,  # few-shot examples "Question 1: ... Answer 1: ... Question 2: ..."
    "Q1": 2,  # few-shot queries (question + its answer)
    "Q2": 2,
    "Q3": 2,
    "T3": 2,  # chat 1, turn 3
    "S1": 2,  # self-consistency samples for Q3
    "S2": 2,
    "S3": 2,
    "S4": 2,
}
FIG3_POOL = 36


def _segments():
    toks, owner, nxt = {}, {}, 1000
    for name, n in SEGMENTS.items():
        toks[name] = list(range(nxt, nxt + n))
        for i, t in enumerate(toks[name]):
            owner[t] = (name, i)
        nxt += 100
    return toks, owner


SEG, OWNER = _segments()


def seq(*names):
    return [t for n in names for t in SEG[n]]


def label(edge):
    """Edge tokens -> 'SYS+HELLO'; a segment cut by a split shows as 'T2[0:5]'."""
    parts = []
    for t in edge:
        name, i = OWNER[t]
        if parts and parts[-1][0] == name and parts[-1][2] == i:
            parts[-1][2] = i + 1
        else:
            parts.append([name, i, i + 1])
    return "+".join(n if (a, b) == (0, SEGMENTS[n]) else f"{n}[{a}:{b}]" for n, a, b in parts)


def shape(cache):
    def conv(tree):
        return {label(k): conv(v) for k, v in tree.items()}

    return conv(cache.debug_tree())


def test_fig3_replay():
    cache = make_cache(pool_size=FIG3_POOL)

    def step(batch, hits, tree, evicted):
        before = cache.num_evicted_tokens
        assert run_batch(cache, batch) == hits
        assert cache.num_evicted_tokens - before == evicted
        assert shape(cache) == tree
        assert_idle(cache)

    # (1) The tree starts empty.
    assert shape(cache) == {}
    # (2) Chat 1: system prompt + "Hello!" + answer "Hi!" goes in as one edge.
    step([seq("SYS", "HELLO")], [0], {"SYS+HELLO": {}}, 0)
    # (3) Chat 1, next turn: the first turn is reused, the new turn appended.
    step([seq("SYS", "HELLO", "T2")], [8], {"SYS+HELLO": {"T2": {}}}, 0)
    # (4) Chat 2 starts: the first node is split so both chats share the system prompt.
    step([seq("SYS", "WHAT")], [4], {"SYS": {"HELLO": {"T2": {}}, "WHAT": {}}}, 0)
    # (5) Chat 2 continues; memory is short, so the LRU leaf "c" (chat 1's T2) is evicted.
    step([seq("SYS", "WHAT", "STORY")], [12], {"SYS": {"HELLO": {}, "WHAT": {"STORY": {}}}}, 14)
    # (6) A few-shot query shares nothing: a new child of the root.
    step(
        [seq("FS", "Q1")],
        [0],
        {"SYS": {"HELLO": {}, "WHAT": {"STORY": {}}}, "FS+Q1": {}},
        0,
    )
    # (7) A batch of few-shot queries: node "e" is split so they share the examples.
    step(
        [seq("FS", "Q2"), seq("FS", "Q3")],
        [4, 4],
        {"SYS": {"HELLO": {}, "WHAT": {"STORY": {}}}, "FS": {"Q1": {}, "Q2": {}, "Q3": {}}},
        0,
    )
    # (8) Chat 1 sends a new message (its evicted T2 is recomputed); chat 2's "g" and "h" are the LRU
    # nodes and are evicted (leaf first, then its parent).
    step(
        [seq("SYS", "HELLO", "T2", "T3")],
        [8],
        {"SYS": {"HELLO": {"T2+T3": {}}}, "FS": {"Q1": {}, "Q2": {}, "Q3": {}}},
        16,
    )
    # (9) Self-consistency: more answers sampled for the question in "j" (Q3). The other few-shot
    # queries "k", "l" and chat 1's newest turn "i" are evicted to make room.
    step(
        [seq("FS", "Q3", s) for s in ("S1", "S2", "S3", "S4")],
        [6, 6, 6, 6],
        {"SYS": {"HELLO": {}}, "FS": {"Q3": {"S1": {}, "S2": {}, "S3": {}, "S4": {}}}},
        20,
    )
    assert cache.num_evicted_tokens == 50


# ---------------------------------------------------------------------------------------------- ChunkCache


def test_chunk_cache_shares_nothing_and_frees_everything():
    cache = make_cache(pool_size=32, cls=ChunkCache)
    alloc = cache.token_to_kv_pool_allocator
    assert cache.disable is True and RadixCache.disable is False
    r = Req(list(range(10)))
    assert admit(cache, r) == 0
    assert r.last_node is cache.root_node
    alloc_rest(cache, r, upto=4)
    cache.cache_unfinished_req(r, r.tokens[:4])
    assert r.prefix_indices.tolist() == cache.req_to_token_pool.req_to_token[r.req_pool_idx, :4].tolist()
    alloc_rest(cache, r)
    assert alloc.available_size() == 22
    assert cache.insert(r.tokens, torch.arange(1, 11)) == 0
    cache.cache_finished_req(r, r.tokens)
    assert r.req_pool_idx is None
    assert alloc.available_size() == 32
    alloc.debug_check_no_duplicates()
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size
    # Nothing was cached.
    assert len(cache.match_prefix(r.tokens).device_indices) == 0
    assert cache.evict(100) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    cache.reset()
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cut", [1, 5, 63, 64, 65, 127, 128, 200, 299])
def test_match_finds_the_exact_parting_point_of_long_keys(page_size, cut):
    """Long edges are compared a block of tokens at a time: the match must still end exactly where the keys
    part (rounded down to a page), whether that is inside a block, on its boundary or at the edge's end."""
    cache = make_cache(pool_size=1024, page_size=page_size, ctx=512)
    key = list(range(100, 400))
    put(cache, key)
    probe = key[:cut] + [7] * (300 - cut)
    expected = cut - cut % page_size
    assert len(cache.match_prefix(probe).device_indices) == expected
    assert len(cache.match_prefix(key[:cut]).device_indices) == expected
