"""Overlapped decode (managers/overlap.py) gives the same results as the synchronous loop.

On by default on CUDA only; the logic is device-agnostic, so here it is switched on for a CPU engine to test
the lagged bookkeeping: requests ending by length, by stop token and by abort while a step is in flight,
seeded sampling, streaming, a failing launch, and the KV pool whole afterwards."""

from __future__ import annotations

import pytest
import torch

from sglang_backend.runtime.managers.overlap import OverlapDecoder

from tests.conftest import make_engine


def _engine(tiny_gqa_dir, **overrides):
    """A module's engine (the tests switch the overlap on themselves), shut down after its last test."""
    eng = make_engine(tiny_gqa_dir, disable_overlap_schedule=True, **overrides)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_gqa_dir):
    yield from _engine(tiny_gqa_dir)


def _prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 200, (40,), generator=g).tolist()
    return [shared + torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 5, 9)] + \
        [torch.randint(3, 200, (n,), generator=g).tolist() for n in (2, 17, 33)]


def _params(ref=None):
    out = []
    for i in range(6):
        sp = {"max_new_tokens": [1, 2, 5, 16, 9, 12][i], "temperature": 0, "ignore_eos": True}
        if i == 4:
            sp = {"max_new_tokens": 12, "temperature": 0.9, "top_k": 20, "seed": 7, "ignore_eos": True}
        if ref is not None and i in (3, 5):
            sp["stop_token_ids"] = [ref[i]["output_ids"][4]]  # ends mid-way
        out.append(sp)
    return out


def _run(engine, overlap: bool):
    sched = engine.scheduler
    engine.flush_cache()
    sched.overlap = OverlapDecoder(sched) if overlap else None
    try:
        ref = engine.generate(input_ids=_prompts(), sampling_params=_params())
        out = engine.generate(input_ids=_prompts(), sampling_params=_params(ref))
        stream = list(engine.generate(input_ids=_prompts()[3], sampling_params={"max_new_tokens": 7, "temperature": 0},
                                      stream=True))
        engine.check_pool_whole()
    finally:
        sched.overlap = None
    pick = lambda rs: [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in rs]  # noqa: E731
    return pick(ref), pick(out), [c["output_ids"] for c in stream]


def test_overlap_matches_sync(engine):
    sync = _run(engine, overlap=False)
    lagged = _run(engine, overlap=True)
    assert lagged == sync
    # The stop-token requests really ended early (the check can fail).
    assert len(sync[1][3][0]) < 16 and sync[1][3][1]["type"] == "stop"


def test_overlap_steps_really_lag(engine):
    """While a step is in flight its requests' tokens are not on the host yet (the overlap is real)."""
    sched = engine.scheduler
    engine.flush_cache()
    seen = []
    decoder = OverlapDecoder(sched)
    real_finish = decoder._finish

    def spy(step):
        seen.append(decoder.inflight is not None and decoder.inflight is not step)
        return real_finish(step)

    decoder._finish = spy
    sched.overlap = decoder
    try:
        engine.generate(input_ids=_prompts()[:3], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                   "ignore_eos": True})
        engine.check_pool_whole()
    finally:
        sched.overlap = None
    assert any(seen), "no step was finished while the next one was in flight"


@pytest.fixture(scope="module")
def two_slot_engine(tiny_gqa_dir):
    yield from _engine(tiny_gqa_dir, max_running_requests=2)


def test_decode_stays_overlapped_while_requests_wait_for_room(two_slot_engine):
    """Requests that wait because the running batch is full do not turn decoding synchronous: after a prefill
    planning that admits none of them, the next decode step is still launched before the one in flight is
    finished. Outputs equal the synchronous loop's."""
    engine = two_slot_engine
    sched = engine.scheduler
    prompts = _prompts()[:5]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    sync = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    engine.flush_cache()
    decoder = OverlapDecoder(sched)
    real_step = decoder.step
    waiting_at_overlapped_steps = []

    def spy():
        waiting_at_overlapped_steps.append(len(sched.waiting_queue))
        return real_step()

    decoder.step = spy
    sched.overlap = decoder
    try:
        lagged = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
        engine.check_pool_whole()
    finally:
        sched.overlap = None
    assert lagged == sync
    assert any(n > 0 for n in waiting_at_overlapped_steps), waiting_at_overlapped_steps


def test_overlap_abort_and_failed_launch(engine):
    sched = engine.scheduler
    engine.flush_cache()
    sched.overlap = OverlapDecoder(sched)
    runner = sched.model_runner
    real_forward = runner.forward
    calls = {"n": 0}

    def flaky_forward(fb):
        calls["n"] += 1
        if fb.forward_mode.is_decode() and calls["n"] == 4:
            raise RuntimeError("injected launch failure")
        return real_forward(fb)

    runner.forward = flaky_forward
    try:
        it = engine.generate(input_ids=_prompts()[4], sampling_params={"max_new_tokens": 50, "temperature": 0,
                                                                       "ignore_eos": True}, rid="to-abort",
                             stream=True)
        next(it)
        next(it)
        engine.abort_request("to-abort")
        list(it)
        outs = engine.generate(input_ids=_prompts()[:3], sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                          "ignore_eos": True})
        assert all(len(o["output_ids"]) == 6 for o in outs)
        engine.check_pool_whole()
    finally:
        runner.forward = real_forward
        sched.overlap = None


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("min_saved, worthwhile", [(0, True), (80, True), (82, False)])
def test_decode_batches_know_whether_a_shared_prefix_pays_for_cascade(engine, overlap, min_saved, worthwhile):
    """Each decode batch tells the attention backend whether its requests share a KV prefix long enough for
    cascade attention (the prefix read once, not once per request) to save ``cascade_min_saved_reads`` token
    reads: three requests behind a cached 40-token prefix save 2 x 40 = 80 reads, so yes at 0 and 80, no at 82;
    unrelated prompts share nothing. In the synchronous and the overlapped loop."""
    sched = engine.scheduler
    mr = sched.model_runner
    seen = []
    real_forward = mr.forward

    def spy(fb):
        if fb.forward_mode.is_decode():
            seen.append((fb.batch_size, fb.shares_prefix))
        return real_forward(fb)

    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    mr.forward = spy
    sched.overlap = OverlapDecoder(sched) if overlap else None
    default = sched.server_args.cascade_min_saved_reads
    sched.server_args.cascade_min_saved_reads = min_saved
    try:
        shared, unrelated = _prompts()[:3], _prompts()[3:]
        engine.generate(input_ids=shared, sampling_params=sp)  # caches the common prefix
        seen.clear()
        engine.generate(input_ids=shared, sampling_params=sp)  # every request now starts on the cached slots
        behind_prefix = list(seen)
        seen.clear()
        engine.generate(input_ids=unrelated, sampling_params=sp)
        apart = list(seen)
        engine.check_pool_whole()
    finally:
        mr.forward = real_forward
        sched.overlap = None
        sched.server_args.cascade_min_saved_reads = default
    assert behind_prefix and all(bs == 3 for bs, _ in behind_prefix), behind_prefix
    assert all(s == worthwhile for _, s in behind_prefix), behind_prefix
    assert any(bs > 1 for bs, _ in apart) and all(not s for bs, s in apart if bs > 1), apart


def test_a_cache_flush_that_drains_the_last_step_reports_it(engine):
    """A cache flush drains the decode step in flight first; when that step ends the last running request, the
    flush goes ahead (the scheduler is idle) and the request must still be answered (with the next iteration)."""
    import queue
    import threading

    sched = engine.scheduler
    engine.flush_cache()
    decoder = OverlapDecoder(sched)
    real_step = decoder.step
    replies: queue.Queue = queue.Queue()

    def step_then_post_flush():
        out = real_step()
        last = decoder.inflight is not None and all(
            len(r.output_ids) + 1 >= r.sampling_params.max_new_tokens for r in decoder.inflight.reqs)
        if last and replies.empty():  # the step in flight computes the request's last token
            replies.put("posted")
            engine._post("control", ("flush_cache", None, replies))  # run between this iteration and the next
        return out

    decoder.step = step_then_post_flush
    sched.overlap = decoder
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=engine.generate(
        input_ids=_prompts()[1], sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})))
    try:
        worker.start()
        worker.join(timeout=60)
    finally:
        sched.overlap = None
    assert [replies.get(timeout=5), replies.get(timeout=5)] == ["posted", True], "the flush did not go ahead"
    assert not worker.is_alive(), "the request ended by the drained step was never answered"
    assert len(result["out"]["output_ids"]) == 3
    engine.check_pool_whole()


def _run_pipelined(engine, overlap: bool, return_logprob: list[bool]):
    """The six prompts (the first three share a 40-token prefix: in-batch dedup shares it within one batch, or holds
    two of them back for a second): results, and per pipelined prefill whether a step was in flight at its launch."""
    sched = engine.scheduler
    engine.flush_cache()
    decoder = OverlapDecoder(sched) if overlap else None
    launches = []
    if decoder is not None:
        real_start = decoder.start_prefill

        def spy(reqs, logits):
            launches.append((decoder.inflight is not None, [len(r.output_ids) for r in reqs]))
            return real_start(reqs, logits)

        decoder.start_prefill = spy
    sched.overlap = decoder
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (1, 4, 6, 3, 5, 2)]
    try:
        out = engine.generate(input_ids=_prompts(), sampling_params=params, return_logprob=return_logprob)
        engine.check_pool_whole()
    finally:
        sched.overlap = None
    meta = [o["meta_info"] for o in out]
    return [(o["output_ids"], m["finish_reason"], m["cached_tokens"], m.get("output_token_logprobs"))
            for o, m in zip(out, meta)], launches


@pytest.fixture(scope="module")
def held_back_engine(tiny_gqa_dir):
    """In-batch dedup holding requests back a round (no in-batch sharing): two prefill batches to pipeline."""
    yield from _engine(tiny_gqa_dir, disable_in_batch_prefix_sharing=True)


def test_prefill_with_in_batch_sharing_is_pipelined(engine):
    """The requests sharing a prefix with an admitted one read its new KV in the same batch, which is sampled in
    flight; tokens, finish reasons and cache hits equal the synchronous loop's."""
    plain = [False] * 6
    sync, _ = _run_pipelined(engine, False, plain)
    lagged, launches = _run_pipelined(engine, True, plain)
    assert lagged == sync
    assert [c for _, _, c, _ in sync[1:3]] == [40, 40], "the sharers did not read the shared prefix"
    assert len(launches) == 1 and len(launches[0][1]) == 6, launches  # one batch, every first token in flight


def test_prefill_batches_are_pipelined(held_back_engine):
    """A prefill batch of plain requests is sampled in flight: the batch held back behind its shared prefix is
    planned and launched before the first batch's tokens reach the host, and still hits that prefix; the tokens,
    finish reasons and cache hits equal the synchronous loop's."""
    plain = [False] * 6
    engine = held_back_engine
    sync, _ = _run_pipelined(engine, False, plain)
    lagged, launches = _run_pipelined(engine, True, plain)
    assert lagged == sync
    assert [c for _, _, c, _ in sync[1:3]] == [40, 40], "the held-back requests did not hit the shared prefix"
    assert len(launches) == 2 and launches[1][0], launches  # the second batch launched with the first in flight
    assert all(n == 0 for _, lens in launches for n in lens)  # no first token was on the host at launch


def test_prefill_with_logprobs_is_not_pipelined(held_back_engine):
    """A batch with a request that wants logprobs samples on the host (after draining the step in flight); the
    results still equal the synchronous loop's, logprobs included."""
    engine = held_back_engine
    mixed = [False, True, False, False, False, False]  # request 1 is in the held-back batch
    sync, _ = _run_pipelined(engine, False, mixed)
    lagged, launches = _run_pipelined(engine, True, mixed)
    assert lagged == sync
    assert sync[1][3], "no logprobs came back"
    assert len(launches) == 1  # only the first batch was pipelined


@pytest.fixture(scope="module")
def chunking_engine(tiny_gqa_dir):
    yield from _engine(tiny_gqa_dir, chunked_prefill_size=16)


def test_chunked_prefill_is_pipelined(chunking_engine):
    """Prompts longer than the chunk are computed 16 tokens a batch: batches that hold a chunk are pipelined too
    (the chunk's request samples nothing yet), with the same results as the synchronous loop."""
    sync, _ = _run_pipelined(chunking_engine, False, [False] * 6)
    lagged, launches = _run_pipelined(chunking_engine, True, [False] * 6)
    assert lagged == sync
    assert any(not lens for _, lens in launches), launches  # a batch of one chunk and nothing to sample
    assert sum(len(lens) for _, lens in launches) == 6  # every request's first token was sampled in flight
