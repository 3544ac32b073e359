"""The grammar mask's C kernel (constrained/mask_row.c) against the dense reference: -inf exactly where a token is
not allowed (and past the vocabulary), every allowed logit left as it was.

Random masks from none to all tokens allowed (the kernel skips all-allowed 64-token words, stores all-forbidden
ones and blends the rest), vocabularies that are not a multiple of 64 or 8, rows narrower and wider than the
vocabulary; then both engines' ``fill_mask`` on the kernel against their numpy / torch path, on random masks
and along grammar walks.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from sglang_backend.runtime.constrained import GrammarCache
from sglang_backend.runtime.constrained import mask_row as mask_row_module

KERNEL = mask_row_module.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C kernel here (no AVX2 or no C compiler)")
DENSITIES = (0.0, 1e-5, 1e-3, 0.02, 0.5, 0.98, 0.999, 1 - 1e-5, 1.0)


def reference(logits: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
    """-inf where not allowed and past the vocabulary, the logit elsewhere."""
    out = torch.full_like(logits, float("-inf"))
    n = min(len(logits), len(allowed))
    keep = torch.from_numpy(allowed[:n])
    out[:n][keep] = logits[:n][keep]
    return out


def random_allowed(rng: np.random.Generator, vocab: int, density: float) -> np.ndarray:
    allowed = rng.random(vocab) < density
    if 0 < density < 1e-4:  # a handful of ids, as a forced or near-forced step
        allowed[rng.choice(vocab, size=min(3, vocab), replace=False)] = True
    return allowed


def kernels() -> list:
    """The kernel as built here, and its ctypes build (the fallback where Python's headers are missing)."""
    plain = mask_row_module.load(None)
    return [KERNEL] + ([plain] if plain is not None and not isinstance(KERNEL, ctypes._CFuncPtr) else [])


@needs_kernel
@pytest.mark.parametrize("vocab", [49152, 49155, 1000, 64, 63, 8, 1])
def test_kernel_equals_the_dense_reference(vocab):
    rng = np.random.default_rng(vocab)
    for kernel in kernels():
        for density in DENSITIES:
            allowed = random_allowed(rng, vocab, density)
            bits = np.packbits(allowed, bitorder="little").tobytes()
            for width in {vocab, vocab + 1, vocab + 64, max(vocab - 3, 0), 0}:
                logits = torch.from_numpy(rng.standard_normal(width).astype(np.float32) * 10)
                if width > 2:
                    logits[:3] = torch.tensor([float("inf"), float("-inf"), 1e38])
                row = logits.clone()
                kernel(row.data_ptr(), width, bits, vocab)
                assert torch.equal(row, reference(logits, allowed)), (kernel, density, width)


@needs_kernel
def test_kernel_refuses_too_few_bits():
    if isinstance(KERNEL, ctypes._CFuncPtr):
        pytest.skip("the ctypes build takes a pointer and cannot check")
    with pytest.raises(ValueError, match="fewer bits"):
        KERNEL(torch.zeros(100).data_ptr(), 100, bytes(12), 100)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


def _rows(vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """A row as the scheduler's, one wider than the vocabulary, and a view of a batch's row."""
    batch = torch.randn(3, vocab + 5, generator=gen)
    return [torch.randn(vocab, generator=gen) * 10, torch.randn(vocab + 64, generator=gen), batch[1]]


@needs_kernel
def test_llguidance_fill_mask_on_random_masks(tokenizer):
    """fill_mask through the kernel allows exactly the step's tokens, on random masks from none to all allowed
    (the mask thread's step replaced), as the numpy path did."""
    pytest.importorskip("llguidance")
    from sglang_backend.runtime.constrained.llguidance_backend import LLGuidanceMatcher

    cache = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, disk_cache=False)
    grammar = cache.compile("regex", "[a-z]+")
    compiler, vocab = grammar.compiler, cache.vocab_size
    assert compiler.mask_row is KERNEL
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    m = grammar.matcher()
    for density in DENSITIES:
        allowed = random_allowed(rng, vocab, density)
        key = np.packbits(np.concatenate([allowed, np.zeros(-vocab % 32 + 32, bool)]), bitorder="little").tobytes()
        m._sync()
        m._next = compiler.step_mask(key)
        assert isinstance(m, LLGuidanceMatcher) and torch.equal(m.allowed_mask(), torch.from_numpy(allowed))
        for logits in _rows(vocab, gen):
            row = logits.clone()
            m.fill_mask(row)
            assert torch.equal(row, reference(logits, allowed)), density
        compiler.mask_row = None  # the numpy path (no kernel) on the same mask agrees
        try:
            numpy_step = compiler.step_mask(key)
        finally:
            compiler.mask_row = KERNEL
        logits = torch.randn(vocab, generator=gen)
        row = logits.clone()
        numpy_step.apply(row.numpy())
        assert torch.equal(row, reference(logits, allowed)), density


@pytest.mark.parametrize("kernel_on", [True, False], ids=["kernel", "no-kernel"])
@pytest.mark.parametrize("backend", ["llguidance", "fsm"])
def test_fill_mask_along_walks_equals_the_dense_path(tokenizer, backend, kernel_on):
    """Along seeded random walks of a JSON schema, a float32 row (the kernel's, or without it numpy's / torch's)
    equals the logits plus the engine's cached 0/-inf row (its path for other devices and dtypes), whatever the
    number of allowed tokens."""
    import random

    if backend == "llguidance":
        pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}, "n": {"type": "integer"},
                                               "e": {"enum": ["red", "green"]}}, "required": ["s", "n", "e"]}
    eos = tokenizer.eos_token_id
    cache = GrammarCache(tokenizer, len(tokenizer), {eos}, disk_cache=False, backend=backend)
    grammar = cache.compile("json_schema", schema)
    owner = grammar if backend == "fsm" else grammar.compiler
    if kernel_on and KERNEL is None:
        pytest.skip("no C kernel here (no AVX2 or no C compiler)")
    assert owner.mask_row is KERNEL
    if not kernel_on:
        owner.mask_row = None  # matchers started from now on take the path for hosts without the kernel
    rng, gen, seen = random.Random(0), torch.Generator().manual_seed(0), set()
    for _ in range(4):
        m = grammar.matcher()
        for _ in range(40):
            ids = m.allowed_token_ids()
            seen.add(min(len(ids), 2))
            for logits in _rows(cache.vocab_size, gen):
                row, dense = logits.clone(), logits.double()  # float64: the engine's torch path
                m.fill_mask(row)
                m.fill_mask(dense)
                assert torch.equal(row, dense.float()), (backend, len(ids))
                assert torch.nonzero(row[:cache.vocab_size] > float("-inf")).flatten().tolist() == ids
            if m.is_finished() or not ids:
                break
            tok = rng.choice(ids)
            m.advance(tok)
            if tok == eos:
                break
    assert {1, 2} <= seen  # forced steps and choices both met


def test_native_cpu_kernels_off_turns_the_mask_kernel_off_too(smollm_dir):
    """``disable_native_cpu_kernels`` (the ablation knob) reaches the grammar masks: both engines' grammars then
    mask CPU rows through numpy, with the same result as the kernel."""
    import torch
    from transformers import AutoTokenizer

    from sglang_backend.runtime.constrained import GrammarCache, cache_options
    from sglang_backend.runtime.server_args import ServerArgs

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    assert cache_options(ServerArgs(model_path="x", disable_native_cpu_kernels=True))["native_masks"] is False
    assert cache_options(ServerArgs(model_path="x"))["native_masks"] is True
    regex = r'\{"a": "[a-z]{1,6}", "b": (true|false)\}'
    rows = {}
    for native_masks in (True, False):
        for backend in ("fsm", "llguidance"):
            cache = GrammarCache(tok, len(tok), {tok.eos_token_id}, disk_cache=False, backend=backend,
                                 native_masks=native_masks)
            grammar = cache.compile("regex", regex)
            kernel = grammar.compiler.mask_row if backend == "llguidance" else grammar.mask_row
            if not native_masks:
                assert kernel is None  # asked off (on, it is None only where it cannot be built)
            m = grammar.matcher()
            m.advance(tok.encode('{"a": "')[0])
            row = torch.randn(len(tok), generator=torch.Generator().manual_seed(0))
            m.fill_mask(row)
            rows[(native_masks, backend)] = row
    for backend in ("fsm", "llguidance"):
        assert torch.equal(rows[(True, backend)], rows[(False, backend)])
        assert torch.isinf(rows[(True, backend)]).any()
