"""ebnf grammars through llguidance (constrained/llguidance_backend.py) with the SmolLM2 tokenizer and engine.

The mask is checked against an independent oracle over the whole vocabulary: for a context-free grammar
(nested parentheses) a token is allowed exactly when the text so far plus the token's bytes is still a prefix
of some sentence, and EOS exactly when the text is a sentence.
"""

from __future__ import annotations

import re
import sys

import pytest

pytest.importorskip("llguidance")

from sglang_backend.runtime.constrained import GrammarCache, get_vocabulary  # noqa: E402

# expr = term ("+" term)*, term = digits | "(" expr ")": not a regular language (nesting).
GBNF = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"'
LARK = 'start: expr\nexpr: term ("+" term)*\nterm: /[0-9]+/ | "(" expr ")"'


def viable(text: str) -> bool:
    """Is ``text`` a prefix of a sentence of GBNF? (Any such prefix completes with digits and ')'.)"""
    depth, prev = 0, ""
    for ch in text:
        if ch.isdigit() and ch.isascii():
            if prev == ")":
                return False
        elif ch == "+":
            if prev in ("", "(", "+"):
                return False
        elif ch == "(":
            if prev not in ("", "(", "+"):
                return False
            depth += 1
        elif ch == ")":
            if prev in ("", "(", "+") or depth == 0:
                return False
            depth -= 1
        else:
            return False
        prev = ch
    return True


def complete(text: str) -> bool:
    return viable(text) and text != "" and text[-1] not in "(+" and text.count("(") == text.count(")")


@pytest.fixture(scope="module")
def cache(smollm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    return GrammarCache(tok, len(tok), {tok.eos_token_id}, disk_cache=False)


@pytest.mark.parametrize("spec", [GBNF, LARK], ids=["gbnf", "lark"])
def test_mask_matches_oracle_over_whole_vocab(cache, spec):
    vocab = get_vocabulary(cache.tokenizer)
    texts = {}
    for i, b in enumerate(vocab.token_bytes[: cache.vocab_size]):
        if b is not None:
            try:
                texts[i] = b.decode("utf-8")
            except UnicodeDecodeError:
                texts[i] = None  # a partial character is never part of this ASCII grammar
    eos = cache.tokenizer.eos_token_id
    m = cache.compile("ebnf", spec).matcher()
    sentence = "(12+(3))+45"
    done = ""
    for step in range(len(sentence) + 1):
        allowed = set(m.allowed_token_ids())
        expect = {i for i, t in texts.items() if t and viable(done + t)}
        if complete(done):
            expect.add(eos)
        assert allowed == expect, (done, sorted(allowed ^ expect)[:10])
        # Every allowed token keeps the parse alive; a disallowed one is refused and leaves the matcher as it was.
        for tok in sorted(allowed - {eos})[:20]:
            m.copy().advance(tok)
        bad = next(i for i, t in texts.items() if t and not viable(done + t))
        with pytest.raises(ValueError, match="not allowed"):
            m.copy().advance(bad)
        if step < len(sentence):
            ch = sentence[step]
            m.advance(cache.tokenizer.convert_tokens_to_ids(ch))
            done += ch
    assert m.is_accepting() and not m.is_finished()  # "+..." could still follow
    m.advance(eos)
    assert m.is_finished() and m.allowed_token_ids() == [eos]


def test_forced_text_and_advance_text(cache):
    m = cache.compile("ebnf", 'root ::= "Answer: " ("yes" | "no") "."').matcher()
    assert m.forced_string() == "Answer: "
    m.advance_text("Answer: ")
    assert m.forced_string() == ""  # a choice
    yes = cache.tokenizer.encode("yes", add_special_tokens=False)
    for t in yes:
        m.advance(t)
    assert m.forced_string() == "."
    m.advance_text(".")
    assert m.is_finished()
    with pytest.raises(ValueError):
        cache.compile("ebnf", 'root ::= "a" "b"').matcher().advance_text("ax")


def test_masks_computed_on_the_mask_thread_equal_masks_computed_in_fill_mask(cache):
    """Each advance starts the next mask on the mask thread; fill_mask must add exactly the mask it would have
    computed itself, forks share it, and the cheap queries answer without waiting."""
    import random

    import torch

    schema = '{"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}'
    grammar = cache.compile("json_schema", schema)
    rng = random.Random(0)
    eos = cache.tokenizer.eos_token_id
    fast, slow = grammar.matcher(), grammar.matcher()
    for _ in range(30):
        grammar.prefetch = False
        try:
            ref = torch.zeros(cache.vocab_size)
            slow.fill_mask(ref)
            slow_ids = slow.allowed_token_ids()
        finally:
            grammar.prefetch = True
        row, fork_row = torch.zeros(cache.vocab_size), torch.zeros(cache.vocab_size)
        fork = fast.copy()
        fast.fill_mask(row)
        fork.fill_mask(fork_row)
        assert torch.equal(row, ref) and torch.equal(fork_row, ref)
        assert fast.allowed_token_ids() == slow_ids
        assert (fast.forced_string(), fast.is_finished(), fast.is_accepting()) == \
            (slow.forced_string(), slow.is_finished(), slow.is_accepting())
        if fast.is_finished():
            break
        tok = rng.choice([t for t in slow_ids if t != eos] or [eos])
        fast.advance(tok)
        slow.advance(tok)


def test_matchers_spread_over_mask_lanes_each_a_copy_of_its_lanes_prototype(smollm_dir):
    """With several mask threads, matchers go round robin over the lanes, each a copy of its own lane's prototype
    (copies of one prototype share its lexer behind a lock and would take turns); forks stay on their lane, and
    every lane's masks equal the one-thread masks."""
    import threading

    from transformers import AutoTokenizer

    from sglang_backend.runtime.constrained.llguidance_backend import LLGuidanceCompiler

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    regex = r'\{"name": "[A-Za-z ]{1,16}"\}'
    one = LLGuidanceCompiler(tok, len(tok), [tok.eos_token_id], mask_threads=1).compile_regex("regex", regex, regex)
    three = LLGuidanceCompiler(tok, len(tok), [tok.eos_token_id], mask_threads=3).compile_regex("regex", regex, regex)
    matchers = [three.matcher() for _ in range(6)]
    assert sorted(m.lane for m in matchers) == [0, 0, 1, 1, 2, 2]
    assert all(p is not None for p in three._prototypes) and len({id(p) for p in three._prototypes}) == 3
    assert matchers[4].copy().lane == matchers[4].lane
    ref = one.matcher()
    for t in tok.encode('{"name": "Par', add_special_tokens=False):
        ref.advance(t)
        for m in matchers:
            m.advance(t)
        want = ref.allowed_token_ids()
        assert all(m.allowed_token_ids() == want for m in matchers)
    names = {t.name for t in threading.enumerate()}
    assert {"llguidance-mask-0", "llguidance-mask-1", "llguidance-mask-2"} <= names


def test_a_budget_error_on_the_mask_thread_is_raised_by_fill_mask(cache, monkeypatch):
    import torch

    from sglang_backend.runtime.constrained import GrammarTooComplex
    from sglang_backend.runtime.constrained.llguidance_backend import LLGuidanceMatcher

    m = cache.compile("ebnf", GBNF).matcher()

    def over_budget(self):
        raise GrammarTooComplex("grammar too complex: step fuel")

    monkeypatch.setattr(LLGuidanceMatcher, "_compute_step_mask", over_budget)
    m.advance(cache.tokenizer.convert_tokens_to_ids("("))
    with pytest.raises(GrammarTooComplex, match="step fuel"):
        m.fill_mask(torch.zeros(cache.vocab_size))


@pytest.mark.parametrize("spec, match", [("root ::= undefined_rule", "invalid ebnf grammar"),
                                         ("start: /[/", "invalid ebnf grammar"),
                                         ("", "non-empty")])
def test_invalid_grammar_is_a_value_error(cache, spec, match):
    with pytest.raises(ValueError, match=match):
        cache.compile("ebnf", spec)


def test_without_llguidance_ebnf_is_a_clear_error(smollm_dir, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    with pytest.raises(ValueError, match="need the llguidance package"):
        GrammarCache(tok, len(tok), {tok.eos_token_id}, disk_cache=False).compile("ebnf", GBNF)


def test_engine_decodes_ebnf_with_jump_forward(smollm_engine):
    grammar = 'root ::= "The sum is (" [1-9] "+" [1-9] ") = " [0-9]+ "."'
    before = smollm_engine.scheduler.stats.num_jump_forward
    out = smollm_engine.generate("What is 2+3? Answer in one sentence.",
                                 {"ebnf": grammar, "temperature": 0, "max_new_tokens": 24})
    assert re.fullmatch(r"The sum is \([1-9]\+[1-9]\) = [0-9]+\.", out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert smollm_engine.scheduler.stats.num_jump_forward > before


def _additive_row(compiler, matcher):
    """The 0/-inf row for the matcher's current mask, built afresh (llguidance's mask, no cache)."""
    import torch

    matcher._sync()
    key = None if matcher.terminated else compiler.mask_key(matcher.matcher.compute_bitmask())
    return compiler._build_additive_mask(key, "cpu", torch.float32)


def test_fill_mask_equals_adding_a_freshly_built_row(cache):
    """fill_mask adds the cached 0/-inf row the mask thread found or built (without waiting once it is there):
    each step's row must be exactly the logits plus a row built afresh from llguidance's mask, on every path
    (float32, float64 and bfloat16 rows, a row wider than the vocabulary, forks) and once the grammar stopped."""
    import random

    import torch

    schema = ('{"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"}, '
              '"e": {"enum": ["red", "green", "blue"]}}, "required": ["s", "n", "e"]}')
    eos, v = cache.tokenizer.eos_token_id, cache.vocab_size
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for kind, spec, text in [("json_schema", schema, '{"s": "a b", "n": 12, "e": "green"}'),
                             ("regex", "[a-z ]+", "hello world")]:
        grammar = cache.compile(kind, spec)
        m = grammar.matcher()
        for tok in cache.tokenizer.encode(text, add_special_tokens=False) + [eos, None]:
            logits = torch.randn(v, generator=gen) * 10
            expected = logits + _additive_row(grammar.compiler, m)
            got, got64, got16 = logits.clone(), logits.double(), logits.bfloat16()
            wide = torch.cat([logits, torch.zeros(7)])
            for row in (got, got64, got16, wide):
                m.fill_mask(row)
            assert torch.equal(got, expected) and torch.equal(got64, expected.double())
            assert torch.equal(got16, logits.bfloat16() + expected.sub(logits).bfloat16())
            assert torch.equal(wide[:v], expected) and bool((wide[v:] == float("-inf")).all())
            if tok is None:
                break
            m.advance(tok)
            if rng.random() < 0.5:
                m = m.copy()  # a fork shares the step mask
        assert m.is_finished() and m.allowed_token_ids() == [eos]


def test_a_stopped_matcher_masks_eos_only_without_computing(cache):
    """A matcher that stopped (the grammar complete, or EOS taken) gets the shared EOS-only mask at once, the
    same one llguidance computes there."""
    import torch

    grammar = cache.compile("regex", "ab")
    m = grammar.matcher()
    for tok in cache.tokenizer.encode("ab", add_special_tokens=False):
        m.advance(tok)
    assert m.is_finished() and not m.terminated
    assert m._next is grammar.compiler.eos_step
    assert torch.equal(grammar.compiler.allowed(grammar.compiler.mask_key(m.matcher.compute_bitmask())),
                       grammar.compiler.allowed(None))
    m.advance(cache.tokenizer.eos_token_id)
    assert m.terminated and m._next is grammar.compiler.eos_step
    row = torch.zeros(cache.vocab_size)
    m.fill_mask(row)
    assert torch.nonzero(row == 0).flatten().tolist() == [cache.tokenizer.eos_token_id]
