"""Theorem 3.1 of the SGLang paper, checked on the real scheduler.

    For a batch of requests, visiting the radix tree of the requests in DFS order reaches the optimal cache
    hit rate, as long as the cache holds at least the longest request. LPM is a DFS order.

Set-up: random request trees (3 levels, 2-4 children per node, edge lengths 8-40 tokens, a tiny dummy model),
every request submitted before the first step, ``max_new_tokens=1`` so a request's KV is exactly its prompt,
and ``max_running_requests=1`` so the requests are computed one after another in the order the policy picks
(the theorem's setting: the order is the only thing a policy controls, and with batching two requests of
one batch cannot reuse each other's KV whatever the order). The hit rate is the scheduler's own
``cached prompt tokens / prompt tokens`` from ``get_stats()``; the optimum is
``schedule_policy.optimal_hit_rate`` (each token of the request tree computed once, plus the one token that
every exact duplicate must still compute).

Two pool sizes:

* large (4096 tokens, nothing is ever evicted): every order is optimal when requests run one at a time, so
  the test checks that the cache-aware policies are, and (sanity) that fcfs/random are too;
* tight (exactly the longest request): eviction matters. ``lpm`` and ``dfs-weight`` must still be optimal;
  ``fcfs`` and ``random`` jump between subtrees, evict prefixes they need again, and do measurably worse.

Epsilon. With leaf-only request trees the engine's hit rate under a DFS order equals the optimum exactly: a
DFS order computes every edge once, and after a request finishes its whole path is in the cache (the pool
holds the longest request, and the prefix a new request reuses is locked while it is admitted, so eviction
only takes tokens no later request in the DFS order needs). So ``EPS = 1e-9`` (float rounding only).
When some requests are themselves prefixes of other requests (internal nodes of the tree), the optimum puts
each such request before its extensions; a scheduler that meets its extensions first must recompute that
request's last token (logits are needed for sampling), so each prefix request may cost one extra token:
epsilon = (number of prefix requests) / (total prompt tokens) + 1e-9.
"""

from __future__ import annotations

import itertools
import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_backend.runtime.managers.schedule_policy import optimal_hit_rate

EPS = 1e-9
VOCAB = 512  # dummy_config's vocabulary
LARGE_POOL = 4096
TREE_SEEDS = (0, 1, 2)


# Helpers ----------------------------------------------------------------------------------------------------------
def random_request_tree(seed: int, levels: int = 3, branching=(2, 4), edge_len=(8, 40),
                        internal_request_p: float = 0.0) -> list[list[int]]:
    """Prompts of a random prefix tree: one request per leaf (and, with probability ``internal_request_p``, one
    per internal node). Sibling edges start with different tokens, so the tree has exactly this shape.
    Returned in a shuffled (arrival) order."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []

    def grow(prefix: list[int], depth: int) -> None:
        if depth == levels:
            prompts.append(prefix)
            return
        if prefix and rng.random() < internal_request_p:
            prompts.append(list(prefix))
        for first in rng.sample(range(3, VOCAB), rng.randint(*branching)):
            edge = [first] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(*edge_len) - 1)]
            grow(prefix + edge, depth + 1)

    grow([], 0)
    rng.shuffle(prompts)
    return prompts


def count_prefix_requests(prompts: list[list[int]]) -> int:
    """Requests whose prompt is a strict prefix of another request's prompt."""
    return sum(any(len(q) > len(p) and q[: len(p)] == p for q in prompts) for p in prompts)


@pytest.fixture(scope="module")
def run_policy(tiny_gqa_dir):
    """run_policy(prompts, policy, pool) -> hit rate from get_stats(), on a fresh scheduler (pool checked)."""
    from sglang_backend.runtime.model_loader.loader import load_model_assets
    from sglang_backend.runtime.managers.schedule_batch import Req
    from sglang_backend.runtime.managers.scheduler import Scheduler
    from sglang_backend.runtime.sampling_params import SamplingParams
    from sglang_backend.runtime.server_args import ServerArgs

    logging.getLogger("sglang_backend").setLevel(logging.WARNING)
    model_dir, config, tokenizer = load_model_assets(ServerArgs(model_path=tiny_gqa_dir))

    memo: dict = {}  # the runs are deterministic: the summary test reuses the parametrized tests' runs

    def run(prompts: list[list[int]], policy: str, pool: int, **kwargs) -> dict:
        key = (tuple(map(tuple, prompts)), policy, pool, tuple(sorted(kwargs.items())))
        if key not in memo:
            memo[key] = _run(prompts, policy, pool, **kwargs)
        return memo[key]

    def _run(prompts: list[list[int]], policy: str, pool: int, **kwargs) -> dict:
        kwargs.setdefault("max_running_requests", 1)
        sa = ServerArgs(model_path=tiny_gqa_dir, max_total_tokens=pool, schedule_policy=policy, **kwargs)
        sched = Scheduler(sa, config, model_dir, tokenizer)
        reqs = []
        for i, p in enumerate(prompts):
            sp = SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0})
            sp.normalize(tokenizer)
            reqs.append(Req(f"r{i}", p, sp))
        for r in reqs:  # all at once, before the first step
            sched.add_request(r)
        for _ in range(10 * len(reqs) + 10):
            if not sched.has_work():
                break
            sched.step()
        assert not sched.has_work(), "scheduler did not drain"
        assert all(r.finished() and len(r.output_ids) == 1 for r in reqs)
        sched.tree_cache.check_invariants()
        sched.check_pool_whole()
        stats = sched.get_stats()
        assert stats["num_prompt_tokens"] == sum(map(len, prompts))
        return stats

    return run


# optimal_hit_rate on hand-computed examples ----------------------------------------------------------------------
def test_optimal_hit_rate_trivial():
    assert optimal_hit_rate([]) == 0.0
    assert optimal_hit_rate([(None, [])]) == 0.0
    assert optimal_hit_rate([(None, list(range(3, 13)))]) == 0.0  # one request: nothing to reuse
    assert optimal_hit_rate([(None, [5, 6, 7]), (None, [8, 9])]) == 0.0  # disjoint


def test_optimal_hit_rate_shared_prefix():
    # [1 2 3 4] computed once; each request adds 2 of its own: 4 + 2 + 2 = 8 of 12 computed.
    reqs = [(None, [1, 2, 3, 4, 5, 6]), (None, [1, 2, 3, 4, 7, 8])]
    assert optimal_hit_rate(reqs) == pytest.approx(1 - 8 / 12)


def test_optimal_hit_rate_duplicates_cost_one_token():
    # The copy still computes its last token (its logits are sampled): 3 + 1 of 6.
    assert optimal_hit_rate([(None, [1, 2, 3]), (None, [1, 2, 3])]) == pytest.approx(1 - 4 / 6)
    # Three copies: 3 + 1 + 1 of 9.
    assert optimal_hit_rate([(None, [1, 2, 3])] * 3) == pytest.approx(1 - 5 / 9)


def test_optimal_hit_rate_prefix_request_is_order_independent():
    # Best order runs the short prompt first: 2 + 2 of 6 (the other order would cost 4 + 1).
    a, b = (None, [1, 2]), (None, [1, 2, 3, 4])
    assert optimal_hit_rate([a, b]) == pytest.approx(1 - 4 / 6)
    assert optimal_hit_rate([b, a]) == pytest.approx(1 - 4 / 6)


def test_optimal_hit_rate_namespaces_do_not_share():
    assert optimal_hit_rate([("img-a", [1, 2, 3]), ("img-b", [1, 2, 3])]) == 0.0
    assert optimal_hit_rate([("img-a", [1, 2, 3]), ("img-a", [1, 2, 4])]) == pytest.approx(1 - 4 / 6)


def test_optimal_hit_rate_two_level_tree():
    # root edge [1 2 3 4]; children [5 6] and [7 8 9]; [7 8 9] has a child [10].
    # Requests (6 + 7 + 8 = 21 tokens); distinct tree tokens 4 + 2 + 3 + 1 = 10.
    reqs = [(None, [1, 2, 3, 4, 5, 6]), (None, [1, 2, 3, 4, 7, 8, 9]), (None, [1, 2, 3, 4, 7, 8, 9, 10])]
    assert optimal_hit_rate(reqs) == pytest.approx(11 / 21)


def _brute_force_optimum(prompts: list[list[int]]) -> float:
    """Min over all sequential orders of the engine's cost model with an unbounded cache: a request computes
    len - min(len - 1, longest prefix it shares with any earlier request)."""
    total = sum(map(len, prompts))
    best = None
    for order in itertools.permutations(prompts):
        cost = 0
        for i, p in enumerate(order):
            shared = 0
            for q in order[:i]:
                n = 0
                while n < min(len(p), len(q)) and p[n] == q[n]:
                    n += 1
                shared = max(shared, n)
            cost += len(p) - min(len(p) - 1, shared)
        best = cost if best is None else min(best, cost)
    return 1 - best / total


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=6), min_size=1, max_size=5))
def test_optimal_hit_rate_matches_brute_force(prompts):
    assert optimal_hit_rate([(None, p) for p in prompts]) == pytest.approx(_brute_force_optimum(prompts))


# The theorem on the scheduler -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", TREE_SEEDS)
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
@pytest.mark.parametrize("pool", ["large", "tight"])
def test_cache_aware_policies_reach_optimal_hit_rate(run_policy, policy, pool, seed):
    prompts = random_request_tree(seed)
    longest = max(map(len, prompts))
    size = LARGE_POOL if pool == "large" else longest
    opt = optimal_hit_rate([(None, p) for p in prompts])
    stats = run_policy(prompts, policy, size)
    assert stats["cache_hit_rate"] >= opt - EPS, (
        f"{policy} hit rate {stats['cache_hit_rate']:.4f} < optimal {opt:.4f} "
        f"(pool {size}, {len(prompts)} requests, longest {longest})")
    if pool == "tight":
        assert stats["num_evicted_tokens"] > 0  # the tight pool really forced evictions


@pytest.mark.parametrize("seed", TREE_SEEDS)
@pytest.mark.parametrize("policy", ["fcfs", "random"])
def test_fcfs_and_random_are_worse_under_eviction(run_policy, policy, seed):
    prompts = random_request_tree(seed)
    opt = optimal_hit_rate([(None, p) for p in prompts])
    # Without eviction and one request at a time, every order reuses everything: order cannot matter.
    assert run_policy(prompts, policy, LARGE_POOL)["cache_hit_rate"] >= opt - EPS
    # With a pool that only just holds the longest request it does: measurably (>= 5 points) below optimal.
    tight = run_policy(prompts, policy, max(map(len, prompts)))["cache_hit_rate"]
    assert tight <= opt - 0.05, f"{policy}: {tight:.4f} vs optimal {opt:.4f}"


def test_tight_pool_gap_summary(run_policy):
    """Across the trees, the cache-aware policies lose nothing and fcfs/random lose a lot (mean gap)."""
    gaps = {p: [] for p in ("lpm", "dfs-weight", "fcfs", "random")}
    for seed in TREE_SEEDS:
        prompts = random_request_tree(seed)
        opt = optimal_hit_rate([(None, p) for p in prompts])
        for policy in gaps:
            gaps[policy].append(opt - run_policy(prompts, policy, max(map(len, prompts)))["cache_hit_rate"])
    mean = {p: sum(g) / len(g) for p, g in gaps.items()}
    assert mean["lpm"] <= EPS and mean["dfs-weight"] <= EPS, mean
    assert mean["fcfs"] >= 0.1 and mean["random"] >= 0.1, mean


@pytest.mark.parametrize("seed", (10, 11))
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_optimal_with_prefix_requests(run_policy, policy, seed):
    """Internal tree nodes as requests too: within one token per prefix request of the optimum (see EPS)."""
    prompts = random_request_tree(seed, internal_request_p=0.5)
    k = count_prefix_requests(prompts)
    assert k > 0
    opt = optimal_hit_rate([(None, p) for p in prompts])
    eps = k / sum(map(len, prompts)) + EPS
    for size in (LARGE_POOL, max(map(len, prompts))):
        hit = run_policy(prompts, policy, size)["cache_hit_rate"]
        assert hit >= opt - eps, f"{policy} pool {size}: {hit:.4f} < {opt:.4f} - {eps:.4f}"
