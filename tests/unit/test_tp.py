"""Tensor parallelism on CPU (gloo): TP=2 must give TP=1's greedy outputs.

The TP=2 engine runs rank 0 in this process and rank 1 in a process it launches; rank 0 schedules and
sends every forward to rank 1 (the KV slot writes included). The workload reuses prefixes (radix hits),
chunks a long prompt and asks for prompt logprobs, so the follower's KV table has to track every kind of
write rank 0 makes. Two models: GQA with KV heads split over the ranks and checkpoint weights loaded shard
by shard; and tied embeddings with one KV head (replicated on both ranks), a vocabulary not divisible by 2
(padded vocab shards), dummy weights (drawn at full shape, then sharded) and 4-token KV pages (decode then
writes the table row by row).

The step transport (header down the follower's stdin pipe, one payload over the device group) round-trips
every ForwardBatch field and every kind of table write; and an idle follower outlives the device group's
timeout (it waits for headers on its pipe, which has none).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from sglang_backend.runtime.distributed.tp_worker import (HEADER_INTS, INLINE_INTS, ReqToTokenWriteLog, decode_step,
                                                          encode_step, replay_writes)
from sglang_backend.runtime.mem_cache.memory_pool import ReqToTokenPool
from sglang_backend.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

from tests.conftest import make_engine

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and",
    "The quick brown fox jumps over the lazy cat while",
    "Tensor parallel ranks must agree on every",
    "a " * 40 + "long prompt that is prefilled in chunks",
]


def _run(engine) -> list[dict]:
    sp = {"max_new_tokens": 10, "temperature": 0}
    first = engine.generate(PROMPTS, sp, return_logprob=True)
    again = engine.generate(PROMPTS[:2], sp, return_logprob=True, logprob_start_len=3)  # cached prefixes
    return first + again


def _compare(ref: list[dict], got: list[dict]) -> float:
    worst = 0.0
    for a, b in zip(ref, got):
        assert a["output_ids"] == b["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            for (la, ta, _), (lb, tb, _) in zip(a["meta_info"][key], b["meta_info"][key]):
                assert ta == tb
                if la is not None:
                    worst = max(worst, abs(la - lb))
    return worst


@pytest.fixture(scope="module")
def tied_kv1_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny_tied_kv1"))
    save_dummy_hf_model(dummy_config(tie_word_embeddings=True, num_key_value_heads=1, vocab_size=509), out, seed=1)
    return out


@pytest.mark.parametrize("model, load_format, page_size", [("tiny_gqa_dir", "auto", 1), ("tied_kv1_dir", "dummy", 4),
                                                        ("tiny_qwen3_moe_dir", "auto", 1)])
def test_tp2_matches_tp1(request, model, load_format, page_size):
    path = request.getfixturevalue(model)
    kwargs = dict(load_format=load_format, chunked_prefill_size=16, max_total_tokens=2048, page_size=page_size)
    with make_engine(path, **kwargs) as e1:
        ref = _run(e1)
    e2 = make_engine(path, tp_size=2, **kwargs)
    procs = list(e2.scheduler.model_runner.tp_followers.procs)
    try:
        layer0 = e2.scheduler.model_runner.model.model.layers[0]
        assert layer0.self_attn.num_heads == 2  # really sharded
        if model == "tiny_qwen3_moe_dir":  # each rank holds half of every expert
            assert layer0.mlp.intermediate == layer0.mlp.full_intermediate // 2
        got = _run(e2)
        e2.check_pool_whole()
        assert e2.get_stats()["num_cached_tokens"] > 0
    finally:
        e2.shutdown()
    assert [p.wait(timeout=30) for p in procs] == [0]  # rank 1 ran to the end and exited cleanly
    worst = _compare(ref, got)
    print(f"\n{model}: TP=2 greedy == TP=1 over {len(ref)} requests; max |logprob diff| = {worst:.2e}")
    assert worst < 1e-4


def test_tp2_overlapped_decode_matches_tp1(tiny_gqa_dir):
    """Overlapped decode (the GPU default at every tp size; switched on here as test_overlap does) at TP=2:
    rank 0 launches step N+1 before reading step N's tokens, and the follower replays the same steps."""
    from sglang_backend.runtime.managers.overlap import OverlapDecoder

    sp = {"max_new_tokens": 12, "temperature": 0}
    with make_engine(tiny_gqa_dir, max_total_tokens=2048) as e1:
        ref = [o["output_ids"] for o in e1.generate(PROMPTS, sp)] + [e1.generate(PROMPTS[0], sp)["output_ids"]]
    e2 = make_engine(tiny_gqa_dir, tp_size=2, max_total_tokens=2048)
    procs = list(e2.scheduler.model_runner.tp_followers.procs)
    sched = e2.scheduler
    sched.overlap = OverlapDecoder(sched)
    steps = []
    step = sched.overlap.step
    sched.overlap.step = lambda: steps.append(1) or step()
    try:
        got = [o["output_ids"] for o in e2.generate(PROMPTS, sp)] + [e2.generate(PROMPTS[0], sp)["output_ids"]]
        e2.check_pool_whole()
    finally:
        e2.shutdown()
    assert [p.wait(timeout=30) for p in procs] == [0]
    assert len(steps) > 10  # the decode steps really went through the overlapped path
    assert got == ref


def test_tp_bad_split_is_a_clear_error(tiny_gqa_dir):
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by tp_size"):
        make_engine(tiny_gqa_dir, tp_size=3)


def _ints(*v):
    return torch.tensor(v, dtype=torch.int64)


def _batches() -> dict[str, tuple[ForwardBatch, list]]:
    """ForwardBatches of each kind, with the table writes rank 0 makes before them (as (method, args))."""
    extend = ForwardBatch(ForwardMode.EXTEND, _ints(5, 6, 7, 8, 9), _ints(3, 4, 0, 1, 2), _ints(11, 12, 20, 21, 22),
                          _ints(2, 0), _ints(5, 3), [5, 3], extend_prefix_lens_cpu=[3, 0],
                          extend_seq_lens_cpu=[2, 3], logits_indices=_ints(0, 1, 4))  # prompt logprobs + last
    chunk = ForwardBatch(ForwardMode.EXTEND, _ints(1, 2), _ints(0, 1), _ints(30, 31), _ints(1), _ints(2), [2],
                         extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[2], logits_indices=_ints())  # mid-prompt
    decode = ForwardBatch(ForwardMode.DECODE, _ints(4, 7), _ints(5, 3), _ints(13, 23), _ints(2, 0), _ints(6, 4),
                          [6, 4])  # logits_indices absent
    decode_logits = dataclasses.replace(decode, logits_indices=_ints(0, 1))
    mm = dataclasses.replace(extend, mm_inputs=[{"pixel_values": "placeholder"}, None])
    prefix = torch.arange(100, 100 + INLINE_INTS + 50)  # a long cached prefix: the header cannot hold it
    long_prefix = ForwardBatch(ForwardMode.EXTEND, _ints(1), _ints(len(prefix)), _ints(99), _ints(1),
                               _ints(len(prefix) + 1), [len(prefix) + 1], extend_prefix_lens_cpu=[len(prefix)],
                               extend_seq_lens_cpu=[1], logits_indices=_ints(0))
    return {
        "extend_with_prefix": (extend, [("write", 2, 0, _ints(7, 8, 9)), ("write", 2, 3, _ints(11, 12)),
                                        ("write", 0, 0, _ints(20, 21, 22))]),
        "extend_chunk_no_logits": (chunk, [("write", 1, 0, _ints(30, 31))]),
        "decode": (decode, [("write_tokens", _ints(2, 0), _ints(5, 3), _ints(13, 23))]),
        "decode_with_logits": (decode_logits, [("write_tokens", _ints(2, 0), _ints(5, 3), _ints(13, 23))]),
        "multimodal": (mm, []),
        "long_prefix_overflow": (long_prefix, [("write", 1, 0, prefix), ("write", 1, len(prefix), _ints(99))]),
    }


@pytest.mark.parametrize("case", list(_batches()))
def test_step_round_trip(case):
    fb, writes = _batches()[case]
    log = ReqToTokenWriteLog(ReqToTokenPool(4, 2048))
    for method, *args in writes:
        getattr(log, method)(*args)
    header, overflow, payload = encode_step(fb, log.take())
    assert header.shape == (HEADER_INTS,) and header.dtype == torch.int64  # fixed size, whatever the batch
    assert (len(overflow) > 0) == (case == "long_prefix_overflow")  # only a long write list leaves the header
    got, got_writes = decode_step(header, overflow, payload, fb.mm_inputs)
    for f in dataclasses.fields(ForwardBatch):
        a, b = getattr(fb, f.name), getattr(got, f.name)
        if isinstance(a, torch.Tensor):
            assert b.dtype == torch.int64 and torch.equal(a, b), f.name
            # Every field 16-byte aligned whatever the batch's sizes, as Triton specialises kernels on that.
            assert (b.data_ptr() - payload.data_ptr()) % 16 == 0, f.name
        else:
            assert a == b, f.name
    follower = ReqToTokenPool(4, 2048)
    replay_writes(follower, got_writes)
    assert torch.equal(follower.req_to_token, log.pool.req_to_token)  # the same KV slots on both ranks
    assert len(log.take()) == 0


def test_follower_survives_idle(tiny_gqa_dir, monkeypatch):
    """Idle longer than the device group's timeout: the follower waits on its pipe and serves again."""
    monkeypatch.setenv("SGLANG_BACKEND_TP_TIMEOUT_S", "3")  # the follower inherits it
    sp = {"max_new_tokens": 6, "temperature": 0}
    eng = make_engine(tiny_gqa_dir, tp_size=2, max_total_tokens=1024)
    procs = list(eng.scheduler.model_runner.tp_followers.procs)
    try:
        first = [r["output_ids"] for r in eng.generate(PROMPTS[:2], sp)]
        eng.check_pool_whole()
        time.sleep(4.5)
        assert [p.poll() for p in procs] == [None]
        again = [r["output_ids"] for r in eng.generate(PROMPTS[:2], sp)]  # radix hits this time
        assert again == first
        assert eng.get_stats()["num_cached_tokens"] > 0
        eng.check_pool_whole()
    finally:
        eng.shutdown()
    assert [p.wait(timeout=30) for p in procs] == [0]
