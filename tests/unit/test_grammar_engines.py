"""Issue 25's grammar engine: llguidance under our matcher interface, digit bounds on JSON numbers, and a compile
budget counted in sizes and steps (never wall-clock seconds)."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
import torch
from pydantic import BaseModel, Field

from benchmarks.bench_hostile_latency import nested_schema
from sglang_backend.runtime.constrained import GrammarCache, apply_jump_forward, build_regex_from_schema
from sglang_backend.runtime.constrained import budget as grammar_budget
from sglang_backend.runtime.constrained.budget import GrammarTooComplex
from sglang_backend.runtime.constrained.json_schema import MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS, MAX_STRING_LENGTH
from sglang_backend.runtime.constrained.llguidance_backend import LLGuidanceGrammar
from sglang_backend.runtime.server_args import ServerArgs
from tests.unit.test_constrained_property import REGEXES, SCHEMAS

pytest.importorskip("llguidance")


class Reading(BaseModel):
    """Unbounded int and float fields (and a list of them): what ran to max_tokens before the digit bounds."""

    count: int
    ratio: float
    offsets: list[int] = Field(max_length=4)
    ok: bool


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="module")
def cache(tokenizer):
    c = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, disk_cache=False, backend="llguidance")
    yield c
    c.shutdown()


# -- digit bounds ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schema", [{"type": "integer"}, {"type": "integer", "minimum": 3},
                                    {"type": "integer", "maximum": -3}, {"type": "number"},
                                    {"type": "number", "minimum": 0}])
def test_unbounded_numbers_get_the_default_digit_bound(schema):
    regex = re.compile(build_regex_from_schema(schema))
    sign = "-" if schema.get("maximum", 0) < 0 else ""
    assert regex.fullmatch(sign + "9" * MAX_INTEGER_DIGITS)
    assert not regex.fullmatch(sign + "9" * (MAX_INTEGER_DIGITS + 1))
    if schema["type"] == "number":
        assert regex.fullmatch("1." + "5" * MAX_FRACTION_DIGITS)
        assert not regex.fullmatch("1." + "5" * (MAX_FRACTION_DIGITS + 1))


def test_a_schema_bound_wider_than_the_default_is_kept():
    big = 10 ** 25
    regex = re.compile(build_regex_from_schema({"type": "integer", "minimum": big}))
    assert regex.fullmatch(str(big)) and regex.fullmatch(str(big * 9)) and not regex.fullmatch(str(big - 1))


@pytest.mark.parametrize("schema, longest", [({"type": "string"}, MAX_STRING_LENGTH),
                                            ({"type": "string", "minLength": 2}, MAX_STRING_LENGTH),
                                            ({"type": "string", "minLength": 600}, 600),
                                            ({"type": "string", "maxLength": 2000}, 2000)])
def test_strings_without_max_length_get_the_default_cap(schema, longest):
    regex = re.compile(build_regex_from_schema(schema))
    assert regex.fullmatch('"' + "é" * longest + '"') and not regex.fullmatch('"' + "é" * (longest + 1) + '"')


def test_the_compiled_grammar_refuses_the_twentieth_digit(cache, tokenizer):
    digit = tokenizer.convert_tokens_to_ids("9")
    matcher = cache.compile("json_schema", Reading).matcher()
    matcher.advance_text('{"count": ')
    for _ in range(MAX_INTEGER_DIGITS):
        assert matcher.is_allowed(digit)
        matcher.advance(digit)
    assert not matcher.is_allowed(digit)


# -- the engine: same language as the regex, jump-forward from llguidance's forced text --------------------------
def _walk(grammar, tokenizer, rng: random.Random, steps: int = 40) -> tuple[list[int], bool]:
    """A seeded random decode with jump-forward; returns (tokens, ended with EOS)."""
    matcher, out, eos = grammar.matcher(), [], tokenizer.eos_token_id
    for _ in range(steps):
        if matcher.is_finished():
            return out, True
        n_drop, new_ids, forced = apply_jump_forward(matcher, tokenizer, out)
        if forced:
            out = out[:len(out) - n_drop] + new_ids
            continue
        logits = torch.randn(grammar.vocab_size, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        logits[eos] += 4.0
        matcher.fill_mask(logits)
        tok = int(torch.argmax(logits))
        assert matcher.is_allowed(tok)
        matcher.advance(tok)
        if tok == eos:
            return out, True
        out.append(tok)
    return out, False


@pytest.mark.parametrize("kind", ["regex", "json_schema"])
def test_llguidance_outputs_match_their_grammar(cache, tokenizer, kind):
    items = REGEXES if kind == "regex" else SCHEMAS
    rng, finished = random.Random(25), 0
    for spec in items:
        grammar = cache.compile(kind, spec)
        regex = re.compile(spec if kind == "regex" else build_regex_from_schema(spec))
        for _ in range(2):
            tokens, ended = _walk(grammar, tokenizer, rng)
            text = tokenizer.decode(tokens)
            if ended:
                finished += 1
                assert regex.fullmatch(text), (spec, text)
                if kind == "json_schema":
                    json.loads(text)
    assert finished >= len(items)  # at least half the walks end within 40 steps


def test_json_and_regex_compile_on_llguidance_in_milliseconds(cache):
    grammar = cache.compile("json_schema", Reading)
    assert isinstance(grammar, LLGuidanceGrammar) and grammar.kind == "json_schema"
    assert grammar.regex == build_regex_from_schema(Reading)
    t0 = time.perf_counter()
    for i, schema in enumerate(SCHEMAS):
        cache.compile("json_schema", {**schema, "title": f"cold {i}"} if isinstance(schema, dict) else schema)
    assert (time.perf_counter() - t0) / len(SCHEMAS) < 0.25  # ~5 ms each; generous for a loaded machine


@pytest.mark.parametrize("kind, spec, match", [
    ("regex", r"[^\s\S]", "matches no string"),
    ("regex", r"a[^\s\S]b", "matches no string"),
    ("regex", "(unclosed", "invalid regex"),
    ("json_schema", '{"type": "integer", "minimum": 3, "maximum": 2}', "unsatisfiable"),
])
def test_bad_grammars_are_clear_errors_on_llguidance(cache, kind, spec, match):
    with pytest.raises(ValueError, match=match):
        cache.compile(kind, spec)


def test_regex_syntax_llguidance_lacks_falls_back_to_our_engine(tokenizer):
    c = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, disk_cache=False, backend="auto")
    grammar = c.compile("regex", r"a(?=b)b+")  # a look-ahead: llguidance's regex parser refuses it
    assert not isinstance(grammar, LLGuidanceGrammar)
    matcher = grammar.matcher()
    matcher.advance_text("ab")
    assert matcher.is_accepting()


# -- budget: deterministic, never wall-clock ---------------------------------------------------------------------
def test_pathological_schema_gets_a_deterministic_budget_error(cache):
    for _ in range(2):  # the same verdict every time (and cached)
        with pytest.raises(GrammarTooComplex, match="expands to a regex of more than 65536 characters"):
            cache.compile("json_schema", nested_schema(15, fresh=False))


def test_lexer_fuel_limit_is_a_clear_error(tokenizer):
    c = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, disk_cache=False, backend="llguidance",
                     lexer_fuel=2_000)
    with pytest.raises(GrammarTooComplex, match="grammar too complex"):
        c.compile("json_schema", nested_schema(6, fresh=False))


def test_no_wall_clock_refusal(tokenizer, monkeypatch):
    assert ServerArgs().grammar_compile_timeout is None
    assert grammar_budget.GrammarBudget().deadline is None
    real = time.monotonic
    start = real()
    # A machine so loaded that every clock read is 100 s later: the budget counts states and steps, so it compiles.
    calls = iter(range(1, 10 ** 9))
    monkeypatch.setattr(time, "monotonic", lambda: start + 100.0 * next(calls))
    for backend in ("fsm", "llguidance"):
        c = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, disk_cache=False, backend=backend)
        assert c.compile("json_schema", Reading).matcher() is not None


def test_server_args_validate_the_grammar_knobs():
    with pytest.raises(ValueError, match="grammar_backend"):
        ServerArgs(grammar_backend="nope")
    with pytest.raises(ValueError, match="grammar_step_fuel"):
        ServerArgs(grammar_step_fuel=0)
    with pytest.raises(ValueError, match="grammar_compile_timeout"):
        ServerArgs(grammar_compile_timeout=0)


# -- end to end: unbounded int and float fields always parse -----------------------------------------------------
def test_unbounded_numbers_always_parse_at_temperature_1(tiny_engine):
    engine = tiny_engine
    schema = json.dumps(Reading.model_json_schema())
    n = 24
    params = [{"max_new_tokens": 400, "temperature": 1.0, "seed": 1000 + i, "json_schema": schema} for i in range(n)]
    outs = engine.generate(["Give a reading as JSON.\n"] * n, params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        Reading.model_validate_json(out["text"])
