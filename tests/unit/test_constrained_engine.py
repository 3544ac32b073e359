"""Constrained decoding end to end: real models sample (random temperatures and seeds) under every regex and
JSON schema of the corpus, with jump-forward on and off, and every output matches."""

from __future__ import annotations

import json
import random
import re

import pytest

from tests.conftest import make_engine
from tests.unit.test_constrained_property import REGEXES, SCHEMAS, _check_formats

# Measured with 80: per pass 57-59 of the 68 outputs (SmolLM2; 63-65 with the tiny model) complete, all but one
# within 36 tokens; the rest are strings the model never closes, and each of their 48 tokens still goes through
# the grammar's matcher below. Decoding those few stragglers from 48 to 80 took 40% of the test: CI time.
MAX_NEW_TOKENS = 48


def corpus():
    items = [("regex", r) for r in REGEXES] + [("json_schema", json.dumps(s)) for s in SCHEMAS]
    assert len(REGEXES) >= 40 and len(SCHEMAS) >= 20
    return items


def check(kind: str, spec: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    else:
        import jsonschema

        schema = json.loads(spec)
        doc = json.loads(text)
        jsonschema.validate(doc, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        _check_formats(doc, schema)


@pytest.mark.parametrize("model", ["tiny_gqa_dir", "smollm_dir"])
def test_every_sampled_output_matches(model, request):
    engine = make_engine(request.getfixturevalue(model))
    items = corpus()
    rng = random.Random(7)
    prompt = "Answer in the requested format.\nAnswer: "
    try:
        for jump_forward in (True, False):
            engine.scheduler.server_args.disable_jump_forward = not jump_forward
            params = [{"max_new_tokens": MAX_NEW_TOKENS, "temperature": rng.choice([0.0, 0.5, 1.0, 1.5]),
                       "seed": rng.randrange(1 << 30), kind: spec} for kind, spec in items]
            outs = engine.generate([prompt] * len(items), params)
            finished = 0
            for (kind, spec), out in zip(items, outs):
                reason = out["meta_info"]["finish_reason"]["type"]
                assert reason in ("stop", "length"), out["meta_info"]
                if reason == "stop":
                    finished += 1
                    check(kind, spec, out["text"])
                else:  # cut by max_new_tokens: the tokens must still spell a live prefix of the grammar
                    matcher = engine.scheduler.grammar_cache.compile(kind, spec).matcher()
                    for tok in out["output_ids"]:
                        matcher.advance(tok)  # raises if the grammar forbids the token
            # Most grammars complete well within the budget; a truncated output is the exception.
            assert finished >= 0.75 * len(items), (model, jump_forward, finished, len(items))
        engine.check_pool_whole()
    finally:
        engine.scheduler.server_args.disable_jump_forward = False
        engine.shutdown()


# Forced (jump-forward) tokens carry the model's logprobs, one entry per output token ------------------------------
FORCING_REGEX = r'\{"name": "[A-Za-z]{1,8}", "house": "(Gryffindor|Slytherin)", "wand": "(oak|yew)"\}'


def scored_by_prefill(engine, prompt_ids: list[int], output_ids: list[int], top: int) -> dict:
    """The model's logprobs of ``output_ids`` after the prompt, as prompt logprobs of one prefill-only request."""
    out = engine.generate(input_ids=prompt_ids + output_ids, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=len(prompt_ids), top_logprobs_num=top)
    return out["meta_info"]


@pytest.mark.parametrize("engine_args", [{}, {"chunked_prefill_size": 4}, {"page_size": 4}],
                         ids=["plain", "chunked", "paged"])
def test_forced_tokens_carry_the_models_logprobs(tiny_gqa_dir, engine_args):
    engine = make_engine(tiny_gqa_dir, **engine_args)
    try:
        prompt_ids = engine.tokenizer.encode("The character:\n")
        sp = {"max_new_tokens": 60, "temperature": 0, "regex": FORCING_REGEX}
        jumps = engine.scheduler.stats.num_jump_forward_tokens
        out = engine.generate(input_ids=prompt_ids, sampling_params=sp, return_logprob=True, top_logprobs_num=3)
        assert engine.scheduler.stats.num_jump_forward_tokens - jumps >= 10  # most of the output was forced
        meta, ids = out["meta_info"], out["output_ids"]
        assert re.fullmatch(FORCING_REGEX, out["text"]), out["text"]
        assert [t for _, t, *_ in meta["output_token_logprobs"]] == ids
        assert len(meta["output_top_logprobs"]) == len(ids)
        ref = scored_by_prefill(engine, prompt_ids, ids, 3)
        for (lp, tid, *_), (ref_lp, ref_tid, *_) in zip(meta["output_token_logprobs"], ref["input_token_logprobs"]):
            assert tid == ref_tid and lp == pytest.approx(ref_lp, abs=1e-4), (tid, lp, ref_lp)
        for top, ref_top in zip(meta["output_top_logprobs"], ref["input_top_logprobs"]):
            assert [t for _, t, *_ in top] == [t for _, t, *_ in ref_top]

        # Streamed, the pieces add up to the same entries, and every message carries the ids of its entries
        # (forced tokens wait for their scores), so a client can read each chunk's tokens from its logprobs.
        chunks = list(engine.generate(input_ids=prompt_ids, sampling_params=sp, return_logprob=True, stream=True))
        assert chunks[-1]["output_ids"] == ids
        assert [t for _, t, *_ in chunks[-1]["meta_info"]["output_token_logprobs"]] == ids
        for c in chunks:
            assert [t for _, t, *_ in c["meta_info"]["output_token_logprobs"]] == c["output_ids"]
        engine.check_pool_whole()
    finally:
        engine.shutdown()


def test_a_streamed_retokenized_tail_resends_its_logprob_entries():
    """Jump-forward may re-tokenize output tokens a stream already sent (with their logprobs): the next message
    tells the front-end to keep only the ids before the rewrite, and its logprob entries follow the same cut."""
    from sglang_backend.runtime.managers.io_struct import StrOut
    from sglang_backend.runtime.managers.request_frontend import RequestState
    from sglang_backend.runtime.managers.schedule_batch import Req
    from sglang_backend.runtime.managers.scheduler_output import OutputCollector
    from sglang_backend.runtime.sampling_params import SamplingParams

    req = Req("r", [5, 6], SamplingParams(), return_logprob=True, stream=True)
    collector, state = OutputCollector(), RequestState("r", None, stream=True)

    def step():
        msg = collector.delta(req)
        state.merge(StrOut(msg.rid, "", msg.new_ids, msg.keep_len, msg.finished_reason, msg.meta))

    req.output_ids += [1, 2, 3]
    req.output_token_logprobs += [(-0.1, 1), (-0.2, 2), (-0.3, 3)]
    step()
    # A jump-forward drops the two last tokens for a re-tokenized [7, 8, 9]; one extend scored 7 so far.
    del req.output_ids[1:]
    req.output_ids_rewritten_from = 1
    del req.output_token_logprobs[1:]
    req.output_ids += [7, 8, 9]
    req.output_token_logprobs += [(-0.7, 7)]
    step()
    assert state.output_ids == [1, 7]  # 8 and 9 wait for their logprob entries
    assert [t for _, t in state.meta["output_token_logprobs"]] == [1, 7]
    req.output_token_logprobs += [(-0.8, 8), (-0.9, 9)]
    step()
    assert state.output_ids == [1, 7, 8, 9]
    assert [t for _, t in state.meta["output_token_logprobs"]] == [1, 7, 8, 9]


# Jump-forward's batch limit (ServerArgs.jump_forward_max_batch) -----------------------------------------------------
def jumps_of_three_requests(model_dir: str, limit: int | None) -> int:
    """Jump-forwards while three greedy requests decode under FORCING_REGEX (every output must match)."""
    engine = make_engine(model_dir, jump_forward_max_batch=limit)
    try:
        outs = engine.generate(["a", "b", "c"], {"max_new_tokens": 64, "temperature": 0, "regex": FORCING_REGEX})
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop" and re.fullmatch(FORCING_REGEX, out["text"])
        engine.check_pool_whole()
        return engine.get_stats()["num_jump_forward"]
    finally:
        engine.shutdown()


def test_jump_forward_only_while_the_batch_is_within_its_limit(tiny_gqa_dir):
    """No limit (the CPU's auto) and a limit of 3 jump as often; a limit of 1 jumps only once a request runs alone."""
    unlimited = jumps_of_three_requests(tiny_gqa_dir, None)
    assert unlimited >= 3 * 3  # each request: after the name, the house and the wand at least
    assert jumps_of_three_requests(tiny_gqa_dir, 3) == unlimited
    assert jumps_of_three_requests(tiny_gqa_dir, 1) < unlimited // 2


def test_jump_forward_limit_must_be_positive():
    from sglang_backend.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="jump_forward_max_batch"):
        ServerArgs(model_path="x", jump_forward_max_batch=0)
