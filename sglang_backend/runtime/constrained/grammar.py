"""The per-request interface the scheduler uses: ``GrammarCache`` -> ``CompiledGrammar`` -> ``GrammarMatcher``.

Lifecycle
---------
One :class:`GrammarCache` per scheduler (per tokenizer). ``compile(kind, spec)`` turns a regex, a JSON
schema (through its regex, ``json_schema``) or an ``ebnf`` (GBNF / Lark) grammar into a compiled grammar
with one matcher interface, on one of two engines (``backend``):

* ``"llguidance"`` (the default, ``"auto"``, when the package is installed): an
  ``llguidance_backend.LLGuidanceGrammar``, compiled in milliseconds with lazily computed masks
  (``benchmarks/bench_grammar.py`` measures both engines side by side);
* ``"fsm"``, our own: a :class:`CompiledGrammar` (byte DFA + token index + compressed-FSM analysis), used for
  regexes llguidance cannot parse (look-arounds), without llguidance, or for a tokenizer it cannot load.

Either way compile raises
``ValueError`` *before decoding* for invalid, unsatisfiable, too complex or tokenizer-unrealisable
grammars. Results (and failures) are cached in memory (LRU); indexes also on disk. ``submit`` does the
same on a worker thread and returns a ``Future`` so a new grammar never stalls the decode loop: park the
request until ``future.done()`` (upstream SGLang's grammar queue, field guide §4.4).

Each request gets a :class:`GrammarMatcher` (``compiled.matcher()``, cheap): per step,
``fill_mask(logits_row)`` before sampling, ``advance(token_id)`` after; ``is_finished()`` ends the
request; ``forced_string()`` + :func:`retokenize_jump_forward` + ``advance_text`` implement
jump-forward (paper §4, Appendix B.2).

EOS
---
EOS ids (given to the cache) are allowed exactly in accepting states and are the only other token a
mask ever lets through besides the grammar's own tokens; special tokens are never allowed. When a state
is accepting and nothing can follow, the mask allows only EOS and ``is_finished()`` is true - the
scheduler should finish the request there without sampling (sampling would pick EOS anyway). After
``advance(eos_id)`` the matcher is terminated: ``is_finished()``; ``fill_mask`` allows only EOS.

Jump-forward (Appendix B.2)
---------------------------
``forced_string()`` is the text the grammar forces next (the label of the compressed edge leaving the
current state, whole characters only). The scheduler appends it without running the model token by
token, but the tokens must be those the real tokenizer would produce for the whole text - the last
generated token may fuse with the forced text (``Ġ`` + ``"name"`` is ``Ġ"``, ``name``, ``"``), and a
multi-byte character may straddle the boundary. :func:`retokenize_jump_forward` re-encodes the tail of
the output together with the forced text and returns how many trailing output tokens to drop and which
tokens to append; the scheduler then prefills the new tokens against the cached prefix.
``matcher.advance_text(forced)`` moves the matcher (its state depends only on the bytes, not on how they
were tokenized). :func:`apply_jump_forward` does all three steps.

Probability distortion (Appendix B.3): forced text is inserted regardless of how the model would have
tokenized it, and a regex alternation's branch is chosen by the first token; put the options in the
prompt where that matters. ``jump_forward=False`` at the scheduler is the ablation.

Thread-safety
-------------
``GrammarCache`` and ``CompiledGrammar`` are thread-safe (locks around caches; compiled data is
read-only). A ``GrammarMatcher`` is per request and not thread-safe; ``copy()`` it for forks.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ...utils import release_freed_memory
from . import budget as grammar_budget
from .compressed_fsm import CompressedFSM
from .json_schema import build_regex_from_schema, schema_from_pydantic
from .llguidance_backend import LLGuidanceCompiler, UnsupportedByLLGuidance, llguidance_available
from .mask_row import kernel as mask_row_kernel
from .regex_fsm import ByteDFA
from .token_index import TokenIndex, TokenIndexCache, TokenVocabulary, get_vocabulary

__all__ = [
    "GrammarCache",
    "CompiledGrammar",
    "GrammarMatcher",
    "fill_masks",
    "retokenize_jump_forward",
    "apply_jump_forward",
]

LONG_COMPILE_S = 0.5  # compiles longer than this return their freed memory to the OS (malloc_trim)
_KINDS = {"regex": "regex", "json_schema": "json_schema", "json": "json_schema", "ebnf": "ebnf", "lark": "ebnf"}


class CompiledGrammar:
    """A grammar compiled for one tokenizer: shared, read-only, thread-safe."""

    def __init__(self, kind: str, spec: str, regex: str, dfa: ByteDFA, index: TokenIndex,
                 vocab: TokenVocabulary, eos_token_ids: set[int], max_cached_masks: int = 512,
                 native_masks: bool = True):
        self.kind = kind
        self.spec = spec
        self.regex = regex
        self.dfa = dfa
        self.index = index
        self.vocab = vocab
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.vocab_size = index.vocab_size
        self.compressed = CompressedFSM(dfa)
        self._all_token_live = bool(index.token_live.all())
        self._masks: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()
        self._mask_lock = threading.Lock()
        self._max_cached_masks = max_cached_masks
        eos = torch.ones(self.vocab_size, dtype=torch.bool)
        for e in self.eos_token_ids:
            if 0 <= e < self.vocab_size:
                eos[e] = False
        self._eos_only = eos  # disallowed mask after termination
        # The C kernel for CPU float32 rows (None: the cached 0/-inf rows; off with the native CPU kernels).
        self.mask_row = mask_row_kernel() if native_masks else None
        self._bits: dict[int, bytes] = {}  # mask class (-1: EOS only) -> its allowed bits, little-endian

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self)

    @property
    def num_states(self) -> int:
        return self.dfa.num_states

    def disallowed_mask(self, state: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Boolean [vocab_size] tensor, True where a token is NOT allowed in ``state`` (cached per class
        and device; state -1 = terminated, EOS only). Shared: treat as read-only."""
        return self._cached_mask(state, device, None)

    def additive_mask(self, state: int, device: torch.device | str | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[vocab_size] tensor of 0 (allowed) / -inf (disallowed) for ``logits.add_(...)``. Shared,
        read-only. (On the CPU adding a cached bias is ~6x faster than ``masked_fill_`` with a bool mask:
        5.7 us vs 31-41 us for 49k logits, one thread, bench.py on an idle 16-core host.)"""
        return self._cached_mask(state, device, dtype)

    def mask_bits(self, state: int) -> bytes:
        """The allowed tokens of ``state`` (-1: terminated, EOS only) as bits, little-endian, for the C kernel
        (``mask_row``); cached per mask class."""
        cls = -1 if state < 0 else int(self.index.state_class[state])
        bits = self._bits.get(cls)
        if bits is None:
            allowed = (~self._eos_only.numpy() if cls < 0
                       else np.unpackbits(self.index.masks[cls], count=self.vocab_size).astype(bool))
            bits = self._bits[cls] = np.packbits(allowed, bitorder="little").tobytes()
        return bits

    def _cached_mask(self, state: int, device, dtype) -> torch.Tensor:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        cls = -1 if state < 0 else int(self.index.state_class[state])
        key = (cls, str(dev), dtype)
        with self._mask_lock:
            m = self._masks.get(key)
            if m is not None:
                self._masks.move_to_end(key)
                return m
        if cls < 0:
            bad = self._eos_only
        else:
            bits = np.unpackbits(self.index.masks[cls], count=self.vocab_size)
            bad = torch.from_numpy(bits == 0)
        if dtype is None:
            m = bad
        else:
            m = torch.zeros(self.vocab_size, dtype=dtype).masked_fill_(bad, float("-inf"))
        if dev.type != "cpu":
            m = m.to(dev)
        with self._mask_lock:
            self._masks[key] = m
            while len(self._masks) > self._max_cached_masks:
                self._masks.popitem(last=False)
        return m

    def forced_text(self, state: int) -> str:
        text = self.compressed.forced_text(state)
        if not text or self._all_token_live:
            return text
        # Only stop where the tokenizer can go on (tokenizers without every single byte as a token).
        best, s, done = "", state, 0
        data = text.encode("utf-8")
        for i, ch in enumerate(text):
            b = ch.encode("utf-8")
            s = self.dfa.walk(s, b)
            done += len(b)
            if s >= 0 and self.index.token_live[s]:
                best = data[:done].decode("utf-8")
        return best


class GrammarMatcher:
    """Per-request matcher state over a :class:`CompiledGrammar`."""

    __slots__ = ("grammar", "state", "terminated", "num_tokens")

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self.state = grammar.dfa.initial
        self.terminated = False
        self.num_tokens = 0

    # -- masks -------------------------------------------------------------------------------------
    def allowed_mask(self, device=None) -> torch.Tensor:
        """Boolean [vocab_size]: True where the token is allowed (a new tensor)."""
        return ~self.grammar.disallowed_mask(-1 if self.terminated else self.state, device)

    def disallowed_mask(self, device=None) -> torch.Tensor:
        """Cached boolean [vocab_size]: True where the token is NOT allowed (shared, read-only)."""
        return self.grammar.disallowed_mask(-1 if self.terminated else self.state, device)

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place (one vectorised add of a cached
        0/-inf row for this state's mask class). A row wider than the grammar's vocab_size gets the
        extra columns masked too. A CPU float32 row: one C call (``mask_row``) on the state's cached bits."""
        state = -1 if self.terminated else self.state
        mask_row = self.grammar.mask_row
        if mask_row is not None and logits_row.dtype is torch.float32 and logits_row.is_cpu \
                and logits_row.stride() == (1,):  # one contiguous row
            g = self.grammar
            mask_row(logits_row.data_ptr(), logits_row.shape[0], g.mask_bits(state), g.vocab_size)
            return
        bias = self.grammar.additive_mask(state, logits_row.device, logits_row.dtype)
        width = logits_row.shape[-1]
        v = bias.shape[0]
        if width == v:
            logits_row.add_(bias)
        elif width > v:
            logits_row[..., :v].add_(bias)
            logits_row[..., v:] = float("-inf")
        else:
            logits_row.add_(bias[:width])

    def allowed_token_ids(self) -> list[int]:
        if self.terminated:
            return sorted(self.grammar.eos_token_ids)
        return self.grammar.index.allowed_token_ids(self.state).tolist()

    def is_allowed(self, token_id: int) -> bool:
        if self.terminated:
            return token_id in self.grammar.eos_token_ids
        return self.grammar.index.is_allowed(self.state, token_id)

    # -- transitions -------------------------------------------------------------------------------
    def advance(self, token_id: int) -> None:
        """Consume a sampled token. Raises ``ValueError`` if the grammar does not allow it."""
        token_id = int(token_id)
        g = self.grammar
        if self.terminated:
            raise ValueError(f"grammar already terminated; got token {token_id}")
        if not g.index.is_allowed(self.state, token_id):
            raise ValueError(f"token {token_id} ({g.vocab.token_bytes[token_id] if token_id < g.vocab.size else None!r}) "
                             f"is not allowed by the grammar in state {self.state}")
        self.num_tokens += 1
        if token_id in g.eos_token_ids:
            self.terminated = True
            return
        row = g.dfa.row
        s = self.state
        for b in g.vocab.token_bytes[token_id]:
            s = row(s)[b]
        self.state = s

    def advance_text(self, text: str | bytes) -> None:
        """Consume text appended by jump-forward (by its UTF-8 bytes). Raises ``ValueError`` if the
        grammar does not allow it."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if self.terminated:
            if data:
                raise ValueError("grammar already terminated")
            return
        s = self.grammar.dfa.walk(self.state, data)
        if s < 0:
            raise ValueError(f"text {data[:60]!r} is not allowed by the grammar in state {self.state}")
        self.state = s

    # -- queries -----------------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        return self.terminated or bool(self.grammar.dfa.accepting[self.state])

    def is_finished(self) -> bool:
        """Terminated by EOS, or accepting with no possible continuation."""
        if self.terminated:
            return True
        g = self.grammar
        return bool(g.dfa.accepting[self.state]) and g.index.class_num_tokens[g.index.state_class[self.state]] == 0

    def forced_string(self) -> str:
        """Jump-forward text from the current state ('' if there is a choice, the state is accepting,
        or the last token ended inside a multi-byte character)."""
        if self.terminated:
            return ""
        return self.grammar.forced_text(self.state)

    def forced_bytes(self) -> bytes:
        return b"" if self.terminated else self.grammar.compressed.forced_bytes(self.state)

    def shortest_completion(self) -> bytes:
        """Shortest byte string that completes a match from here (e.g. to close an output cut by
        max_new_tokens). Bytes, because the state may sit inside a multi-byte character."""
        if self.terminated:
            return b""
        return self.grammar.dfa.shortest_completion(self.state)

    def copy(self) -> "GrammarMatcher":
        m = GrammarMatcher.__new__(GrammarMatcher)
        m.grammar = self.grammar
        m.state = self.state
        m.terminated = self.terminated
        m.num_tokens = self.num_tokens
        return m

    def __repr__(self) -> str:
        return (f"GrammarMatcher(state={self.state}, accepting={self.is_accepting()}, "
                f"terminated={self.terminated})")


def fill_masks(logits: torch.Tensor, matchers, stacked: bool | None = None) -> None:
    """Apply each row's matcher to a [batch, vocab] logits tensor in place (``None`` = unconstrained).

    On an accelerator the rows' cached biases are stacked and added in one op (H200, 32 rows x 49k:
    45 us, vs ~6 us of launch per row); on the CPU rows are done one by one (stacking copies 6 MB: 640 us
    vs 32 x 5.7 us). ``stacked`` forces either way."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    width = logits.shape[-1]
    if stacked is None:
        stacked = logits.device.type != "cpu"
    if not stacked or any(not isinstance(matchers[i], GrammarMatcher) or matchers[i].grammar.vocab_size != width
                          for i in rows):
        for i in rows:
            matchers[i].fill_mask(logits[i])
        return
    biases = torch.stack([matchers[i].grammar.additive_mask(-1 if matchers[i].terminated else matchers[i].state,
                                                            logits.device, logits.dtype) for i in rows])
    if len(rows) == logits.shape[0]:
        logits.add_(biases)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), biases)


# --------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------


def _normalise_spec(kind: str, spec: Any) -> tuple[str, str]:
    k = _KINDS.get(kind)
    if k is None:
        raise ValueError(f"unknown grammar kind {kind!r}; expected 'regex', 'json_schema' or 'ebnf'")
    if k in ("regex", "ebnf"):
        if not isinstance(spec, str):
            raise ValueError(f"invalid {k} {spec!r}: expected a string")
        return k, spec
    if isinstance(spec, (dict, bool)):
        return k, json.dumps(spec, ensure_ascii=False)
    if isinstance(spec, type) or hasattr(spec, "model_json_schema"):
        return k, json.dumps(schema_from_pydantic(spec), ensure_ascii=False)
    if isinstance(spec, bytes):
        spec = spec.decode("utf-8", errors="replace")
    if not isinstance(spec, str):
        raise ValueError(f"invalid schema: expected a JSON string or object, got {type(spec).__name__}")
    return k, spec


def cache_options(server_args) -> dict:
    """GrammarCache's keyword arguments from the server's grammar knobs (``ServerArgs.grammar_*``), so the
    frontend's cache and the scheduler's compile alike."""
    sa = server_args
    return dict(timeout_s=sa.grammar_compile_timeout, max_regex_chars=sa.grammar_max_regex_chars,
                backend=sa.grammar_backend, max_states=sa.grammar_max_states, lexer_fuel=sa.grammar_lexer_fuel,
                step_fuel=sa.grammar_step_fuel, mask_threads=sa.grammar_mask_threads or default_mask_threads(sa.device),
                cpu_rows=on_cpu(sa.device), native_masks=not sa.disable_native_cpu_kernels)


def default_mask_threads(device: str) -> int:
    """llguidance mask threads: 1 on the CPU (the forward wants every core); on a GPU half the cores, at most 8,
    computing a batch's masks while the forward runs, one lane each (llguidance_backend._MaskThreads). On an H200
    host (16 cores), the peer benchmark's JSON decoding (64 requests, Llama-3-8B) took 1.23-1.36 s with 8 lanes,
    1.23-1.24 with 12 and 1.23 with 16, against 1.59-1.64 s with 8 threads sharing one matcher prototype."""
    return 1 if on_cpu(device) else max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def on_cpu(device: str) -> bool:
    """Whether a scheduler of ``ServerArgs.device`` decodes on the CPU."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


class GrammarCache:
    """Compiles and caches grammars for one tokenizer (one per scheduler). Thread-safe.

    ``backend``: "auto" (llguidance when installed and it loads the tokenizer, else ours), "llguidance" or
    "fsm" (module docstring). The budget knobs (``budget.GrammarBudget``) are deterministic; ``timeout_s``
    is an opt-in wall-clock safety net, off (None) by default."""

    def __init__(self, tokenizer, vocab_size: int | None = None, eos_token_ids=None, *,
                 whitespace: str = "default", cache_dir: str | None = None, disk_cache: bool = True,
                 max_memory_entries: int = 128, max_workers: int = 1, regex_options: dict | None = None,
                 timeout_s: float | None = grammar_budget.DEFAULT_TIMEOUT_S,
                 max_regex_chars: int = grammar_budget.DEFAULT_MAX_REGEX_CHARS, backend: str = "auto",
                 max_states: int = grammar_budget.DEFAULT_MAX_STATES,
                 lexer_fuel: int = grammar_budget.DEFAULT_LEXER_FUEL,
                 step_fuel: int = grammar_budget.DEFAULT_STEP_FUEL, mask_threads: int = 1, cpu_rows: bool = True,
                 native_masks: bool = True):
        if backend not in ("auto", "llguidance", "fsm"):
            raise ValueError(f"unknown grammar backend {backend!r}; expected 'auto', 'llguidance' or 'fsm'")
        if backend == "llguidance" and not llguidance_available():
            raise ValueError("grammar backend 'llguidance' needs the llguidance package (pip install llguidance==1.5.0)")
        self.tokenizer = tokenizer
        self.backend = backend
        self.timeout_s = timeout_s
        self.max_regex_chars = max_regex_chars
        self.max_states, self.lexer_fuel, self.step_fuel = max_states, lexer_fuel, step_fuel
        self.vocab: TokenVocabulary = get_vocabulary(tokenizer)
        self.vocab_size = int(vocab_size if vocab_size is not None else self.vocab.size)
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = set() if eos is None else {eos}
        self.eos_token_ids = {int(e) for e in eos_token_ids}
        self.whitespace = whitespace
        self.index_cache = TokenIndexCache(self.vocab, self.vocab_size, self.eos_token_ids, cache_dir=cache_dir,
                                           disk_cache=disk_cache, max_memory_entries=max_memory_entries,
                                           max_workers=1, regex_options=regex_options)
        self._lru: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._max_entries = max_memory_entries
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._pending: dict[tuple[str, str], Future] = {}
        self.mask_threads = mask_threads  # llguidance matchers' mask threads (``default_mask_threads``)
        self.cpu_rows = cpu_rows  # whether llguidance's masks come with CPU rows (a CPU scheduler's fill_mask)
        self.native_masks = native_masks  # CPU rows masked by the C kernel (mask_row) where it builds
        self._llguidance = None  # llguidance_backend's compiler, built on first use (~1 s: its tokenizer)
        self._llguidance_failed: str | None = None  # why "auto" could not load it (then: our engine)

    def _llguidance_compiler(self, required: bool) -> LLGuidanceCompiler | None:
        """The llguidance compiler, or None where we compile on our own engine (``required``: ebnf grammars,
        which only llguidance parses)."""
        if self.backend == "fsm" and not required:
            return None
        with self._lock:
            if self._llguidance is None and self._llguidance_failed is None:
                try:
                    self._llguidance = LLGuidanceCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                          mask_threads=self.mask_threads, cpu_rows=self.cpu_rows,
                                                          native_masks=self.native_masks)
                except Exception as e:  # noqa: BLE001 - no package, or a tokenizer llguidance cannot load
                    self._llguidance_failed = str(e) or type(e).__name__
        if self._llguidance is None and (required or self.backend == "llguidance"):
            raise ValueError(self._llguidance_failed)
        return self._llguidance

    def _compile_uncached(self, kind: str, spec: str):
        if kind == "ebnf":
            return self._llguidance_compiler(required=True).compile(spec)
        compiler = self._llguidance_compiler(required=False)
        if compiler is not None:
            regex = spec if kind == "regex" else build_regex_from_schema(spec, self.whitespace)
            try:
                return compiler.compile_regex(kind, spec, regex)
            except UnsupportedByLLGuidance:
                pass  # syntax only our engine parses (look-arounds): compile it there
        # Our DFA engine: strings without maxLength stay uncapped (json_schema's docstring: the cap's DFA states).
        regex = spec if kind == "regex" else build_regex_from_schema(spec, self.whitespace, max_string_length=None)
        dfa, index = self.index_cache.get(regex)
        return CompiledGrammar(kind, spec, regex, dfa, index, self.vocab, self.eos_token_ids,
                               native_masks=self.native_masks)

    @property
    def stats(self) -> dict:
        return dict(self.index_cache.stats)

    def to_regex(self, kind: str, spec: Any) -> str:
        k, s = _normalise_spec(kind, spec)
        if k == "ebnf":
            raise ValueError("an ebnf grammar is context-free: it has no regex form")
        return s if k == "regex" else build_regex_from_schema(s, self.whitespace)

    def _cached(self, key):
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
            return hit

    def budget(self, cancel: threading.Event | None = None) -> grammar_budget.GrammarBudget:
        """A fresh compile budget with this cache's limits; ``cancel`` stops the work when set."""
        return grammar_budget.GrammarBudget(self.timeout_s, self.max_regex_chars, cancel, max_states=self.max_states,
                                            lexer_fuel=self.lexer_fuel, step_fuel=self.step_fuel)

    def compile(self, kind: str, spec: Any, cancel: threading.Event | None = None) -> CompiledGrammar:
        """Compile (or fetch) a grammar within one budget for the whole path (``budget.py``). Raises
        ``ValueError`` for bad grammars (``GrammarTooComplex`` past the budget, ``CompileCancelled`` once
        ``cancel`` is set)."""
        key = _normalise_spec(kind, spec)
        hit = self._cached(key)
        if hit is not None:
            if isinstance(hit, ValueError):
                raise type(hit)(str(hit))  # the same verdict, same type
            return hit  # type: ignore[return-value]
        started = time.monotonic()
        try:
            with grammar_budget.active(self.budget(cancel)):
                compiled = self._compile_uncached(*key)
        except ValueError as e:
            if not isinstance(e, (grammar_budget.GrammarTimeout, grammar_budget.CompileCancelled)):
                with self._lock:
                    self._lru[key] = e  # a verdict on the grammar itself: the same one sent again fails at once
                    self._trim()
            raise
        finally:
            if time.monotonic() - started > LONG_COMPILE_S:  # big temporary structures: give their pages back
                release_freed_memory()
        with self._lock:
            existing = self._lru.get(key)
            if existing is not None and not isinstance(existing, ValueError):
                return existing
            self._lru[key] = compiled
            self._trim()
        return compiled

    def _trim(self) -> None:
        while len(self._lru) > self._max_entries:
            self._lru.popitem(last=False)

    def submit(self, kind: str, spec: Any) -> Future:
        """Compile on a worker thread. The Future's result is a ``CompiledGrammar``; its exception a
        ``ValueError`` for bad grammars. Already-compiled grammars return a finished Future."""
        try:
            key = _normalise_spec(kind, spec)
        except ValueError as e:
            f: Future = Future()
            f.set_exception(e)
            return f
        hit = self._cached(key)
        if hit is not None:
            f = Future()
            if isinstance(hit, ValueError):
                f.set_exception(type(hit)(str(hit)))
            else:
                f.set_result(hit)
            return f
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None and not pending.done():
                return pending
            fut = self._pool.submit(self.compile, key[0], key[1])
            self._pending[key] = fut
        fut.add_done_callback(lambda _f, key=key: self._pending.pop(key, None))
        return fut

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.index_cache.shutdown()


# --------------------------------------------------------------------------------------------------
# Jump-forward re-tokenization (Appendix B.2)
# --------------------------------------------------------------------------------------------------


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # tokenizers.Tokenizer
        return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _bytes_of(vocab: TokenVocabulary, ids) -> bytes | None:
    out = []
    for i in ids:
        b = vocab.token_bytes[i] if 0 <= i < vocab.size else None
        if b is None:
            return None
        out.append(b)
    return b"".join(out)


def _encode_exact(tokenizer, vocab: TokenVocabulary, target: bytes) -> list[int] | None:
    """Token ids whose bytes are exactly ``target`` from the real tokenizer, or None."""
    try:
        text = target.decode("utf-8")
    except UnicodeDecodeError:
        return None
    ids = _encode(tokenizer, text)
    if _bytes_of(vocab, ids) == target:
        return ids
    # SentencePiece-style tokenizers prepend a word marker to every encoded text: anchor the text
    # behind a newline and keep the suffix that spells the target.
    ids = _encode(tokenizer, "\n" + text)
    for start in range(min(len(ids), 3)):
        if _bytes_of(vocab, ids[start:]) == target:
            return ids[start:]
    return None


def retokenize_jump_forward(tokenizer, output_ids: list[int], forced: str | bytes,
                            max_lookback: int = 4) -> tuple[int, list[int]]:
    """Tokens for appending ``forced`` after ``output_ids`` as the real tokenizer would write them.

    Re-encodes the text of (up to) the last ``max_lookback`` output tokens - extended backwards until it
    starts on a UTF-8 character boundary - together with ``forced``; returns ``(n_drop, new_ids)``: drop
    the last ``n_drop`` output tokens, then append ``new_ids`` (tokens shared with the old tail are not
    dropped). The bytes always add up: ``bytes(output[:-n_drop] + new_ids) == bytes(output) + forced``.
    If the tokenizer cannot reproduce the bytes exactly (normalisers, special-token text), falls back
    to re-encoding ``forced`` alone, then to a greedy longest-match tokenization of it.
    """
    vocab = get_vocabulary(tokenizer)
    forced_b = forced.encode("utf-8") if isinstance(forced, str) else bytes(forced)
    if not forced_b:
        return 0, []
    n = len(output_ids)
    k = min(n, max_lookback)
    # Do not re-encode across special tokens (they have no text).
    while k > 0 and _bytes_of(vocab, output_ids[n - k:]) is None:
        k -= 1
    # Start the window on a character boundary.
    while 0 < k < n:
        first = vocab.token_bytes[output_ids[n - k]]
        if first and (first[0] & 0xC0) != 0x80:
            break
        prev = vocab.token_bytes[output_ids[n - k - 1]]
        if prev is None:
            break
        k += 1
    if k > 0:
        tail_ids = list(output_ids[n - k:])
        tail = _bytes_of(vocab, tail_ids) or b""
        new = _encode_exact(tokenizer, vocab, tail + forced_b)
        if new is not None:
            p = 0
            while p < min(len(new), k) and new[p] == tail_ids[p]:
                p += 1
            return k - p, new[p:]
    new = _encode_exact(tokenizer, vocab, forced_b)
    if new is not None:
        return 0, new
    return 0, vocab.greedy_tokenize(forced_b)


def apply_jump_forward(matcher: GrammarMatcher, tokenizer, output_ids: list[int],
                       max_lookback: int = 4) -> tuple[int, list[int], str]:
    """Jump-forward in one call: returns ``(n_drop, new_ids, forced)`` and advances ``matcher`` over
    ``forced``; ``(0, [], '')`` when nothing is forced."""
    forced = matcher.forced_string()
    if not forced:
        return 0, [], ""
    n_drop, new_ids = retokenize_jump_forward(tokenizer, output_ids, forced, max_lookback=max_lookback)
    matcher.advance_text(forced)
    return n_drop, new_ids, forced
