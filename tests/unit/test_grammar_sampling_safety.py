"""Issue 21, item 1: sampling under a grammar can never leave the grammar, and one request's failure in the
scheduler step ends that request only.

Each crash request of the issue (a grammar whose allowed set is entirely banned by ``stop_token_ids`` under
``min_new_tokens``, by a ``-inf`` logit bias, or NaN-ed by a tiny ``repetition_penalty``) must either be
refused at submission (ValueError -> HTTP 400) or end alone with an abort finish reason carrying a clear
message; the engine keeps serving and its KV pool is whole afterwards (the conftest fixture checks it).
"""

from __future__ import annotations

import pytest
import torch

from sglang_backend.runtime.layers.sampler import Sampler, SamplingBatchInfo
from sglang_backend.runtime.sampling_params import SamplingParams

PROMPT = "hi"


def _token_id(engine, text: str) -> int:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is not a single token: {ids}"
    return ids[0]


def _assert_refused_or_aborted(engine, params: dict) -> None:
    try:
        out = engine.generate(PROMPT, params)
    except ValueError:
        return  # refused before decoding: a 400 over HTTP
    reason = out["meta_info"]["finish_reason"]
    assert reason is not None and reason["type"] == "abort", out
    assert reason["message"], reason
    assert 400 <= reason["status_code"] < 600


def _assert_still_serving(engine) -> None:
    out = engine.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0})
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    out = engine.generate(PROMPT, {"max_new_tokens": 3, "regex": "[0-9]+", "temperature": 0})
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert out["text"].isdigit(), out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_token_under_min_tokens_empties_grammar(tiny_engine, temperature):
    x = _token_id(tiny_engine, "x")
    params = {"max_new_tokens": 4, "regex": "x", "stop_token_ids": [x], "min_new_tokens": 1,
              "temperature": temperature}
    with pytest.raises(ValueError, match="no token allowed by the grammar"):
        tiny_engine.generate(PROMPT, params)
    _assert_still_serving(tiny_engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_minus_inf_bias_empties_grammar(tiny_engine, temperature):
    x = _token_id(tiny_engine, "x")
    params = {"max_new_tokens": 4, "regex": "x", "logit_bias": {str(x): float("-inf")}, "temperature": temperature}
    with pytest.raises(ValueError, match="no token allowed by the grammar"):
        tiny_engine.generate(PROMPT, params)
    _assert_still_serving(tiny_engine)


@pytest.mark.parametrize("penalty", [1e-300, 5e-324, 0.0, -1.0, float("nan"), float("inf")])
def test_tiny_repetition_penalty_refused(tiny_engine, penalty):
    for params in ({"max_new_tokens": 4, "regex": "[0-9]+", "repetition_penalty": penalty},
                   {"max_new_tokens": 4, "json_schema": {}, "repetition_penalty": penalty}):
        with pytest.raises(ValueError, match="repetition_penalty"):
            tiny_engine.generate(PROMPT, params)
    _assert_still_serving(tiny_engine)


def test_smallest_allowed_repetition_penalty_stays_in_grammar(tiny_engine):
    for temperature in (0.0, 1.0):
        out = tiny_engine.generate(PROMPT, {"max_new_tokens": 6, "regex": "[0-9]+", "repetition_penalty": 0.01,
                                            "temperature": temperature})
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] in ("length", "stop"), reason
        assert out["text"].isdigit(), out
    _assert_still_serving(tiny_engine)


def test_empty_allowed_set_mid_decode_aborts_only_that_request(tiny_engine):
    """The allowed set empties after the first token ("x", then "y" or "z", both stop tokens banned under
    min_new_tokens; a choice, so no jump-forward): not detectable at submission, so the request ends with an
    abort at that step; a neighbour in the same batch goes on."""
    x, y, z = (_token_id(tiny_engine, c) for c in "xyz")
    bad = {"max_new_tokens": 4, "regex": "x[yz]", "stop_token_ids": [y, z], "min_new_tokens": 3,
           "temperature": 0, "ignore_eos": True}
    good = {"max_new_tokens": 4, "regex": "[0-9]+", "temperature": 0}
    outs = tiny_engine.generate([PROMPT, PROMPT], [bad, good])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "no token allowed by the grammar" in reason["message"], reason
    assert outs[0]["output_ids"] == [x]  # nothing outside the grammar was emitted
    assert outs[1]["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert outs[1]["text"].isdigit()
    _assert_still_serving(tiny_engine)


def test_grammar_advance_failure_is_contained(tiny_engine, monkeypatch):
    """Any exception in one request's grammar advance ends that request only."""
    sched = tiny_engine.scheduler
    real_poll = sched._poll_grammars

    def poll():
        failed = real_poll()
        for req in sched.waiting_queue:
            if req.grammar is not None and req.sampling_params.regex == "[a-z]+":
                req.grammar = _Boom(req.grammar)
        return failed

    monkeypatch.setattr(sched, "_poll_grammars", poll)
    outs = tiny_engine.generate([PROMPT, PROMPT], [{"max_new_tokens": 4, "regex": "[a-z]+", "temperature": 0},
                                                   {"max_new_tokens": 4, "regex": "[0-9]+", "temperature": 0}])
    monkeypatch.undo()
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "injected" in reason["message"], reason
    assert outs[1]["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    _assert_still_serving(tiny_engine)


class _Boom:
    """A matcher whose advance raises (stands in for any bug in one request's grammar step)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def advance(self, token_id):
        raise RuntimeError("injected grammar failure")


# ---------------------------------------------------------------------------------------------- sampler level

def _info(params: list[SamplingParams], vocab: int, outputs=None) -> SamplingBatchInfo:
    for p in params:
        p.normalize()
    return SamplingBatchInfo.from_requests(params, [[1, 2]] * len(params), outputs or [[]] * len(params),
                                           [None] * len(params), {0}, vocab)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_reports_rows_with_nothing_left(temperature):
    vocab = 8
    logits = torch.randn(2, vocab)
    logits[0, :] = float("-inf")
    logits[0, 3] = 1.0  # the grammar allows only token 3 in row 0 ...
    params = [SamplingParams(temperature=temperature, min_new_tokens=1, stop_token_ids=[3]),  # ... which is banned
              SamplingParams(temperature=temperature)]
    ids, ok = Sampler()(logits, _info(params, vocab), return_ok=True)
    assert ok.tolist() == [False, True]
    assert 0 <= ids[1] < vocab


def test_sampler_nan_row_is_not_ok():
    vocab = 8
    logits = torch.randn(1, vocab)
    logits[0, 2] = float("nan")
    ids, ok = Sampler()(logits, _info([SamplingParams(temperature=1.0, logit_bias={1: 1.0})], vocab), return_ok=True)
    assert ok.tolist() == [False]


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1e-300), ("repetition_penalty", 5e-324),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")),
                                         ("repetition_penalty", 3.0), ("frequency_penalty", float("nan")),
                                         ("presence_penalty", 2.5), ("frequency_penalty", float("inf"))])
def test_penalty_ranges(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).verify(100)


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), 101.0, -100.5])
def test_logit_bias_range(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: bias}).verify(100)


def test_finite_rows_flags_exactly_the_rows_with_nan_or_inf():
    from sglang_backend.runtime.layers.sampler import finite_rows

    logits = torch.randn(5, 1000)
    assert finite_rows(logits) == [True] * 5
    logits[1, 7] = float("nan")
    logits[3, 0] = float("-inf")
    logits[4, 999] = float("inf")
    assert finite_rows(logits) == [True, False, True, False, False]
    # Finite values whose sum overflows: the sums say "not finite", the value-by-value check says finite.
    huge = torch.full((2, 1000), 3e38)
    huge[1, 5] = float("nan")
    assert finite_rows(huge) == [True, False]
