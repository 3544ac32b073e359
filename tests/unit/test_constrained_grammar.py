"""GrammarCache / GrammarMatcher / jump-forward re-tokenization, on SmolLM2's tokenizer and on small
synthetic tokenizers (SentencePiece-style byte fallback, a vocabulary without every byte)."""

from __future__ import annotations

import json
import random
import threading
import time

import numpy as np
import pytest
import torch

from sglang_backend.runtime.constrained import (
    GrammarCache,
    TokenVocabulary,
    apply_jump_forward,
    fill_masks,
    get_vocabulary,
    retokenize_jump_forward,
)

PAPER_REGEX = r"""\{"summary": "[\w\d\s]*", "grade": "[ABCD][+-]?"\}"""
HOGWARTS = "霍格沃茨特快列车|霍比特人比尔博"


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture()
def cache_dir(tmp_path):
    return str(tmp_path / "fsm")


@pytest.fixture(scope="module")
def cache(tokenizer, tmp_path_factory):
    c = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, backend="fsm",  # our engine's internals
                     cache_dir=str(tmp_path_factory.mktemp("fsm_shared")))
    yield c
    c.shutdown()


def _bytes(tokenizer, ids) -> bytes:
    v = get_vocabulary(tokenizer)
    return b"".join(v.token_bytes[i] for i in ids)


# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------


def test_byte_level_vocabulary(tokenizer):
    v = get_vocabulary(tokenizer)
    assert v.style == "byte_level"
    ids = tokenizer.encode('{"summary": "霍格沃茨"}')
    assert _bytes(tokenizer, ids) == '{"summary": "霍格沃茨"}'.encode()
    for sid in tokenizer.all_special_ids:
        assert v.token_bytes[sid] is None  # special tokens have no text and are never allowed
    assert v.token_bytes[tokenizer.convert_tokens_to_ids("Ġ")] == b" "
    assert v.greedy_tokenize("héllo 霍".encode()) and _bytes(tokenizer, v.greedy_tokenize("héllo 霍".encode())) == "héllo 霍".encode()


# ---------------------------------------------------------------------------------------------
# Matcher semantics
# ---------------------------------------------------------------------------------------------


def test_fill_mask_and_advance(cache, tokenizer):
    g = cache.compile("regex", r"(yes|no)!")
    m = g.matcher()
    logits = torch.randn(g.vocab_size)
    orig = logits.clone()
    m.fill_mask(logits)
    allowed = m.allowed_mask()
    assert torch.equal(torch.isfinite(logits), allowed)
    assert torch.equal(logits[allowed], orig[allowed])  # allowed logits untouched
    v = get_vocabulary(tokenizer)
    for tid in torch.nonzero(allowed).flatten().tolist():
        assert b"yes!".startswith(v.token_bytes[tid]) or b"no!".startswith(v.token_bytes[tid])
    eos = tokenizer.eos_token_id
    assert not allowed[eos]  # EOS only in accepting states
    with pytest.raises(ValueError, match="not allowed"):
        m.advance(eos)
    with pytest.raises(ValueError, match="not allowed"):
        m.advance(tokenizer.convert_tokens_to_ids("maybe"))
    m.advance(tokenizer.convert_tokens_to_ids("yes"))
    assert not m.is_accepting() and m.forced_string() == "!"
    m.advance_text("!")
    assert m.is_accepting() and m.is_finished()  # nothing can follow: the scheduler ends here
    assert m.allowed_token_ids() == [eos]
    m.advance(eos)
    assert m.terminated and m.is_finished()
    with pytest.raises(ValueError):
        m.advance(eos)


def test_special_tokens_never_allowed(cache, tokenizer):
    g = cache.compile("regex", r".{0,5}")
    m = g.matcher()
    allowed = m.allowed_mask()
    for sid in tokenizer.all_special_ids:
        if sid == tokenizer.eos_token_id:
            assert allowed[sid]  # accepting (empty string matches)
        else:
            assert not allowed[sid]


def test_accepting_with_continuation(cache, tokenizer):
    g = cache.compile("regex", r"\d{1,3}")
    m = g.matcher()
    m.advance(tokenizer.convert_tokens_to_ids("7"))
    assert m.is_accepting() and not m.is_finished()
    assert m.forced_string() == ""  # EOS or another digit: a choice
    assert m.is_allowed(tokenizer.eos_token_id)


def test_fill_mask_wider_row_and_dtype(cache):
    g = cache.compile("regex", r"[ab]")
    m = g.matcher()
    row = torch.zeros(g.vocab_size + 64, dtype=torch.bfloat16)
    m.fill_mask(row)
    assert torch.isinf(row[g.vocab_size:]).all()
    assert int(torch.isfinite(row).sum()) == int(m.allowed_mask().sum())


@pytest.mark.parametrize("stacked", [False, True])
def test_fill_masks_batch(cache, stacked):
    g1 = cache.compile("regex", r"[ab]")
    g2 = cache.compile("regex", r"\d+")
    for matchers in ([g1.matcher(), None, g2.matcher()], [g1.matcher(), g1.matcher(), g2.matcher()]):
        logits = torch.randn(3, g1.vocab_size)
        orig = logits.clone()
        fill_masks(logits, matchers, stacked=stacked)
        for row, m in enumerate(matchers):
            allowed = m.allowed_mask() if m is not None else torch.ones(g1.vocab_size, dtype=torch.bool)
            assert torch.equal(torch.isfinite(logits[row]), allowed)
            assert torch.equal(logits[row][allowed], orig[row][allowed])


def test_matcher_copy_is_independent(cache, tokenizer):
    g = cache.compile("regex", HOGWARTS)
    a = g.matcher()
    a.advance_text("霍")
    b = a.copy()
    b.advance_text("比")
    assert a.forced_string() == ""  # 格 or 比
    assert b.forced_string() == "特人比尔博"


def test_multibyte_tokens_inside_characters(cache, tokenizer):
    """SmolLM2 spells 霍 as three one-byte tokens; the byte-level matcher takes them one by one."""
    g = cache.compile("regex", HOGWARTS)
    m = g.matcher()
    ids = tokenizer.encode("霍比特人比尔博")
    assert len(ids) > 7  # partial-character tokens
    for i, tid in enumerate(ids):
        assert m.is_allowed(tid)
        m.advance(tid)
    assert m.is_finished()


# ---------------------------------------------------------------------------------------------
# Errors before decoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.serial  # times a cached failure (< 50 ms): `make test`'s serial phase, beside no other worker
@pytest.mark.parametrize(
    "kind, spec, match",
    [
        ("regex", "(unclosed", "invalid regex"),
        ("regex", r"[^\s\S]", "matches no string"),
        ("regex", r"(a|b)*a(a|b){16}", "regex too complex"),
        ("json_schema", '{"type": "strin"}', "invalid schema"),
        ("json_schema", "{bad json", "invalid schema"),
        ("json_schema", '{"type": "integer", "minimum": 3, "maximum": 2}', "unsatisfiable"),
        ("ebnf", "root ::= undefined_rule", "invalid ebnf grammar"),
        ("yaml", "a: 1", "unknown grammar kind"),
    ],
)
def test_compile_errors(tokenizer, tmp_path, kind, spec, match):
    c = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, backend="fsm", cache_dir=str(tmp_path),
                     regex_options={"max_byte_states": 5000})
    with pytest.raises(ValueError, match=match):
        c.compile(kind, spec)
    # A failure is remembered: the second attempt fails at once.
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        c.compile(kind, spec)
    assert time.perf_counter() - t0 < 0.05
    fut = c.submit(kind, spec)
    with pytest.raises(ValueError, match=match):
        fut.result(timeout=30)
    c.shutdown()


# ---------------------------------------------------------------------------------------------
# Caching and async compilation
# ---------------------------------------------------------------------------------------------


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age"]}


@pytest.mark.serial  # times cold, memory and disk compiles: `make test`'s serial phase, beside no other worker
def test_cache_memory_and_disk(tokenizer, cache_dir):
    c1 = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, backend="fsm", cache_dir=cache_dir)
    t0 = time.perf_counter()
    g1 = c1.compile("json_schema", json.dumps(SCHEMA))
    cold = time.perf_counter() - t0
    assert c1.stats["builds"] == 1
    t0 = time.perf_counter()
    assert c1.compile("json_schema", json.dumps(SCHEMA)) is g1  # memory hit: same object
    assert c1.compile("json_schema", SCHEMA) is g1  # dict spec normalises to the same key
    hot = time.perf_counter() - t0
    assert hot < cold / 5 and hot < 0.05
    # A fresh cache (a new process, say) reuses the disk entry: no rebuild.
    c2 = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, backend="fsm", cache_dir=cache_dir)
    t0 = time.perf_counter()
    g2 = c2.compile("json_schema", json.dumps(SCHEMA))
    disk = time.perf_counter() - t0
    assert c2.stats["disk_hits"] == 1 and c2.stats["builds"] == 0
    assert disk < cold
    assert np.array_equal(g1.index.masks, g2.index.masks)
    assert np.array_equal(g1.dfa.transitions, g2.dfa.transitions)
    # A different EOS set is a different index.
    c3 = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id, 1}, backend="fsm", cache_dir=cache_dir)
    c3.compile("json_schema", json.dumps(SCHEMA))
    assert c3.stats["builds"] == 1
    for c in (c1, c2, c3):
        c.shutdown()


def test_submit_is_async_and_deduplicated(tokenizer, cache_dir):
    c = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, backend="fsm", cache_dir=cache_dir)
    futs = [c.submit("regex", r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)") for _ in range(3)]
    g = futs[0].result(timeout=60)
    assert all(f.result(timeout=60) is g for f in futs)
    assert c.stats["builds"] == 1
    done = c.submit("regex", r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)")
    assert done.done() and done.result() is g  # cached: an already-finished future
    c.shutdown()


def test_concurrent_compiles_share_one_build(tokenizer, cache_dir):
    c = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, backend="fsm", cache_dir=cache_dir)
    results, errors = [], []

    def work():
        try:
            results.append(c.compile("regex", r"\(\d{3}\) \d{3}-\d{4}"))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert c.stats["builds"] == 1
    assert all(np.array_equal(r.index.masks, results[0].index.masks) for r in results)
    c.shutdown()


# ---------------------------------------------------------------------------------------------
# Jump-forward re-tokenization (Appendix B.2)
# ---------------------------------------------------------------------------------------------


def test_retokenize_paper_example(tokenizer):
    """The model emitted `{`; the forced rest `"summary": "` fuses with it: `{"`, `summary`, `":`, `Ġ"`."""
    out = tokenizer.encode("{")
    n_drop, new = retokenize_jump_forward(tokenizer, out, '"summary": "')
    assert n_drop == 1
    assert new == tokenizer.encode('{"summary": "')
    assert tokenizer.convert_ids_to_tokens(new) == ['{"', "summary", '":', 'Ġ"']


def test_retokenize_boundary_fusion(tokenizer):
    out = tokenizer.encode("The answer is")
    out = out + [tokenizer.convert_tokens_to_ids("Ġ")]  # the model emitted a bare space token
    n_drop, new = retokenize_jump_forward(tokenizer, out, '"name"')
    assert n_drop == 1  # `Ġ` + `"` fuse into `Ġ"`
    kept = out[:len(out) - n_drop] + new
    assert _bytes(tokenizer, kept) == b'The answer is "name"'
    assert kept == tokenizer.encode('The answer is "name"')
    # Tokens that do not fuse are kept.
    n_drop, new = retokenize_jump_forward(tokenizer, tokenizer.encode("x ="), "\n")
    assert _bytes(tokenizer, tokenizer.encode("x =")[: len(tokenizer.encode("x =")) - n_drop] + new) == b"x =\n"


def test_retokenize_never_produces_special_tokens(tokenizer):
    """Forced text that spells a special token is written with ordinary tokens."""
    out = tokenizer.encode("x")
    n_drop, new = retokenize_jump_forward(tokenizer, out, "<|im_end|>")
    assert not set(new) & set(tokenizer.all_special_ids)
    assert _bytes(tokenizer, out[:len(out) - n_drop] + new) == b"x<|im_end|>"


def test_retokenize_chinese_boundaries(tokenizer):
    out = tokenizer.encode("霍格")
    # The last token is a continuation byte of 格; a 1-token window is widened to the character start.
    v = get_vocabulary(tokenizer)
    assert (v.token_bytes[out[-1]][0] & 0xC0) == 0x80
    for lookback in (1, 2, 4, 16):
        n_drop, new = retokenize_jump_forward(tokenizer, out, "沃茨特快列车", max_lookback=lookback)
        kept = out[:len(out) - n_drop] + new
        assert _bytes(tokenizer, kept) == "霍格沃茨特快列车".encode()
        assert tokenizer.decode(kept) == "霍格沃茨特快列车"
        assert n_drop <= len(out)
    # Forced text that starts with a character fusing with the previous one in BPE.
    out = tokenizer.encode("霍比")
    n_drop, new = retokenize_jump_forward(tokenizer, out, "特人比尔博")
    assert tokenizer.decode(out[:len(out) - n_drop] + new) == "霍比特人比尔博"


def test_apply_jump_forward_hogwarts_walks(cache, tokenizer):
    """Every output of random walks with jump-forward matches the Chinese alternation."""
    import re

    g = cache.compile("regex", HOGWARTS)
    rng = random.Random(0)
    v = get_vocabulary(tokenizer)
    seen = set()
    for _ in range(12):
        m = g.matcher()
        out: list[int] = []
        while not m.is_finished():
            n_drop, new, forced = apply_jump_forward(m, tokenizer, out)
            if forced:
                out = out[:len(out) - n_drop] + new
                continue
            tid = rng.choice(m.allowed_token_ids())
            m.advance(tid)
            out.append(tid)
        text = tokenizer.decode(out)
        assert re.fullmatch(HOGWARTS, text)
        assert b"".join(v.token_bytes[t] for t in out) == text.encode()
        seen.add(text)
    assert seen == {"霍格沃茨特快列车", "霍比特人比尔博"}


# ---------------------------------------------------------------------------------------------
# Other tokenizer families
# ---------------------------------------------------------------------------------------------


def _sentencepiece_tokenizer():
    """A small Llama-2-style tokenizer: Metaspace `▁`, BPE with `<0xNN>` byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁", "y", "e", "s", "n", "o", "h", "l", "a", "b", "c", "▁y", "▁ye", "▁yes", "▁n", "▁no", "he", "ll",
              "hell", "hello", "▁hello", "{", "}", '"', ":", "▁\"", '"}', "0", "1", "2", "3"]
    merges = [("▁", "y"), ("▁y", "e"), ("▁ye", "s"), ("▁", "n"), ("▁n", "o"), ("h", "e"), ("l", "l"), ("he", "ll"),
              ("hell", "o"), ("▁", "hello"), ("▁", '"'), ('"', "}")]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    tk = Tokenizer(model)
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_fallback(tmp_path):
    import re

    tok = _sentencepiece_tokenizer()
    v = get_vocabulary(tok)
    assert v.style == "sentencepiece"
    assert v.token_bytes[tok.convert_tokens_to_ids("▁hello")] == b" hello"
    assert v.token_bytes[tok.convert_tokens_to_ids("<0xE9>")] == b"\xe9"
    assert v.byte_complete
    c = GrammarCache(tok, len(tok), {tok.eos_token_id}, backend="fsm", cache_dir=str(tmp_path))
    pattern = r" (hello|héllo|霍格) (yes|no)"
    g = c.compile("regex", pattern)
    rng = random.Random(1)
    outs = set()
    for _ in range(10):
        m = g.matcher()
        out: list[int] = []
        while not m.is_finished():
            if rng.random() < 0.5:
                n_drop, new, forced = apply_jump_forward(m, tok, out)
                if forced:
                    out = out[:len(out) - n_drop] + new
                    continue
            tid = rng.choice(m.allowed_token_ids())
            m.advance(tid)
            if tid == tok.eos_token_id:
                break
            out.append(tid)
        text = b"".join(v.token_bytes[t] for t in out).decode()
        assert re.fullmatch(pattern, text), text
        outs.add(text.split()[0])
    assert len(outs) >= 2
    # Re-tokenization anchors around the `▁` that SentencePiece prepends to every encoded text.
    out = tok.encode(" he", add_special_tokens=False)
    n_drop, new = retokenize_jump_forward(tok, out, "llo")
    assert b"".join(v.token_bytes[t] for t in out[:len(out) - n_drop] + new) == b" hello"
    c.shutdown()


def test_vocabulary_without_every_byte(tmp_path):
    """Token-level liveness: a branch the vocabulary cannot spell is pruned; a grammar it cannot spell
    at all is rejected before decoding."""
    toks = [b"a", b"b", b"ab", b"c", b"xa", None]  # no single 'x' token; id 5 = EOS
    vocab = TokenVocabulary(toks, special_ids={5})
    assert not vocab.byte_complete
    c = GrammarCache(vocab, 6, {5}, backend="fsm", cache_dir=str(tmp_path))
    g = c.compile("regex", r"ax|b|xab?")
    m = g.matcher()
    # 'a' leads to a state that needs a lone 'x': not allowed. 'xa' is fine (then optional 'b').
    assert m.allowed_token_ids() == [1, 4]
    m.advance(4)
    assert m.is_accepting() and m.allowed_token_ids() == [1, 5]
    with pytest.raises(ValueError, match="unrealisable"):
        c.compile("regex", r"\d+")
    with pytest.raises(ValueError, match="unrealisable"):
        c.compile("regex", r"x")
    c.shutdown()
