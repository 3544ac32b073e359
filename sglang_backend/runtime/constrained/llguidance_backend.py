"""Grammars compiled by llguidance, behind the same matcher interface as ``grammar.GrammarMatcher``.

llguidance (an Earley parser over lazily built lexer automata, with a token mask computed per step) compiles
a grammar in milliseconds where our regex -> byte DFA -> token index path takes up to seconds for realistic
JSON schemas (``benchmarks/bench_grammar.py``, issue 25), so it is the default engine for every grammar kind:

* ``ebnf``: GBNF (``root ::= ...``, as upstream SGLang / llama.cpp take it) or llguidance's Lark dialect
  (``start: ...``, what ``guidance``'s ``node.ll_grammar()`` sends), through ``llguidance.grammar_from``;
* ``regex`` and ``json_schema``: the regex (a JSON schema's is ``json_schema.build_regex_from_schema``'s, so
  layout, digit bounds and supported keywords are the same on both engines) becomes one Lark lexeme, with
  ``\\d``/``\\w``/``\\s`` kept ASCII as in ``regex_fsm``. A regex llguidance cannot parse (look-arounds) raises
  :class:`UnsupportedByLLGuidance` and ``grammar.GrammarCache`` compiles it on our own engine instead.

The budget is llguidance's deterministic fuel and state counters (``budget.GrammarBudget``: ``lexer_fuel``
when the grammar is built, ``step_fuel`` per token mask, ``max_states`` lexer states), never wall-clock time.

The scheduler drives a matcher exactly like ``GrammarMatcher``: ``fill_mask`` before sampling, ``advance``
after, ``is_finished`` to end, ``forced_string`` + ``advance_text`` for jump-forward (llguidance's
``compute_ff_bytes`` is the forced text; re-tokenization stays ``grammar.retokenize_jump_forward``'s).
Masks are computed off the critical path: each transition starts the next mask on background threads
(``_MaskThreads``; llguidance drops the GIL while it walks the token trie), overlapping the model's forward as
upstream SGLang does, and ``fill_mask`` only writes -inf into the logits row where the mask forbids: on a CPU
float32 row one C call reads llguidance's packed bits (``mask_row``), elsewhere a 0/-inf row is added, cached by
the mask's bytes (masks repeat: every step inside a string has the same one). ``benchmarks/bench_grammar.py``
reports both sides: the masking on the critical path and the mask computation moved off it. llguidance is
optional: without it regex and JSON schemas stay on our engine and an ``ebnf`` request is a clear ``ValueError``
(a 400 on the server).
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import re
import threading

import numpy as np
import torch

from . import budget as grammar_budget
from .mask_row import kernel as mask_row_kernel
from .regex_fsm import _preprocess

__all__ = ["LLGuidanceCompiler", "LLGuidanceGrammar", "LLGuidanceMatcher", "UnsupportedByLLGuidance",
           "llguidance_available"]

MAX_CACHED_BIASES = 64  # 0/-inf rows shared by all grammars of one compiler (~200 kB each at 49k tokens)
# Without the C kernel (mask_row), steps that allow at most this many tokens (or forbid at most
# SPARSE_MAX_DISALLOWED) are masked by touching only those ids (_StepMask.apply): the dense 0/-inf row, written by
# the mask thread on another core, costs ~25 us to add on a 2-core host; a fill plus a few hundred scattered
# writes costs a fraction.
SPARSE_MAX_ALLOWED = 1024
SPARSE_MAX_DISALLOWED = 8192


class UnsupportedByLLGuidance(ValueError):
    """The regex uses syntax llguidance does not parse (look-arounds...): compile it on our own engine."""


def llguidance_available() -> bool:
    try:
        import llguidance  # noqa: F401
        import llguidance.hf  # noqa: F401
    except ImportError:
        return False
    return True


def _whole_chars(data: bytes) -> str:
    """The longest prefix of ``data`` that is whole UTF-8 characters, decoded."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


# A counted repetition (``a{n}``, ``a{m,n}``) larger than this is refused at compile time. llguidance builds its
# lexer lazily, so a huge count fails only mid-decode ("too many expressions constructed"); our own engine refuses
# it at compile time too (its DFA states). The JSON-schema regexes stay far below it (digit and string caps).
MAX_REPEAT = 10_000
_COUNTED_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def check_repeats(regex: str) -> None:
    for m in _COUNTED_REPEAT.finditer(regex):
        if max(int(m.group(1)), int(m.group(2) or 0)) > MAX_REPEAT:
            raise grammar_budget.GrammarTooComplex(
                f"grammar too complex: the repetition {m.group(0)} exceeds {MAX_REPEAT}")


def _parser_limits(budget: grammar_budget.GrammarBudget | None):
    import llguidance  # optional dependency: only reached once llguidance_available()

    b = budget or grammar_budget.GrammarBudget()
    return llguidance.LLParserLimits(initial_lexer_fuel=b.lexer_fuel, step_lexer_fuel=b.step_fuel,
                                     max_lexer_states=b.max_states, verbose_errors=False)


def _grammar_error(error: str, invalid_prefix: str) -> ValueError:
    """llguidance's error as ours: past a limit (fuel, states, size) ``GrammarTooComplex``, else invalid."""
    if "limit" in error or "fuel" in error or "too many" in error:
        return grammar_budget.GrammarTooComplex(f"grammar too complex: {error}")
    return ValueError(invalid_prefix + error)


def regex_to_lark_grammar(regex: str) -> str:
    """A Lark grammar whose one lexeme is ``regex`` (full match; ASCII ``\\d``/``\\w``/``\\s`` as in regex_fsm)."""
    import llguidance  # optional dependency: only reached once llguidance_available()

    return "start: /" + llguidance.regex_to_lark(_preprocess(regex), "dws") + "/"


class LLGuidanceCompiler:
    """Builds llguidance's tokenizer once per scheduler (~1 s) and compiles grammars against it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, mask_threads: int = 1, cpu_rows: bool = True,
                 native_masks: bool = True):
        if not llguidance_available():
            raise ValueError("ebnf grammars need the llguidance package (pip install llguidance==1.5.0)")
        import llguidance.hf  # optional dependency (the ebnf extra)

        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.primary_eos = int(eos) if eos is not None else min(self.eos_token_ids)
        self.vocab_size = int(vocab_size)
        self.mask_threads = max(1, int(mask_threads))  # threads computing its matchers' next masks (_MaskThreads)
        self.lanes = itertools.count()  # the next matcher's mask lane (modulo mask_threads)
        # Whether the mask threads also build each mask's CPU row and sparse ids (a CPU scheduler's fill_mask uses
        # them); a GPU scheduler applies packed bits (packed_masks) and skips that work, which holds the GIL.
        self.cpu_rows = cpu_rows
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                             eos_token=self.primary_eos)
        except ValueError as e:  # a slow (non-Rust) tokenizer
            raise ValueError(f"ebnf grammars need a fast tokenizer: {e}") from None
        # additive_mask(mask_bytes, device, dtype): shared by this compiler's grammars, read-only (lru_cache locks).
        self.additive_mask = functools.lru_cache(maxsize=MAX_CACHED_BIASES)(self._build_additive_mask)
        self.sparse_mask = functools.lru_cache(maxsize=MAX_CACHED_BIASES)(self._build_sparse_mask)
        eos_only = np.zeros(-(-self.vocab_size // 32) * 32, dtype=bool)
        eos_only[[e for e in self.eos_token_ids if 0 <= e < self.vocab_size]] = True
        self._eos_words = np.packbits(eos_only, bitorder="little")
        # None: no C kernel here (or the native CPU kernels are off), CPU rows are masked through numpy.
        self.mask_row = mask_row_kernel() if native_masks else None

    def compile(self, spec: str) -> "LLGuidanceGrammar":
        """An ``ebnf`` (GBNF or Lark) grammar."""
        import llguidance  # optional dependency (the ebnf extra)

        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("invalid ebnf grammar: expected a non-empty string")
        try:
            grammar = llguidance.grammar_from("ebnf", spec)
        except Exception as e:  # noqa: BLE001 - the GBNF converter raises plain Exceptions
            raise ValueError(f"invalid ebnf grammar: {e}") from None
        return self._validated("ebnf", spec, grammar, "invalid ebnf grammar: ")

    def compile_regex(self, kind: str, spec: str, regex: str) -> "LLGuidanceGrammar":
        """A ``regex`` or ``json_schema`` grammar from its regex (``spec`` is the request's own text)."""
        import llguidance  # optional dependency: only reached once llguidance_available()

        check_repeats(regex)
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(regex_to_lark_grammar(regex))
        except ValueError as e:  # _preprocess: a bad \\u escape
            raise ValueError(str(e)) from None
        compiled = self._validated(kind, spec, grammar, f"invalid regex {regex[:120]!r}: ")
        compiled.regex = regex
        start = compiled.matcher()
        allowed = start.allowed_mask()
        allowed[[e for e in self.eos_token_ids if 0 <= e < self.vocab_size]] = False
        if not start.is_accepting() and not allowed.any():  # llguidance takes it, with EOS as its only token
            raise ValueError(f"regex {regex[:120]!r} matches no string (its language is empty)")
        return compiled

    def _validated(self, kind: str, spec: str, grammar: str, prefix: str) -> "LLGuidanceGrammar":
        import llguidance  # optional dependency: only reached once llguidance_available()

        limits = _parser_limits(grammar_budget.current())
        is_err, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer,
                                                                                limits=limits)
        if is_err:
            error = messages[0].strip()
            if kind != "ebnf" and "regex parse error" in error:
                raise UnsupportedByLLGuidance(prefix + error)
            raise _grammar_error(error, prefix)
        return LLGuidanceGrammar(spec, grammar, self, kind, limits, prefix)

    def _build_additive_mask(self, key: bytes | None, device: str, dtype: torch.dtype) -> torch.Tensor:
        """The 0/-inf row for the mask ``key`` (``mask_key``'s; None: EOS only); ``additive_mask`` caches it."""
        # One gather through a byte -> 8 biases table (a fraction of unpacking bits and masked_fill).
        packed = torch.from_numpy(self._packed(key).astype(np.int64))
        row = _BYTE_TO_BIASES.index_select(0, packed).view(-1)[:self.vocab_size]
        return row.to(device=device, dtype=dtype)

    def _build_sparse_mask(self, key: bytes | None) -> tuple[bool, np.ndarray] | None:
        """(True, the allowed ids) where few tokens are allowed, (False, the forbidden ids) where few are forbidden,
        else None; ``sparse_mask`` caches it."""
        allowed = self.allowed(key).numpy()
        n_allowed = int(np.count_nonzero(allowed))
        if n_allowed <= SPARSE_MAX_ALLOWED:
            return True, np.flatnonzero(allowed)
        if self.vocab_size - n_allowed <= SPARSE_MAX_DISALLOWED:
            return False, np.flatnonzero(~allowed)
        return None

    def step_mask(self, key: bytes | None) -> "_StepMask":
        bits = self._packed(key).tobytes() if key is None else key
        if len(bits) * 8 < self.vocab_size:  # the kernel reads a bit per token
            bits += bytes(-(-self.vocab_size // 8) - len(bits))
        if self.mask_row is not None or not self.cpu_rows:  # the kernel (or a GPU's packed path) needs only bits
            return _StepMask(key, bits)
        return _StepMask(key, bits, self.additive_mask(key, "cpu", torch.float32), self.sparse_mask(key))

    @functools.cached_property
    def eos_step(self) -> "_StepMask":
        """The mask of a stopped matcher: EOS ids only (llguidance's mask there allows its one EOS id)."""
        return self.step_mask(None)

    def allowed(self, key: bytes | None) -> torch.Tensor:
        """Boolean [vocab_size] from the mask ``key`` (``mask_key``'s; None: EOS only)."""
        return torch.from_numpy(np.unpackbits(self._packed(key), bitorder="little", count=self.vocab_size).astype(bool))

    def mask_key(self, mask_bytes: bytes | None) -> bytes | None:
        """llguidance's packed mask (little-endian bits) with every EOS id allowed where the grammar may end
        (llguidance knows one EOS id; the model may have several); None stays None (EOS only)."""
        if mask_bytes is None or self.eos_token_ids == {self.primary_eos}:
            return mask_bytes
        if not mask_bytes[self.primary_eos >> 3] >> (self.primary_eos & 7) & 1:
            return mask_bytes
        words = np.frombuffer(mask_bytes, dtype=np.uint8)
        if len(words) != len(self._eos_words):  # llguidance's masks carry a spare 32-bit word
            padded = np.zeros(len(words), dtype=np.uint8)
            n = min(len(words), len(self._eos_words))
            padded[:n] = self._eos_words[:n]
            self._eos_words = padded
        return (words | self._eos_words).tobytes()

    def _packed(self, key: bytes | None) -> np.ndarray:
        return self._eos_words if key is None else np.frombuffer(key, dtype=np.uint8)


_NEG_INF = np.float32("-inf")
# _BYTE_TO_BIASES[b] = the 8 additive biases (0 allowed / -inf not) of the 8 tokens whose bits byte b packs.
_BYTE_TO_BIASES = torch.from_numpy(
    np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
             np.float32(0), np.float32("-inf")).astype(np.float32))


class LLGuidanceGrammar:
    """A validated grammar (read-only, shareable); ``matcher()`` starts a parse per request.

    Matchers are copies of a prototype: a copy costs ~10 us where building a matcher costs milliseconds, and
    the copies share the prototype's lazily built lexer states, so later requests find them built. That sharing
    is behind a lock: two copies of one prototype computing masks at once take turns (64 copies on 2 threads
    took as long as on 1). So there is one prototype per mask lane (``_MaskThreads``), built when the lane is
    first used, and a matcher's masks are computed only on its own lane's thread."""

    def __init__(self, spec: str, grammar: str, compiler: LLGuidanceCompiler, kind: str = "ebnf", limits=None,
                 error_prefix: str = "invalid ebnf grammar: "):
        import llguidance  # optional dependency: only reached once llguidance_available()

        self.kind = kind
        self.spec = spec
        self.regex: str | None = None
        self.grammar = grammar
        self.compiler = compiler
        self.limits = limits
        self.vocab_size = compiler.vocab_size
        self.eos_token_ids = compiler.eos_token_ids
        self.prefetch = True  # matchers compute each next mask on the mask thread (LLGuidanceMatcher)
        prototype = self._new_prototype()
        if prototype.is_error():  # e.g. the lexer fuel ran out: before decoding, a clear error
            raise _grammar_error(prototype.get_error(), error_prefix)
        self._prototypes = [prototype] + [None] * (compiler.mask_threads - 1)  # one per mask lane, built on use
        self._lock = threading.Lock()

    def _new_prototype(self):
        import llguidance  # optional dependency: only reached once llguidance_available()

        return llguidance.LLMatcher(self.compiler.ll_tokenizer, self.grammar, log_level=0, limits=self.limits)

    def matcher(self) -> "LLGuidanceMatcher":
        lane = next(self.compiler.lanes) % len(self._prototypes)  # round robin over the lanes, across grammars
        with self._lock:
            prototype = self._prototypes[lane]
            if prototype is None:
                prototype = self._prototypes[lane] = self._new_prototype()
            return LLGuidanceMatcher(self, prototype.deep_copy(), lane)


class _StepMask:
    """One step's mask, computed on the mask thread: llguidance's packed words as bytes (``key``: every EOS id
    added where the grammar may end; None: EOS only), the bits the C kernel reads (``key``'s, or the EOS ids' where
    ``key`` is None), and without the kernel their 0/-inf row on the CPU in float32 and, where few tokens are
    allowed or forbidden, those ids (``LLGuidanceCompiler.sparse_mask``; all shared, read-only)."""

    __slots__ = ("key", "bits", "bias", "sparse", "_bias_np")

    def __init__(self, key: bytes | None, bits: bytes, bias: torch.Tensor | None = None,
                 sparse: tuple[bool, np.ndarray] | None = None):
        self.key = key
        self.bits = bits
        self.bias = bias  # None: not built (the kernel, or ``LLGuidanceCompiler.cpu_rows``): see fill_mask
        self.sparse = sparse
        self._bias_np = None if bias is None else bias.numpy()

    def apply(self, row: np.ndarray) -> None:
        """Masks a CPU row as wide as the vocabulary in place through numpy (no torch dispatch: the mask is on the
        scheduler's critical path), touching only the few allowed ids after one fill, or the few forbidden ones,
        or adding the dense 0/-inf row."""
        sparse = self.sparse
        if sparse is None:
            np.add(row, self._bias_np, out=row)
        elif sparse[0]:
            ids = sparse[1]
            kept = row.take(ids)
            row.fill(_NEG_INF)
            row[ids] = kept
        else:
            row[sparse[1]] = _NEG_INF


class _MaskThreads:
    """Daemon threads computing matchers' next masks, one thread and one queue per lane, in submission order; the
    lanes compute a batch's masks in parallel (llguidance drops the GIL; each matcher is touched by one thread at
    a time) and a matcher always goes to its own lane's thread, so copies of one prototype never wait for each
    other's lexer (``LLGuidanceGrammar``). A matcher's ``_busy`` lock is held from ``submit`` until its mask (or
    the error computing it) is in ``_next``: waiting is acquiring it (a plain lock and a C queue: a few
    microseconds on the submitting side, where an executor's futures cost ~20)."""

    def __init__(self, threads: int = 1):
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads)]
        for i, lane in enumerate(self._queues):
            threading.Thread(target=self._run, args=(lane,), name=f"llguidance-mask-{i}", daemon=True).start()

    def submit(self, matcher: "LLGuidanceMatcher") -> None:
        matcher._busy.acquire()
        self._queues[matcher.lane % len(self._queues)].put(matcher)

    @staticmethod
    def _run(lane: queue.SimpleQueue) -> None:
        while True:
            matcher = lane.get()
            try:
                matcher._next = matcher._compute_step_mask()
            except BaseException as e:  # noqa: BLE001 - handed to fill_mask, which raises it in the scheduler
                matcher._next = e
            finally:
                matcher._busy.release()


@functools.lru_cache(maxsize=4)
def _mask_threads(threads: int) -> _MaskThreads:
    """The process's mask threads, one set per thread count (one per compiler setting; normally one)."""
    return _MaskThreads(threads)


os.register_at_fork(after_in_child=_mask_threads.cache_clear)  # a forked child starts its own threads when needed


class LLGuidanceMatcher:
    """Per-request parse state (not thread-safe; ``copy()`` for forks).

    Each state change (``advance``, ``advance_text``) reads the cheap answers at once (stopped, accepting, the
    forced bytes) and starts the next mask on a background thread (llguidance drops the GIL while it walks the
    token trie; the 0/-inf row is built or found there too), so it overlaps the model's forward pass, as upstream
    SGLang overlaps its grammar masks with the GPU. ``fill_mask`` takes that mask (waiting only if the forward
    was shorter than the mask) and adds its row: one vectorised add on the scheduler's critical path.
    A stopped matcher needs no computation: only EOS may follow (``LLGuidanceCompiler.eos_step``).
    The llguidance matcher is touched by one thread at a time: everything that reads it waits for the pending
    mask first. ``grammar.prefetch = False`` computes the mask inside ``fill_mask`` instead."""

    __slots__ = ("grammar", "matcher", "lane", "terminated", "num_tokens", "_busy", "_next", "_stopped", "_accepting",
                 "_ff", "_row_shape", "_mask_row")

    def __init__(self, grammar: LLGuidanceGrammar, matcher, lane: int = 0):
        self.grammar = grammar
        self.matcher = matcher
        self.lane = lane  # its mask thread (a copy of that lane's prototype: LLGuidanceGrammar)
        self.terminated = False
        self.num_tokens = 0
        self._busy = threading.Lock()  # held while the mask thread computes this matcher's next mask
        self._next: _StepMask | BaseException | None = None  # that mask (None: compute it when asked)
        self._row_shape = (grammar.vocab_size,)  # a logits row fill_mask masks through numpy
        self._mask_row = grammar.compiler.mask_row  # the C kernel, or None
        self._state_changed()

    # -- masks -------------------------------------------------------------------------------------
    def _state_changed(self) -> None:
        """After a transition: the cheap queries now, the next mask started on the mask thread."""
        m = self.matcher
        self._stopped = self.terminated or m.is_stopped()
        self._accepting = self.terminated or m.is_accepting()
        self._ff = b"" if self._stopped else m.compute_ff_bytes()
        self._next = None
        if self._stopped:  # only EOS may follow (unless the parse failed): the mask every grammar shares
            if self.terminated or not m.is_error():
                self._next = self.grammar.compiler.eos_step
        elif self.grammar.prefetch:
            _mask_threads(self.grammar.compiler.mask_threads).submit(self)

    def _sync(self) -> None:
        """Wait for the mask being computed (its error, if any, is kept for ``fill_mask``)."""
        with self._busy:
            pass

    def _compute_step_mask(self) -> _StepMask:
        compiler = self.grammar.compiler
        return compiler.step_mask(compiler.mask_key(self._mask_bytes()))

    def _step_mask(self) -> _StepMask:
        self._sync()
        step = self._next
        if step is None:
            step = self._next = self._compute_step_mask()
        elif isinstance(step, BaseException):
            raise step
        return step

    def _mask_bytes(self) -> bytes | None:
        """llguidance's packed mask for this step (None once only EOS may follow: terminated, or a failed matcher,
        e.g. an empty language). A matcher past a budget (a step's fuel, a lexer limit) raises
        ``GrammarTooComplex``, which ends the request with a 400."""
        if self.terminated:
            return None
        if not self.matcher.is_error():
            mask = self.matcher.compute_bitmask()
            if not self.matcher.is_error():
                return mask
        error = _grammar_error(self.matcher.get_error(), "")
        if isinstance(error, grammar_budget.GrammarTooComplex):
            raise error
        return None

    def packed_mask(self) -> np.ndarray:
        """This step's mask as packed bits (uint8, little-endian bit order; EOS ids added where the grammar may
        end): what ``packed_masks.apply_packed_masks`` applies to a batch of rows on an accelerator."""
        return np.frombuffer(self._step_mask().bits, dtype=np.uint8)

    def allowed_mask(self, device=None) -> torch.Tensor:
        """Boolean [vocab_size]: True where the token is allowed."""
        out = self.grammar.compiler.allowed(self._step_mask().key)
        return out if device is None else out.to(device)

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place (extra columns past the vocab too)."""
        # The scheduler's CPU row: one C call, with as few questions as possible (each costs ~1 us on the cold
        # cache a forward pass leaves). _next is a _StepMask only once complete, so one there needs no wait on _busy.
        step = self._next
        if step.__class__ is not _StepMask:  # not computed yet (None), or the error computing it (raised here)
            step = self._step_mask()
        mask_row = self._mask_row
        if mask_row is not None and logits_row.dtype is torch.float32 and logits_row.is_cpu \
                and logits_row.stride() == (1,):  # one contiguous row
            mask_row(logits_row.data_ptr(), logits_row.shape[0], step.bits, self._row_shape[0])
            return
        if logits_row.is_cpu and step.bias is not None:  # no kernel: through numpy
            try:
                row = logits_row.numpy()
            except (TypeError, RuntimeError):  # a dtype numpy lacks (bf16), or a row that requires grad: below
                row = None
            if row is not None and row.shape == self._row_shape:
                step.apply(row)
                return
        step = self._step_mask()
        bias = self.grammar.compiler.additive_mask(step.key, str(logits_row.device), logits_row.dtype)
        v = bias.shape[0]
        width = logits_row.shape[-1]
        if width == v:  # no slicing on the common path (two views cost more than the add)
            logits_row.add_(bias)
            return
        if width > v:
            logits_row[..., v:] = float("-inf")
        n = min(width, v)
        logits_row[..., :n].add_(bias[:n])

    def allowed_token_ids(self) -> list[int]:
        return torch.nonzero(self.allowed_mask()).flatten().tolist()

    def is_allowed(self, token_id: int) -> bool:
        return bool(self.allowed_mask()[int(token_id)])

    # -- transitions -------------------------------------------------------------------------------
    def advance(self, token_id: int) -> None:
        """Consume a sampled token. Raises ``ValueError`` if the grammar does not allow it."""
        token_id = int(token_id)
        if self.terminated:
            raise ValueError(f"grammar already terminated; got token {token_id}")
        if token_id in self.grammar.eos_token_ids:
            if not self._accepting:
                raise ValueError(f"EOS token {token_id} before the grammar is complete")
            self._sync()
            self.terminated = True
            self.num_tokens += 1
            self._state_changed()
            return
        self._sync()
        ok = self.matcher.consume_token(token_id)
        self._state_changed()
        if not ok:  # past a budget: GrammarTooComplex (a 400), else a ValueError
            raise _grammar_error(self.matcher.get_error(), f"token {token_id} is not allowed by the grammar: ")
        self.num_tokens += 1

    def advance_text(self, text: str | bytes) -> None:
        """Consume text appended by jump-forward. llguidance parses bytes, so any tokenization of the text
        reaches the same parse state; the tokenizer's own is used."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not data:
            return
        if self.terminated:
            raise ValueError("grammar already terminated")
        ids = self.grammar.compiler.ll_tokenizer.tokenize_bytes(data)
        self._sync()
        ok = self.matcher.consume_tokens(ids)
        self._state_changed()
        if not ok:
            raise ValueError(f"text {data[:60]!r} is not allowed by the grammar: {self.matcher.get_error()}")

    # -- queries -----------------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        return self._accepting

    def is_finished(self) -> bool:
        """Terminated by EOS, or nothing but EOS can follow (complete, or the parse failed)."""
        return self._stopped

    def forced_string(self) -> str:
        """Jump-forward text: the bytes every continuation starts with, cut to whole characters."""
        return _whole_chars(self._ff)

    def copy(self) -> "LLGuidanceMatcher":
        """A fork in the same state; it shares this step's mask (read-only)."""
        self._sync()
        m = LLGuidanceMatcher.__new__(LLGuidanceMatcher)
        m.grammar, m.matcher, m.lane, m._busy = self.grammar, self.matcher.deep_copy(), self.lane, threading.Lock()
        m.terminated, m.num_tokens, m._row_shape = self.terminated, self.num_tokens, self._row_shape
        m._mask_row = self._mask_row
        m._next, m._stopped, m._accepting, m._ff = self._next, self._stopped, self._accepting, self._ff
        return m

    def __repr__(self) -> str:
        return f"LLGuidanceMatcher(accepting={self.is_accepting()}, terminated={self.terminated})"
