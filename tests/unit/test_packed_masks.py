"""A batch's llguidance masks applied from packed bits (constrained/packed_masks.py, the scheduler's path on an
accelerator) allow exactly what each row's own ``fill_mask`` allows, and masks computed by several mask threads
equal masks computed by one."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("llguidance")

from sglang_backend.runtime.constrained import GrammarCache  # noqa: E402
from sglang_backend.runtime.constrained.packed_masks import apply_packed_masks  # noqa: E402

REGEX = r'\{"name": "[A-Za-z ]{1,16}", "capital": (true|false)\}'
SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}'


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


def make_cache(tokenizer, vocab_size: int, mask_threads: int = 1) -> GrammarCache:
    return GrammarCache(tokenizer, vocab_size, {tokenizer.eos_token_id}, disk_cache=False, backend="llguidance",
                        mask_threads=mask_threads)


def walked_matchers(cache, rng: random.Random, n: int) -> list:
    """``n`` matchers of two grammars, each advanced a random number of allowed tokens (some to the end)."""
    eos = cache.tokenizer.eos_token_id
    grammars = [cache.compile("regex", REGEX), cache.compile("json_schema", SCHEMA)]
    out = []
    for k in range(n):
        m = grammars[k % 2].matcher()
        for _ in range(rng.randrange(0, 40)):
            if m.is_finished():
                break
            allowed = [t for t in m.allowed_token_ids() if t != eos]
            if not allowed:
                break
            m.advance(rng.choice(allowed))
        if k == n - 1 and m.is_accepting() and not m.terminated:
            m.advance(eos)  # terminated: EOS only
        out.append(m)
    return out


@pytest.mark.parametrize("extra_columns", [0, 77])  # a model with more logits than the grammar's vocabulary
def test_packed_masks_equal_each_rows_own_mask(tokenizer, extra_columns):
    vocab = len(tokenizer)
    cache = make_cache(tokenizer, vocab)
    matchers = walked_matchers(cache, random.Random(extra_columns), 12)
    logits = torch.randn(len(matchers) + 3, vocab + extra_columns)
    rows = [0, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 14]  # some rows unconstrained, out of the batch's order too
    want = logits.clone()
    for row, m in zip(rows, matchers):
        m.fill_mask(want[row])
    got = logits.clone()
    apply_packed_masks(got, rows, [m.packed_mask() for m in matchers], vocab)
    assert torch.equal(got, want)
    for row in {1, 4, 13}:  # untouched
        assert torch.equal(got[row], logits[row])
    assert torch.isinf(got[rows[-1]]).sum() > 0


def test_a_whole_batch_is_masked_in_place(tokenizer):
    vocab = len(tokenizer)
    cache = make_cache(tokenizer, vocab)
    matchers = walked_matchers(cache, random.Random(5), 4)
    logits = torch.randn(4, vocab)
    want = logits.clone()
    for row, m in enumerate(matchers):
        m.fill_mask(want[row])
    apply_packed_masks(logits, [0, 1, 2, 3], [m.packed_mask() for m in matchers], vocab)
    assert torch.equal(logits, want)
    apply_packed_masks(logits, [], [], vocab)  # nothing constrained: nothing to do
    assert torch.equal(logits, want)


def test_several_mask_threads_compute_the_same_masks(tokenizer):
    vocab = len(tokenizer)
    one, four = make_cache(tokenizer, vocab, 1), make_cache(tokenizer, vocab, 4)
    assert four._llguidance_compiler(required=True).mask_threads == 4
    rng = random.Random(11)
    eos = tokenizer.eos_token_id
    a = [one.compile("regex", REGEX).matcher() for _ in range(16)]
    b = [four.compile("regex", REGEX).matcher() for _ in range(16)]
    for _step in range(30):
        for x, y in zip(a, b):  # every matcher of b submitted before any mask is read: the threads race
            assert x.allowed_token_ids() == y.allowed_token_ids()
        for x, y in zip(a, b):
            if x.is_finished():
                continue
            tok = rng.choice([t for t in x.allowed_token_ids() if t != eos] or [eos])
            x.advance(tok)
            y.advance(tok)
        assert [x.forced_string() for x in a] == [y.forced_string() for y in b]


def test_mask_threads_default_to_one_on_the_cpu():
    from sglang_backend.runtime.constrained.grammar import default_mask_threads
    from sglang_backend.runtime.server_args import ServerArgs

    assert default_mask_threads("cpu") == 1
    assert 1 <= default_mask_threads("cuda") <= 8
    with pytest.raises(ValueError, match="grammar_mask_threads"):
        ServerArgs(model_path="x", grammar_mask_threads=-1)
