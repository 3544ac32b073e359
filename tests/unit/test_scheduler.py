"""The continuous-batching scheduler under pressure: retraction and eviction, chunked prefill, paging, the radix
cache on/off, the starvation bound, in-batch prefix dedup, frontend hints (``max_new_tokens=0``) and aborts.

Most tests drive a ``Scheduler`` directly (no engine thread), so every step is deterministic; a few go through
the ``Engine``. Every scheduler made by ``make_sched`` is checked when its test ends: drained, radix-tree
invariants hold, and the KV pool is whole (free + evictable == total, nothing locked, all request slots free).
"""

from __future__ import annotations

import logging
import random

import pytest

from tests.conftest import make_engine

VOCAB = 512  # dummy_config's vocabulary


# Helpers ----------------------------------------------------------------------------------------------------------
def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def assets(tiny_gqa_dir):
    from sglang_backend.runtime.model_loader.loader import load_model_assets
    from sglang_backend.runtime.server_args import ServerArgs

    logging.getLogger("sglang_backend").setLevel(logging.WARNING)
    return load_model_assets(ServerArgs(model_path=tiny_gqa_dir))


def _new_scheduler(assets, **kwargs):
    from sglang_backend.runtime.managers.scheduler import Scheduler
    from sglang_backend.runtime.server_args import ServerArgs

    model_dir, config, tokenizer = assets
    return Scheduler(ServerArgs(model_path=model_dir, **kwargs), config, model_dir, tokenizer)


def _check_idle_and_whole(sched) -> None:
    assert not sched.has_work(), "scheduler still has work"
    sched.tree_cache.check_invariants()
    sched.check_pool_whole()


@pytest.fixture
def make_sched(assets):
    """make_sched(**server_args) -> Scheduler on the tiny model; each one is checked whole after the test."""
    made = []

    def make(**kwargs):
        sched = _new_scheduler(assets, **kwargs)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        _check_idle_and_whole(sched)


def new_req(sched, rid: str, ids: list[int], **params):
    from sglang_backend.runtime.managers.schedule_batch import Req
    from sglang_backend.runtime.sampling_params import SamplingParams

    sp = SamplingParams.from_dict({"temperature": 0, **params})
    sp.normalize(sched.tokenizer)
    return Req(rid, ids, sp)


def drain(sched, max_steps: int = 20000) -> int:
    """Steps until idle; returns the number of steps."""
    n = 0
    while sched.has_work():
        sched.step()
        n += 1
        assert n <= max_steps, "scheduler did not drain"
    return n


def run_workload(sched, workload) -> list[list[int]]:
    """Submits every (ids, params) at once, runs to idle, returns the output ids in submission order."""
    reqs = [new_req(sched, f"r{i}", ids, **params) for i, (ids, params) in enumerate(workload)]
    for r in reqs:
        sched.add_request(r)
    drain(sched)
    for r in reqs:
        assert r.finished() and r.finished_reason["type"] == "length", (r, r.finished_reason)
        assert len(r.output_ids) == r.sampling_params.max_new_tokens
    return [r.output_ids for r in reqs]


# Memory pressure: a workload that needs ~5x the pool -------------------------------------------------------------
def pressure_workload(seed: int = 0) -> list[tuple[list[int], dict]]:
    """8 requests over 3 shared 12-token prefixes, prompts 20-28 tokens, 24-40 greedy output tokens (long
    outputs: admission reserves only new_token_ratio (0.7) of them, so decode runs out and must retract)."""
    rng = random.Random(seed)
    prefixes = [rand_ids(rng, 12) for _ in range(3)]
    return [(prefixes[i % 3] + rand_ids(rng, rng.randint(8, 16)),
             {"max_new_tokens": rng.randint(24, 40), "ignore_eos": True}) for i in range(8)]


WORKLOAD = pressure_workload()
DEMAND = sum(len(ids) + p["max_new_tokens"] for ids, p in WORKLOAD)  # KV tokens if nothing were shared
SMALL_POOL = DEMAND // 5 // 4 * 4  # a multiple of 4 so page_size=4 can use it too


@pytest.fixture(scope="module")
def reference_outputs(assets):
    """Greedy outputs with a large pool and default settings (no pressure, no chunking)."""
    sched = _new_scheduler(assets, max_total_tokens=4096)
    outs = run_workload(sched, WORKLOAD)
    _check_idle_and_whole(sched)
    assert sched.get_stats()["num_retractions"] == 0
    return outs


def test_memory_pressure_completes_with_identical_outputs(make_sched, reference_outputs):
    assert DEMAND >= 4.5 * SMALL_POOL
    assert max(len(ids) + p["max_new_tokens"] for ids, p in WORKLOAD) < SMALL_POOL
    sched = make_sched(max_total_tokens=SMALL_POOL)
    assert run_workload(sched, WORKLOAD) == reference_outputs
    stats = sched.get_stats()
    assert stats["num_finished"] == len(WORKLOAD) and stats["num_aborted"] == 0
    assert stats["num_retractions"] > 0, stats
    assert stats["num_evicted_tokens"] > 0, stats


@pytest.mark.parametrize("variant", [
    dict(chunked_prefill_size=16),
    dict(disable_radix_cache=True),
    dict(page_size=4),
    dict(page_size=4, chunked_prefill_size=16),
    dict(enable_mixed_chunk=True, chunked_prefill_size=16),
    dict(enable_mixed_chunk=True, page_size=4, chunked_prefill_size=16),
], ids=["chunked16", "radix-off", "page4", "page4-chunked16", "mixed-chunked16", "mixed-page4-chunked16"])
def test_outputs_identical_across_variants_under_pressure(make_sched, reference_outputs, variant):
    """Chunked prefill on vs off, radix cache on vs off, page_size 4 vs 1: same greedy tokens, with the
    small pool (so the variant also goes through retraction)."""
    sched = make_sched(max_total_tokens=SMALL_POOL, **variant)
    assert run_workload(sched, WORKLOAD) == reference_outputs
    stats = sched.get_stats()
    assert stats["num_retractions"] > 0, stats
    check_variant_really_applied(sched, variant)


def check_variant_really_applied(sched, variant, expect_hits: bool = True) -> None:
    stats = sched.get_stats()
    if variant.get("disable_radix_cache"):
        assert stats["num_cached_tokens"] == 0 and stats["evictable_tokens"] == 0
    elif expect_hits:  # resumed (retracted) requests and later admissions reuse cached prefixes
        assert stats["num_cached_tokens"] > 0
    if "chunked_prefill_size" in variant:
        assert 0 < stats["max_prefill_batch_tokens"] <= variant["chunked_prefill_size"], stats
        assert stats["num_chunked_prefill_batches"] > 0, "no prompt was split into chunks"
    if variant.get("enable_mixed_chunk"):
        assert stats["num_mixed_batches"] > 0, "no prefill batch decoded the running requests"


@pytest.mark.parametrize("variant", [
    dict(chunked_prefill_size=16),
    dict(disable_radix_cache=True),
    dict(page_size=4),
    dict(disable_radix_cache=True, chunked_prefill_size=8),
    dict(enable_mixed_chunk=True, disable_radix_cache=True, chunked_prefill_size=8),
], ids=["chunked16", "radix-off", "page4", "radix-off-chunked8", "mixed-radix-off-chunked8"])
def test_outputs_identical_across_variants_unpressured(make_sched, reference_outputs, variant):
    sched = make_sched(max_total_tokens=4096, **variant)
    assert run_workload(sched, WORKLOAD) == reference_outputs
    assert sched.get_stats()["num_retractions"] == 0
    # Everything is admitted in the first batch unless chunking splits it: hits only with chunking.
    check_variant_really_applied(sched, variant, expect_hits="chunked_prefill_size" in variant)


def test_mixed_chunk_decodes_running_requests_while_a_long_prompt_is_chunked(make_sched):
    """With enable_mixed_chunk, a running request gains one token in every chunk of a long prompt's prefill
    (without it, it waits for the whole prompt); both outputs equal those of the unmixed scheduler."""
    rng = random.Random(5)
    short, long = rand_ids(rng, 12), rand_ids(rng, 96)
    outputs, growth = {}, {}
    for mixed in (False, True):
        sched = make_sched(max_total_tokens=4096, chunked_prefill_size=16, enable_mixed_chunk=mixed)
        first = new_req(sched, "short", short, max_new_tokens=12, ignore_eos=True)
        sched.add_request(first)
        sched.step()  # its prefill: it is running now
        assert len(first.output_ids) == 1 and sched.running == [first]
        second = new_req(sched, "long", long, max_new_tokens=4, ignore_eos=True)
        sched.add_request(second)
        for _ in range(len(long) // 16):  # the long prompt's chunks
            sched.step()
        growth[mixed] = len(first.output_ids) - 1
        drain(sched)
        outputs[mixed] = (first.output_ids, second.output_ids)
        assert sched.get_stats()["num_mixed_batches"] == (len(long) // 16 if mixed else 0)
    assert growth == {False: 0, True: len(long) // 16}
    assert outputs[True] == outputs[False]


def test_mixed_chunk_under_memory_pressure_finishes_everything_with_the_same_tokens(make_sched):
    """Running requests grow by one token in every mixed chunk: in pools too small for a long chunked prompt
    beside 24 decoding requests (retractions happen), every request still gets all its tokens, equal to a roomy
    pool's without mixed chunks."""
    rng = random.Random(21)
    shorts, long = [rand_ids(rng, 12) for _ in range(24)], rand_ids(rng, 200)

    def run_all(pool: int, mixed: bool) -> tuple[list[list[int]], int]:
        sched = make_sched(max_total_tokens=pool, chunked_prefill_size=16, enable_mixed_chunk=mixed)
        reqs = [new_req(sched, f"s{i}", ids, max_new_tokens=48, ignore_eos=True) for i, ids in enumerate(shorts)]
        for r in reqs:
            sched.add_request(r)
        sched.step()  # the short prompts' prefill: they are decoding now
        reqs.append(new_req(sched, "long", long, max_new_tokens=4, ignore_eos=True))
        sched.add_request(reqs[-1])
        drain(sched)
        assert all(r.finished_reason["type"] == "length" for r in reqs), [r.finished_reason for r in reqs]
        return [r.output_ids for r in reqs], sched.get_stats()["num_retractions"]

    expected, _ = run_all(4096, mixed=False)
    retractions = 0
    for pool in (216, 280):
        outputs, n = run_all(pool, mixed=True)
        assert outputs == expected, pool
        retractions += n
    assert retractions > 0, "no memory pressure: the pools are too large for this test"


# Starvation bound -------------------------------------------------------------------------------------------------
def rounds_until_low_match_finishes(make_sched, starvation_limit: int, stream_len: int) -> int:
    """LPM, one request per prefill round. A low-match request waits while every round a new request arrives
    that shares a long cached prefix (so LPM always prefers it). Returns the rounds until it finishes."""
    rng = random.Random(7)
    sched = make_sched(schedule_policy="lpm", max_running_requests=1, starvation_limit=starvation_limit,
                       max_total_tokens=2048)
    hot = rand_ids(rng, 96)
    sched.add_request(new_req(sched, "warm", hot + rand_ids(rng, 8), max_new_tokens=1))
    drain(sched)
    low = new_req(sched, "low", rand_ids(rng, 40), max_new_tokens=1)
    sched.add_request(low)
    rounds = sent = 0
    while not low.finished():
        if sent < stream_len:
            sched.add_request(new_req(sched, f"hot{sent}", hot + rand_ids(rng, 8), max_new_tokens=1))
            sent += 1
        sched.step()
        rounds += 1
        assert rounds <= stream_len + starvation_limit + 10
    drain(sched)
    # The stream really did hit the cache.
    assert sched.get_stats()["num_cached_tokens"] >= 96 * min(sent, rounds - 1)
    return rounds


def test_starvation_bound_under_lpm(make_sched):
    limit, stream = 8, 40
    with_aging = rounds_until_low_match_finishes(make_sched, limit, stream)
    assert with_aging <= limit + 2, with_aging
    # Without aging, the low-match request waits as long as the stream of high-match requests lasts.
    without_aging = rounds_until_low_match_finishes(make_sched, 10**9, stream)
    assert without_aging >= stream + 1, without_aging
    assert without_aging > 3 * with_aging


def test_starved_request_goes_first_among_several(make_sched):
    """Two low-match requests and a steady high-match stream, two slots: both low ones finish within the bound."""
    rng = random.Random(3)
    limit = 5
    sched = make_sched(schedule_policy="lpm", max_running_requests=2, starvation_limit=limit,
                       max_total_tokens=2048)
    hot = rand_ids(rng, 64)
    sched.add_request(new_req(sched, "warm", hot + rand_ids(rng, 4), max_new_tokens=1))
    drain(sched)
    lows = [new_req(sched, f"low{i}", rand_ids(rng, 30), max_new_tokens=3) for i in range(2)]
    for r in lows:
        sched.add_request(r)
    prefill_rounds = 0
    for i in range(60):
        for j in range(2):
            sched.add_request(new_req(sched, f"hot{i}.{j}", hot + rand_ids(rng, 6), max_new_tokens=3))
        before = sched.stats.num_prefill_batches
        sched.step()
        prefill_rounds += sched.stats.num_prefill_batches - before
        if all(r.finished() for r in lows):
            break
    assert all(r.finished() for r in lows)
    assert prefill_rounds <= limit + 3, prefill_rounds
    drain(sched)


# In-batch prefix dedup --------------------------------------------------------------------------------------------
def shared_uncached_workload(n: int = 4, prefix_len: int = 128, suffix_len: int = 16):
    rng = random.Random(11)
    prefix = rand_ids(rng, prefix_len)
    return [(prefix + rand_ids(rng, suffix_len), {"max_new_tokens": 1}) for _ in range(n)]


@pytest.mark.parametrize("sharing", [True, False], ids=["shared_in_batch", "held_back"])
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_in_batch_prefix_dedup_computes_shared_prefix_once(make_sched, policy, sharing):
    work = shared_uncached_workload()
    on = make_sched(schedule_policy=policy, enable_in_batch_prefix_dedup=True, max_total_tokens=2048,
                    disable_in_batch_prefix_sharing=not sharing)
    off = make_sched(schedule_policy=policy, enable_in_batch_prefix_dedup=False, max_total_tokens=2048)
    outs_on, outs_off = run_workload(on, work), run_workload(off, work)
    assert outs_on == outs_off
    s_on, s_off = on.get_stats(), off.get_stats()
    # Off: all four in one batch, each computing the 128-token prefix: 4 * 144 tokens, nothing cached.
    assert s_off["num_forward_tokens"] == 4 * 144 and s_off["num_cached_tokens"] == 0
    assert s_off["num_prefill_batches"] == 1
    # On: one request computes the prefix, the other three read it: in the same forward (sharing) or held back a
    # round to hit it in the tree.
    assert s_on["num_forward_tokens"] == 144 + 3 * 16, s_on
    assert s_on["num_cached_tokens"] == 3 * 128
    assert s_on["num_prefill_batches"] == (1 if sharing else 2), s_on
    assert s_on["num_borrowed_prefix_tokens"] == (3 * 128 if sharing else 0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_in_batch_sharing_chains_and_nested_prefixes(make_sched, page_size):
    """Requests that share a header and, two by two, a longer context behind it (HellaSwag's shape), one of them a
    prefix of another, with cached parts from an earlier request: one prefill batch, each shared token computed
    once, the tokens of the reference without any cache."""
    rng = random.Random(5)
    header = rand_ids(rng, 80)  # 40 of it cached by the warm-up, 40 (>= the dedup window) shared uncached
    contexts = [header + rand_ids(rng, 43) for _ in range(3)]
    warm = [(header[:40] + rand_ids(rng, 9), {"max_new_tokens": 2, "ignore_eos": True})]
    work = [(c + rand_ids(rng, rng.randint(3, 20)), {"max_new_tokens": 3, "ignore_eos": True})
            for c in contexts for _ in range(2)]
    # A prefix of another's prompt, arriving after it (a request borrows from the latest admitted sharer).
    work.insert(1, (work[0][0][:-2], {"max_new_tokens": 3, "ignore_eos": True}))
    reference = run_workload(make_sched(disable_radix_cache=True, page_size=page_size), warm + work)
    sched = make_sched(page_size=page_size)
    run_workload(sched, warm)
    before = sched.get_stats()
    assert run_workload(sched, work) == reference[len(warm):]
    after = sched.get_stats()
    assert after["num_prefill_batches"] - before["num_prefill_batches"] == 1
    assert after["num_borrowed_prefix_tokens"] > 0
    computed = after["num_forward_tokens"] - before["num_forward_tokens"]
    decoded = sum(p["max_new_tokens"] - 1 for _, p in work)
    distinct = len({tuple(ids[:i + 1]) for ids, _ in work for i in range(len(ids))})
    # Each distinct uncached token once, plus the last token of the request whose prompt is another's prefix
    # (its logits are sampled); with pages, each borrower's own part starts on a page boundary.
    cached_before = 40 - 40 % page_size
    expected = distinct - cached_before + 1
    if page_size == 1:
        assert computed - decoded == expected, (computed, decoded, expected)
    else:
        assert expected <= computed - decoded <= expected + len(work) * (page_size - 1), (computed, decoded, expected)


def test_in_batch_sharing_requeues_borrowers_of_a_failed_request(make_sched):
    """The request whose new KV the others borrowed fails in the forward: it alone fails; the borrowers go back
    to the queue (their borrowed slots were its, and are freed) and finish with the tokens of a clean run."""
    from sglang_backend.runtime.managers.fault_injection import FaultInjector, FaultRule

    work = shared_uncached_workload()
    poison = 1
    work[0] = (work[0][0][:-1] + [poison], work[0][1])  # only the first (the lender) holds the token
    assert all(poison not in ids for ids, _ in work[1:])
    clean = run_workload(make_sched(max_total_tokens=2048), work[1:])
    sched = make_sched(max_total_tokens=2048)
    sched.fault_injector = FaultInjector([FaultRule("raise", poison)])
    reqs = [new_req(sched, f"r{i}", ids, **params) for i, (ids, params) in enumerate(work)]
    for r in reqs:
        sched.add_request(r)
    drain(sched)
    assert reqs[0].finished_reason["type"] == "abort" and reqs[0].finished_reason["status_code"] == 500
    assert [r.output_ids for r in reqs[1:]] == clean
    assert all(r.finished_reason["type"] == "length" for r in reqs[1:])


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "random"])
def test_in_batch_dedup_does_not_hold_back_cached_prefixes(make_sched, policy):
    """A prefix that is already cached is not being computed by anyone: requests sharing it go in one batch."""
    work = shared_uncached_workload()
    sched = make_sched(schedule_policy=policy, enable_in_batch_prefix_dedup=True, max_total_tokens=2048)
    sched.add_request(new_req(sched, "warm", work[0][0][:128] + [5, 6, 7], max_new_tokens=1))
    drain(sched)
    before = sched.get_stats()
    run_workload(sched, work)
    after = sched.get_stats()
    assert after["num_cached_tokens"] - before["num_cached_tokens"] == 4 * 128
    assert after["num_prefill_batches"] - before["num_prefill_batches"] == 1, (
        "requests whose shared prefix is already cached were held back by in-batch dedup")


@pytest.mark.parametrize("evict", [False, True])
def test_admission_rematches_only_after_an_eviction(make_sched, evict):
    """A request matched against the tree while the policy orders the queue keeps that match at admission, unless
    an allocation evicted since: then it is matched again, as its old match may name freed slots. Here the whole
    tree is evicted between ordering and admission (as an earlier admission's allocation would): the request
    must compute its prompt from scratch and still give the reference's tokens."""
    rng = random.Random(11)
    prefix = rand_ids(rng, 40)
    warm = (prefix + rand_ids(rng, 4), {"max_new_tokens": 1, "ignore_eos": True})
    work = [(prefix + rand_ids(rng, 6), {"max_new_tokens": 6, "ignore_eos": True})]
    reference = run_workload(make_sched(max_total_tokens=512), work)
    sched = make_sched(max_total_tokens=512)
    run_workload(sched, [warm])  # caches the prefix
    admit, matches = sched._try_admit, []

    def evict_then_admit(plan, req):
        if evict:
            sched.tree_cache.evict(10**6)
        result = admit(plan, req)
        matches.append(len(req.prefix_indices))
        return result

    match, match_calls = sched.policy.match, []
    sched.policy.match = lambda req: match_calls.append(req.rid) or match(req)
    sched._try_admit = evict_then_admit
    assert run_workload(sched, work) == reference
    assert matches == [0 if evict else 40]
    assert match_calls == (["r0", "r0"] if evict else ["r0"])  # ordering, then admission only after an eviction
    assert sched.get_stats()["num_cached_tokens"] == (0 if evict else 40)


# Prompt logprobs: bounded logits per prefill batch -----------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
def test_prompt_logprobs_chunked_to_the_logit_budget(make_sched, page_size):
    """A batch computes at most max_prefill_logprob_tokens full-vocabulary logits rows for prompt logprobs (long
    prompts asking for them are chunked), with the same logprobs and outputs as an unbounded batch."""
    from sglang_backend.runtime.managers.schedule_batch import Req
    from sglang_backend.runtime.sampling_params import SamplingParams

    rng = random.Random(12)
    prompts = [rand_ids(rng, n) for n in (40, 7, 33)]
    starts = [0, 0, 20]  # the last asks for logprobs from position 20 only: its first 19 tokens need no rows

    def run(**kw):
        sched = make_sched(max_total_tokens=1024, page_size=page_size, **kw)
        batch_rows = []
        build = sched._build_extend_batch
        sched._build_extend_batch = lambda *a: (lambda b: batch_rows.append(sum(map(len, b.logit_rows))) or b)(build(*a))
        reqs = []
        for i, (ids, start) in enumerate(zip(prompts, starts)):
            sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 3})
            sp.normalize(sched.tokenizer)
            reqs.append(Req(f"r{i}", ids, sp, return_logprob=True, logprob_start_len=start, top_logprobs_num=2))
            sched.add_request(reqs[-1])
        drain(sched)
        return reqs, batch_rows

    free, free_rows = run()
    capped, capped_rows = run(max_prefill_logprob_tokens=8)
    assert max(free_rows) > 40 and max(capped_rows) <= 8 + len(prompts)  # + each request's sampled last row
    for a, b in zip(free, capped):
        assert a.output_ids == b.output_ids
        assert len(a.input_token_logprobs) == len(b.input_token_logprobs) == len(a.origin_input_ids) - a.logprob_start_len
        for (la, ta), (lb, tb) in zip(a.input_token_logprobs, b.input_token_logprobs):
            assert ta == tb and (la is None) == (lb is None) and (la is None or abs(la - lb) < 1e-5)
        assert [[t for _, t in row] for row in a.input_top_logprobs[1:]] == \
            [[t for _, t in row] for row in b.input_top_logprobs[1:]]


# Frontend hint: max_new_tokens=0 ------------------------------------------------------------------------------------
def test_prefill_only_hint_caches_prefix(tiny_gqa_dir):
    rng = random.Random(5)
    prefix = rand_ids(rng, 100)
    engine = make_engine(tiny_gqa_dir)
    try:
        hint = engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 0})
        assert hint["output_ids"] == [] and hint["text"] == ""
        assert hint["meta_info"]["completion_tokens"] == 0
        assert hint["meta_info"]["finish_reason"]["type"] == "length"
        branches = engine.generate(input_ids=[prefix + rand_ids(rng, 12) for _ in range(3)],
                                   sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert all(b["meta_info"]["cached_tokens"] >= len(prefix) for b in branches)
        stats = engine.get_stats()
        assert stats["num_cached_tokens"] >= 3 * len(prefix)
        engine.check_pool_whole()
    finally:
        engine.shutdown()


def test_prefill_only_hint_on_scheduler(make_sched):
    """The hint finishes in its prefill step with no output and leaves the prompt in the tree."""
    rng = random.Random(6)
    sched = make_sched(max_total_tokens=1024)
    prefix = rand_ids(rng, 64)
    hint = new_req(sched, "hint", prefix, max_new_tokens=0)
    sched.add_request(hint)
    assert sched.step() == [hint]
    assert hint.finished() and hint.output_ids == [] and not sched.has_work()
    assert sched.get_stats()["evictable_tokens"] == len(prefix)
    follow = new_req(sched, "follow", prefix + rand_ids(rng, 5), max_new_tokens=2)
    sched.add_request(follow)
    drain(sched)
    assert follow.cached_tokens == len(prefix)


# Abort ------------------------------------------------------------------------------------------------------------
def test_abort_waiting_and_running_frees_kv(make_sched):
    rng = random.Random(8)
    sched = make_sched(max_running_requests=2, max_total_tokens=1024)
    shared = rand_ids(rng, 20)
    reqs = [new_req(sched, f"r{i}", shared + rand_ids(rng, 10), max_new_tokens=30, ignore_eos=True)
            for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    sched.step()  # prefill r0, r1
    sched.step()  # one decode step
    assert [r.rid for r in sched.running] == ["r0", "r1"]
    assert sched.abort_request("nope") is None
    running = sched.abort_request("r0")
    waiting = sched.abort_request("r3")
    assert running is reqs[0] and waiting is reqs[3]
    for r in (running, waiting):
        assert r.finished() and r.finished_reason["type"] == "abort"
        assert r.req_pool_idx is None
    assert sched.tree_cache.protected_size() > 0  # r1 still runs on its locked prefix
    drain(sched)
    assert len(reqs[1].output_ids) == len(reqs[2].output_ids) == 30
    assert len(reqs[0].output_ids) == 2 and reqs[3].output_ids == []
    assert sched.get_stats()["num_aborted"] == 2


def test_abort_everything_midway_leaves_pool_whole(make_sched):
    rng = random.Random(9)
    sched = make_sched(max_running_requests=3, max_total_tokens=512)
    reqs = [new_req(sched, f"r{i}", rand_ids(rng, 30), max_new_tokens=50, ignore_eos=True) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(5):
        sched.step()
    for r in reqs:
        assert sched.abort_request(r.rid) is r
    assert not sched.has_work()
    _check_idle_and_whole(sched)


def test_abort_chunked_prefill_frees_kv(make_sched):
    rng = random.Random(10)
    sched = make_sched(chunked_prefill_size=16, max_total_tokens=1024)
    req = new_req(sched, "long", rand_ids(rng, 100), max_new_tokens=5)
    other = new_req(sched, "other", rand_ids(rng, 10), max_new_tokens=5)
    sched.add_request(req)
    sched.add_request(other)
    sched.step()
    assert sched.chunked_req is req and 0 < req.kv_len < 100
    assert sched.abort_request("long") is req
    assert sched.chunked_req is None and req.finished_reason["type"] == "abort"
    drain(sched)
    assert other.finished() and len(other.output_ids) == 5


def test_abort_after_retraction(make_sched):
    """A request retracted under memory pressure (back in the waiting queue) can be aborted too."""
    sched = make_sched(max_total_tokens=SMALL_POOL)
    reqs = [new_req(sched, f"r{i}", ids, **p) for i, (ids, p) in enumerate(WORKLOAD)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(5000):
        sched.step()
        retracted = [r for r in sched.waiting_queue if r.num_retractions > 0]
        if retracted:
            break
    assert retracted, "no retraction happened"
    victim = retracted[0]
    assert sched.abort_request(victim.rid) is victim
    drain(sched)
    assert all(r.finished() for r in reqs)
    assert victim.finished_reason["type"] == "abort"


def test_engine_abort_streaming_request(tiny_gqa_dir):
    rng = random.Random(12)
    engine = make_engine(tiny_gqa_dir)
    try:
        it = engine.generate(input_ids=rand_ids(rng, 20), rid="victim", stream=True,
                             sampling_params={"max_new_tokens": 400, "ignore_eos": True, "temperature": 0})
        first = next(it)
        assert first["meta_info"]["finish_reason"] is None
        engine.abort_request("victim")
        last = first
        for chunk in it:
            last = chunk
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["meta_info"]["completion_tokens"] < 400
        # The engine still serves requests afterwards.
        out = engine.generate(input_ids=rand_ids(rng, 10), sampling_params={"max_new_tokens": 3})
        assert len(out["output_ids"]) <= 3
        engine.check_pool_whole()
    finally:
        engine.shutdown()


def test_in_batch_prefix_index_finds_only_true_sharers():
    """The admitted-prefix index answers by a window lookup, but a hit still needs the whole prefix equal, the
    same namespace and enough tokens; requests with a cached prefix are asked about from their own start."""
    import torch

    from sglang_backend.runtime.managers.schedule_policy import IN_BATCH_DEDUP_MIN_TOKENS as W
    from sglang_backend.runtime.managers.schedule_policy import InBatchPrefixIndex

    class R:  # the fields the index reads
        def __init__(self, ids, cached=0, extra_key=None):
            self.origin_input_ids = self.all_ids = list(ids)
            self.seq_len = len(ids)
            self.prefix_indices = torch.zeros(cached, dtype=torch.int64)
            self.extra_key = extra_key

    rng = random.Random(3)
    prefix = rand_ids(rng, 100)
    index = InBatchPrefixIndex()
    assert not index.shares_uncached_prefix(R(prefix + [1]))  # nothing admitted yet
    index.add(R(prefix + rand_ids(rng, 8)))
    assert index.shares_uncached_prefix(R(prefix + rand_ids(rng, 8)))
    assert index.shares_uncached_prefix(R(prefix + [5], cached=40))  # asked from its cached end
    assert not index.shares_uncached_prefix(R(prefix[: W - 1]))  # too short to be worth holding back
    assert not index.shares_uncached_prefix(R(prefix + [5], extra_key="other"))
    # Same window of ids where the cached part ends, a different earlier token: not the same prefix.
    other_head = [prefix[0] + 1] + prefix[1:]
    assert not index.shares_uncached_prefix(R(other_head, cached=40))
    # Requests admitted after a window table exists are indexed in it too.
    late = rand_ids(rng, 80)
    index.add(R(late))
    assert index.shares_uncached_prefix(R(late + [9], cached=40))


@pytest.mark.parametrize("where", ["mask", "advance"])
def test_grammar_over_budget_mid_decode_is_a_400_for_that_request_only(make_sched, monkeypatch, where):
    """A grammar that goes past its budget while decoding (llguidance's step fuel, a lexer limit) is the client's
    grammar: that request ends with a 400 (not a 500), its KV goes back whole, the other request goes on."""
    from sglang_backend.runtime.constrained import GrammarTooComplex

    sched = make_sched(max_total_tokens=1024)
    rng = random.Random(3)
    a = new_req(sched, "a", rand_ids(rng, 12), max_new_tokens=8, regex="[a-z ]{1,40}")
    b = new_req(sched, "b", rand_ids(rng, 12), max_new_tokens=8, ignore_eos=True)
    apply, steps = sched._apply_grammar_masks, []

    def over_budget(*args):
        raise GrammarTooComplex("grammar too complex: step fuel ran out")

    def apply_then_run_out(reqs, logits):
        grammars = [r.grammar for r in reqs if r.grammar is not None]
        steps.extend(grammars[:1])
        if grammars and len(steps) == 3:  # the grammar request's third sampling step
            monkeypatch.setattr(type(grammars[0]), "fill_mask" if where == "mask" else "advance", over_budget)
        return apply(reqs, logits)

    sched._apply_grammar_masks = apply_then_run_out
    for r in (a, b):
        sched.add_request(r)
    drain(sched)
    assert a.finished_reason == {"type": "abort", "message": "grammar too complex: step fuel ran out",
                                 "status_code": 400}, a.finished_reason
    assert len(a.output_ids) < 8 and sched.get_stats()["num_aborted"] == 1  # ended early, alone
    assert b.finished_reason["type"] == "length" and len(b.output_ids) == 8


def test_a_failing_logprob_step_fails_that_request_only(make_sched, monkeypatch):
    """Prompt logprobs that raise for one request end it with a 500 and free its KV; the other request of the
    same prefill batch goes on (the loop does not die)."""
    from sglang_backend.runtime.managers.scheduler import Scheduler

    sched = make_sched(max_total_tokens=1024)
    rng = random.Random(9)
    a = new_req(sched, "a", rand_ids(rng, 12), max_new_tokens=4, ignore_eos=True)
    b = new_req(sched, "b", rand_ids(rng, 12), max_new_tokens=4, ignore_eos=True)
    a.return_logprob = b.return_logprob = True
    a.logprob_start_len = b.logprob_start_len = 0
    a.input_logprobs_done = b.input_logprobs_done = False
    original = Scheduler._add_input_logprobs

    def broken_for_a(self, req, prefix_len, logits):
        if req.rid == "a":
            raise IndexError("broken")
        return original(self, req, prefix_len, logits)

    monkeypatch.setattr(Scheduler, "_add_input_logprobs", broken_for_a)
    for r in (a, b):
        sched.add_request(r)
    drain(sched)
    assert a.finished_reason["status_code"] == 500 and "logprob step failed" in a.finished_reason["message"]
    assert b.finished_reason["type"] == "length" and len(b.output_ids) == 4
    assert len(b.input_token_logprobs) == 12


def test_a_request_that_does_not_fit_is_not_left_marked_chunked(make_sched):
    """_fit_extend may first plan a chunk (the prompt exceeds the chunk budget) and then find no logprob budget
    left for it: the request stays waiting, and must not stay flagged as chunked (a request admitted whole
    later with the flag still set would not be sampled)."""
    from sglang_backend.runtime.managers.scheduler import PrefillPlan

    sched = make_sched(max_total_tokens=1024, chunked_prefill_size=16)
    req = new_req(sched, "lp", rand_ids(random.Random(30), 40), max_new_tokens=2)
    req.return_logprob, req.logprob_start_len, req.input_logprobs_done = True, 0, False
    other = new_req(sched, "other", rand_ids(random.Random(31), 4), max_new_tokens=2)
    plan = PrefillPlan(chunk_budget=16, input_budget=4096, decode_reserve=0, logprob_budget=0, reqs=[other])
    assert sched._fit_extend(plan, req, 0) is None
    assert req.is_chunked is False
    roomy = PrefillPlan(chunk_budget=16, input_budget=4096, decode_reserve=0, logprob_budget=1 << 20)
    assert sched._fit_extend(roomy, req, 0) == 16 and req.is_chunked is True  # a planned chunk is flagged


def test_common_len_matches_an_id_by_id_scan():
    """The block-doubling / halving comparison used by in-batch sharing agrees with the plain scan, wherever the
    lists part (or not at all), from any start to any end."""
    from sglang_backend.runtime.managers.schedule_policy import common_len

    rng = random.Random(1)
    for _ in range(5000):
        n = rng.randint(0, 600)
        a = [rng.randint(0, 3) for _ in range(n)]
        b = list(a)
        if n and rng.random() < 0.8:
            k = rng.randrange(n)
            b[k] += 1
        if rng.random() < 0.2:
            b = b[: rng.randint(0, n)]
        m = min(len(a), len(b))
        start = rng.randint(0, m)
        end = rng.randint(start, m)
        expected = 0
        while start + expected < end and a[start + expected] == b[start + expected]:
            expected += 1
        assert common_len(a, b, start, end) == expected, (start, end)
