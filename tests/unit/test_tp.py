"""Tensor parallelism on CPU (gloo): TP=2 must give TP=1's greedy outputs.

The TP=2 engine runs rank 0 in this process and rank 1 in a process it launches; rank 0 schedules and
sends every forward to rank 1 (the KV slot writes included). The workload reuses prefixes (radix hits),
chunks a long prompt and asks for prompt logprobs, so the follower's KV table has to track every kind of
write rank 0 makes. Two models: GQA with KV heads split over the ranks and checkpoint weights loaded shard
by shard; and tied embeddings with one KV head (replicated on both ranks), a vocabulary not divisible by 2
(padded vocab shards) and dummy weights (drawn at full shape, then sharded).
"""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("model, load_format", [("tiny_gqa_dir", "auto"), ("tied_kv1_dir", "dummy")])
def test_tp2_matches_tp1(request, model, load_format):
    path = request.getfixturevalue(model)
    kwargs = dict(load_format=load_format, chunked_prefill_size=16, max_total_tokens=2048)
    with make_engine(path, **kwargs) as e1:
        ref = _run(e1)
    e2 = make_engine(path, tp_size=2, **kwargs)
    procs = list(e2.scheduler.model_runner.tp_followers.procs)
    try:
        assert e2.scheduler.model_runner.model.model.layers[0].self_attn.num_heads == 2  # really sharded
        got = _run(e2)
        e2.check_pool_whole()
        assert e2.get_stats()["num_cached_tokens"] > 0
    finally:
        e2.shutdown()
    assert [p.wait(timeout=30) for p in procs] == [0]  # rank 1 ran to the end and exited cleanly
    worst = _compare(ref, got)
    print(f"\n{model}: TP=2 greedy == TP=1 over {len(ref)} requests; max |logprob diff| = {worst:.2e}")
    assert worst < 1e-4


def test_tp_bad_split_is_a_clear_error(tiny_gqa_dir):
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by tp_size"):
        make_engine(tiny_gqa_dir, tp_size=3)
