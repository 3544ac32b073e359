"""Regex -> byte-level DFA.

Pipeline: ``re.compile`` (syntax validation with Python's own error messages) -> small rewrites
interegular does not understand (``\\uXXXX`` escapes, ``^``/``$`` anchors at the ends) ->
``interegular.parse_pattern`` (the parse tree) -> a **byte-level** DFA over UTF-8, built by one of two
engines -> merging of states with identical rows -> pruning of states that cannot reach acceptance.

Engines (``compile_regex(engine=...)``):

* ``"nfa"`` (default through ``"auto"``): our Thompson NFA over byte ranges straight from interegular's
  parse tree (each character class split into UTF-8 byte-range sequences), then a subset construction
  that only follows transitions that exist. About 2.5x faster than the other engine, measured side by
  side: the ``bench.py`` JSON schema 0.28-0.32 s vs 0.77-0.83 s, the 46 regexes of the property test
  0.09 s vs 0.22 s (see the "Fast path" section below for why).
* ``"interegular"``: ``parse_pattern(...).to_fsm()`` (a character-level DFA whose alphabet is a set of
  character classes plus ``anything_else``), then our character -> UTF-8 byte conversion. ``"auto"``
  uses it for what the NFA engine does not build (lookarounds); the tests check that both engines
  accept the same language.

Why byte-level and not character-level
--------------------------------------
The automaton is walked with the *tokens* of a BPE vocabulary, and byte-level BPE vocabularies
(GPT-2/SmolLM2 ``Ġ`` style, and SentencePiece's ``<0xNN>`` byte fallback) contain tokens that end - or
begin - in the middle of a multi-byte UTF-8 character (e.g. SmolLM2 encodes ``霍`` as three tokens
``é``, ``ľ``, ``į``). A character-level DFA cannot consume half a character, so every such token would
either be forbidden (distorting the distribution and making some strings impossible to produce) or need
a side buffer of pending bytes. A byte-level DFA consumes any token as the byte string it stands for,
mid-character states are ordinary DFA states, and "the output is valid UTF-8" falls out of the
construction (only well-formed UTF-8 sequences - no overlongs, no surrogates, nothing above U+10FFFF -
get transitions).

Character DFA -> byte DFA (the "interegular" engine)
---------------------------------------------------
For every character state we collect its outgoing transitions as sorted, disjoint code-point intervals
``[lo, hi] -> target``. ASCII code points become single-byte transitions. For multi-byte sequences a lead
byte selects an aligned block of ``64**k`` code points (``k`` continuation bytes left); a block on which
the transition function is constant becomes the shared chain "any ``k`` continuation bytes, then
target", a mixed block is split into its 64 sub-blocks. Intermediate states are hash-consed on their
transition rows, so "any character -> state 7" costs three shared states however many character states
use it.

Budget
------
Both engines stop at ``max_byte_states`` DFA states (the NFA at 8x that) and, only when a caller asks for
one, at ``timeout_s`` (off by default: the budget is deterministic, see ``budget.py``);
``to_fsm`` also at ``max_char_states``. ``interegular`` builds machines with a subset-construction
``crawl`` whose state lookup is a linear ``list.index`` (quadratic); the first compilation installs a
drop-in replacement of ``interegular.fsm.crawl`` (process-wide) that keeps the same state numbering but
indexes states with a dict and - only while one of our compilations runs on the current thread -
enforces the state limit and the deadline. Exceeding a budget raises ``ValueError("regex too complex:
...")``.

Semantics notes
---------------
* The whole output must match (``re.fullmatch`` semantics); leading ``^``/``\\A`` and trailing
  ``$``/``\\Z`` are accepted and ignored.
* ``\\d``, ``\\w``, ``\\s`` are ASCII classes (interegular), a subset of Python's Unicode classes, so
  everything we generate also matches with ``re``.
* Backreferences, lookbehinds, ``\\b`` and Unicode property escapes are rejected with ``ValueError``.
"""

from __future__ import annotations

import bisect
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import interegular
import interegular.fsm as ifsm
import numpy as np
from interegular import patterns as P
from interegular.fsm import anything_else
from interegular.patterns import InvalidSyntax, REFlags, Unsupported

from . import budget as grammar_budget

__all__ = [
    "ByteDFA",
    "compile_regex",
    "DEFAULT_MAX_CHAR_STATES",
    "DEFAULT_MAX_BYTE_STATES",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_MAX_CHAR_STATES = 20_000
DEFAULT_MAX_BYTE_STATES = 50_000
DEFAULT_TIMEOUT_S = None  # no wall-clock limit unless a caller sets one (budget.py)

_MAX_CP = 0x10FFFF
_SURR_LO, _SURR_HI = 0xD800, 0xDFFF


# --------------------------------------------------------------------------------------------------
# interegular crawl replacement (dict-indexed, budgeted)
# --------------------------------------------------------------------------------------------------


class _TooComplex(Exception):
    pass


_budget = threading.local()


def _check_budget(n_states: int) -> None:
    limit = getattr(_budget, "max_states", None)
    if limit is not None and n_states > limit:
        raise _TooComplex(f"more than {limit} character-level states")
    deadline = getattr(_budget, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _TooComplex(f"compilation took longer than {_budget.timeout_s:g}s")
    grammar_budget.check("regex -> DFA")  # the whole grammar path's deadline and cancellation (budget.py)


def _dict_key(d):
    return frozenset(d.items())


def _identity(x):
    return x


def _install_crawl() -> None:
    if getattr(ifsm.crawl, "_sglang_backend", False):
        return
    original = ifsm.crawl
    FSM, OblivionError = ifsm.FSM, ifsm.OblivionError

    def crawl(alphabet, initial, final, follow):
        # Same algorithm and state numbering as interegular.fsm.crawl, with an O(1) state index.
        # State objects: frozensets / tuples (hashable), a plain set for star()'s initial state, dicts
        # for parallel() (union, intersection). Key each by a hashable value with the same equality.
        if isinstance(initial, dict):
            key = _dict_key
        elif isinstance(initial, (set, frozenset)):
            key = frozenset
        else:
            try:
                hash(initial)
            except TypeError:
                return original(alphabet, initial, final, follow)
            key = _identity
        states = [initial]
        index = {key(initial): 0}
        finals = set()
        fmap = {}
        i = 0
        while i < len(states):
            if (i & 7) == 0:
                _check_budget(len(states))
            state = states[i]
            if final(state):
                finals.add(i)
            row = {}
            for transition in alphabet.by_transition:
                try:
                    nxt = follow(state, transition)
                except OblivionError:
                    continue
                k = key(nxt)
                j = index.get(k)
                if j is None:
                    j = len(states)
                    states.append(nxt)
                    index[k] = j
                row[transition] = j
            fmap[i] = row
            i += 1
        return FSM(alphabet=alphabet, states=range(len(states)), initial=0, finals=finals, map=fmap,
                   __no_validation__=True)

    crawl._sglang_backend = True  # type: ignore[attr-defined]
    ifsm.crawl = crawl


# --------------------------------------------------------------------------------------------------
# The byte DFA
# --------------------------------------------------------------------------------------------------


@dataclass
class ByteDFA:
    """A trimmed deterministic automaton over bytes.

    ``transitions[s, b]`` is the next state or ``-1`` (dead). Every state is reachable from
    ``initial`` (= 0) and can reach an accepting state, so "not dead" means "can still match".
    """

    pattern: str
    transitions: np.ndarray  # int32 [n_states, 256]
    accepting: np.ndarray  # bool [n_states]
    initial: int = 0
    _dist: np.ndarray | None = field(default=None, repr=False)
    _rows: list | None = field(default=None, repr=False)

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    def row(self, state: int) -> list[int]:
        """One state's transitions as a Python list (converted on first use and kept: scalar
        stepping through lists is ~5x faster than numpy item access, and only visited states pay)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = [None] * self.transitions.shape[0]
        r = rows[state]
        if r is None:
            r = rows[state] = self.transitions[state].tolist()
        return r

    def step(self, state: int, byte: int) -> int:
        return self.row(state)[byte]

    def walk(self, state: int, data: bytes) -> int:
        """State after consuming ``data`` from ``state``; -1 if it leaves the language."""
        row = self.row
        for b in data:
            state = row(state)[b]
            if state < 0:
                return -1
        return state

    def accepts(self, data: bytes | str) -> bool:
        if isinstance(data, str):
            data = data.encode("utf-8")
        s = self.walk(self.initial, data)
        return s >= 0 and bool(self.accepting[s])

    def distances_to_accept(self) -> np.ndarray:
        """Fewest bytes from each state to an accepting state (BFS over reversed edges)."""
        if self._dist is None:
            n = self.num_states
            src, byt = np.nonzero(self.transitions >= 0)
            dst = self.transitions[src, byt]
            order = np.argsort(dst, kind="stable")
            src_sorted, dst_sorted = src[order], dst[order]
            ptr = np.searchsorted(dst_sorted, np.arange(n + 1))
            dist = np.full(n, -1, dtype=np.int64)
            q = deque(int(s) for s in np.nonzero(self.accepting)[0])
            for s in q:
                dist[s] = 0
            while q:
                s = q.popleft()
                for p in src_sorted[ptr[s]:ptr[s + 1]].tolist():
                    if dist[p] < 0:
                        dist[p] = dist[s] + 1
                        q.append(p)
            self._dist = dist
        return self._dist

    def shortest_completion(self, state: int) -> bytes:
        """A shortest byte string leading from ``state`` to an accepting state (b'' if accepting).

        Useful to close a constrained output that ran out of ``max_new_tokens``."""
        dist = self.distances_to_accept()
        out = bytearray()
        while not self.accepting[state]:
            row = self.row(state)
            best = min((b for b in range(256) if row[b] >= 0), key=lambda b: dist[row[b]])
            out.append(best)
            state = row[best]
        return bytes(out)


# --------------------------------------------------------------------------------------------------
# Preprocessing
# --------------------------------------------------------------------------------------------------

_CLASS_SPECIAL = set("\\]^-[")
_STD_SPECIAL = set(".^$*+?{}[]\\|()")


def _literal(ch: str, in_class: bool) -> str:
    cp = ord(ch)
    if cp < 0x20 or cp == 0x7F:
        return "\\x%02x" % cp
    if in_class:
        return "\\" + ch if ch in _CLASS_SPECIAL else ch
    return "\\" + ch if ch in _STD_SPECIAL else ch


def _preprocess(pattern: str) -> str:
    """Rewrite what Python's ``re`` accepts but interegular does not: ``\\uXXXX``/``\\UXXXXXXXX``
    escapes, ``\\x{..}``-free; drop end anchors (full-match semantics)."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    class_start = -1
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            d = pattern[i + 1]
            if d in "uU":
                width = 4 if d == "u" else 8
                hexs = pattern[i + 2:i + 2 + width]
                if len(hexs) == width and all(h in "0123456789abcdefABCDEF" for h in hexs):
                    cp = int(hexs, 16)
                    if cp > _MAX_CP:
                        raise ValueError(f"invalid regex {pattern!r}: bad escape \\{d}{hexs}")
                    out.append(_literal(chr(cp), in_class))
                    i += 2 + width
                    continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]" and i > class_start:
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            # A ']' right after '[' or '[^' is a literal.
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            class_start = j + 1 if j < n and pattern[j] == "]" else j
            out.append(pattern[i:j])
            i = j
            continue
        out.append(c)
        i += 1
    s = "".join(out)
    # Anchors at the very ends are no-ops under full-match semantics.
    if s.startswith("^"):
        s = s[1:]
    elif s.startswith("\\A"):
        s = s[2:]
    if s.endswith("\\Z") and not _escaped_at(s, len(s) - 2):
        s = s[:-2]
    elif s.endswith("$") and not _escaped_at(s, len(s) - 1):
        s = s[:-1]
    return s


def _escaped_at(s: str, pos: int) -> bool:
    k = 0
    while pos - 1 - k >= 0 and s[pos - 1 - k] == "\\":
        k += 1
    return k % 2 == 1


# --------------------------------------------------------------------------------------------------
# Char FSM -> byte DFA
# --------------------------------------------------------------------------------------------------


def _chars_to_intervals(chars) -> list[tuple[int, int]]:
    cps = sorted(ord(c) for c in chars)
    out: list[tuple[int, int]] = []
    for cp in cps:
        if out and out[-1][1] + 1 == cp:
            out[-1] = (out[-1][0], cp)
        else:
            out.append((cp, cp))
    return out


def _complement(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    prev = 0
    for lo, hi in intervals:
        if lo > prev:
            out.append((prev, lo - 1))
        prev = hi + 1
    if prev <= _MAX_CP:
        out.append((prev, _MAX_CP))
    return out


class _ByteBuilder:
    """Accumulates byte-DFA rows; char state i keeps index i, intermediates are appended."""

    def __init__(self, n_char_states: int, max_states: int):
        self.rows: list[list[int] | None] = [None] * n_char_states
        self.intern: dict[tuple, int] = {}
        self.max_states = max_states

    def new_state(self, row: list[int]) -> int:
        key = tuple(row)
        sid = self.intern.get(key)
        if sid is None:
            sid = len(self.rows)
            if sid >= self.max_states:
                raise _TooComplex(f"more than {self.max_states} byte-level states")
            self.rows.append(row)
            self.intern[key] = sid
        return sid

    def cont_node(self, children: list[int]) -> int:
        """A state reading one continuation byte 0x80+j -> children[j]; -1 if all dead."""
        if all(c < 0 for c in children):
            return -1
        row = [-1] * 256
        row[0x80:0xC0] = children
        return self.new_state(row)


class _StateFunction:
    """code point -> target for one char state, as sorted disjoint intervals."""

    def __init__(self, triples: list[tuple[int, int, int]]):
        triples.sort()
        self.lo = [t[0] for t in triples]
        self.hi = [t[1] for t in triples]
        self.tgt = [t[2] for t in triples]

    def uniform(self, lo: int, hi: int):
        """(True, target|-1) if the function is constant on [lo, hi] (dead counts), else (False, None)."""
        i = bisect.bisect_right(self.lo, hi) - 1
        # intervals with start <= hi; the one at i is the last such.
        if i < 0 or self.hi[i] < lo:
            # nothing overlaps unless an earlier interval reaches into [lo, hi] (impossible: sorted, disjoint)
            return True, -1
        if self.lo[i] <= lo and self.hi[i] >= hi:
            return True, self.tgt[i]
        return False, None

    def at(self, cp: int) -> int:
        i = bisect.bisect_right(self.lo, cp) - 1
        if i >= 0 and self.hi[i] >= cp:
            return self.tgt[i]
        return -1


def _valid_block(lo: int, hi: int, min_cp: int):
    """Is [lo, hi] entirely valid / entirely invalid for an encoding whose minimum is ``min_cp``?"""
    if hi < min_cp or lo > _MAX_CP or (lo >= _SURR_LO and hi <= _SURR_HI):
        return "invalid"
    if lo >= min_cp and hi <= _MAX_CP and (hi < _SURR_LO or lo > _SURR_HI):
        return "valid"
    return "mixed"


def _block_node(b: _ByteBuilder, f: _StateFunction, lo: int, k: int, min_cp: int, cont_cache: dict) -> int:
    """State reading the remaining ``k`` continuation bytes of code points in [lo, lo + 64**k)."""
    size = 64 ** k
    hi = lo + size - 1
    validity = _valid_block(lo, hi, min_cp)
    if validity == "invalid":
        return -1
    if validity == "valid":
        uni, tgt = f.uniform(lo, hi)
        if uni:
            if tgt < 0:
                return -1
            return _cont_chain(b, k, tgt, cont_cache)
    sub = size // 64
    if k == 1:
        children = []
        for j in range(64):
            cp = lo + j
            ok = cp >= min_cp and cp <= _MAX_CP and not (_SURR_LO <= cp <= _SURR_HI)
            children.append(f.at(cp) if ok else -1)
    else:
        children = [_block_node(b, f, lo + j * sub, k - 1, min_cp, cont_cache) for j in range(64)]
    return b.cont_node(children)


def _cont_chain(b: _ByteBuilder, k: int, tgt: int, cache: dict) -> int:
    key = (k, tgt)
    sid = cache.get(key)
    if sid is None:
        child = tgt if k == 1 else _cont_chain(b, k - 1, tgt, cache)
        sid = b.cont_node([child] * 64)
        cache[key] = sid
    return sid


def _char_fsm_to_bytes(fsm, max_byte_states: int) -> tuple[list[list[int]], list[int], int]:
    alphabet = fsm.alphabet
    explicit = [s for s in alphabet if s is not anything_else]
    explicit_intervals = _chars_to_intervals(explicit)
    key_intervals: dict = {}
    for tkey, symbols in alphabet.by_transition.items():
        chars = [s for s in symbols if s is not anything_else]
        ivs = _chars_to_intervals(chars)
        if any(s is anything_else for s in symbols):
            ivs = sorted(ivs + _complement(explicit_intervals))
        key_intervals[tkey] = ivs

    # Renumber char states 0..n-1 with the initial state first.
    states = list(fsm.states)
    states.sort(key=lambda s: (s != fsm.initial, s))
    num = {s: i for i, s in enumerate(states)}
    b = _ByteBuilder(len(states), max_byte_states)
    cont_cache: dict = {}
    for s in states:
        triples = []
        for tkey, nxt in fsm.map.get(s, {}).items():
            for lo, hi in key_intervals.get(tkey, ()):
                triples.append((lo, hi, num[nxt]))
        f = _StateFunction(triples)
        row = [-1] * 256
        # 1-byte sequences
        for lo, hi, tgt in zip(f.lo, f.hi, f.tgt):
            if lo >= 0x80:
                break
            hi = min(hi, 0x7F)
            row[lo:hi + 1] = [tgt] * (hi - lo + 1)
        if not f.hi or f.hi[-1] < 0x80:
            b.rows[num[s]] = row
            continue
        # 2-byte: lead C2..DF, payload 5 bits; 3-byte: E0..EF; 4-byte: F0..F4
        for lead in range(0xC2, 0xE0):
            row[lead] = _block_node(b, f, (lead & 0x1F) << 6, 1, 0x80, cont_cache)
        for lead in range(0xE0, 0xF0):
            row[lead] = _block_node(b, f, (lead & 0x0F) << 12, 2, 0x800, cont_cache)
        for lead in range(0xF0, 0xF5):
            row[lead] = _block_node(b, f, (lead & 0x07) << 18, 3, 0x10000, cont_cache)
        b.rows[num[s]] = row
    finals = [num[s] for s in fsm.finals if s in num]
    return b.rows, finals, num[fsm.initial]


def _trim(rows: np.ndarray, accepting: np.ndarray, initial: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Keep states reachable from ``initial`` that can reach acceptance; renumber BFS order from 0."""
    n = rows.shape[0]
    src, byt = np.nonzero(rows >= 0)
    dst = rows[src, byt]
    # co-reachability (reverse BFS)
    order = np.argsort(dst, kind="stable")
    rsrc, rdst = src[order], dst[order]
    rptr = np.searchsorted(rdst, np.arange(n + 1))
    live = accepting.copy()
    stack = list(np.nonzero(accepting)[0])
    while stack:
        grammar_budget.check("DFA trimming")
        s = stack.pop()
        preds = rsrc[rptr[s]:rptr[s + 1]]
        new = preds[~live[preds]]
        if len(new):
            live[new] = True
            stack.extend(np.unique(new).tolist())
    if not live[initial]:
        return None
    rows = np.where(rows >= 0, rows, n)
    live_ext = np.append(live, False)
    rows = np.where(live_ext[rows], rows, -1)
    # forward reachability + BFS renumbering
    new_id = np.full(n, -1, dtype=np.int64)
    new_id[initial] = 0
    order_list = [initial]
    q = deque([initial])
    while q:
        grammar_budget.check("DFA trimming")
        s = q.popleft()
        for t in np.unique(rows[s][rows[s] >= 0]).tolist():
            if new_id[t] < 0:
                new_id[t] = len(order_list)
                order_list.append(t)
                q.append(t)
    keep = np.array(order_list, dtype=np.int64)
    sub = rows[keep]
    sub = np.where(sub >= 0, new_id[np.maximum(sub, 0)], -1).astype(np.int32)
    return sub, accepting[keep].copy()


def _merge_identical(rows: np.ndarray, accepting: np.ndarray, initial: int, max_rounds: int = 64):
    """Merge states with identical (transition row, acceptance) until nothing changes: a cheap partial
    minimisation that folds the duplicated UTF-8 continuation chains and repeated tails both engines
    produce (full Moore/Hopcroft minimisation costs rounds proportional to the DFA's depth)."""
    for _ in range(max_rounds):
        grammar_budget.check("DFA minimisation")
        n = rows.shape[0]
        key = np.ascontiguousarray(np.concatenate([rows, accepting[:, None].astype(np.int32)], axis=1))
        _, first, inv = np.unique(key.view(np.dtype((np.void, key.shape[1] * 4))).reshape(-1),
                                  return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        if len(first) == n:
            break
        rows = np.where(rows >= 0, inv[np.maximum(rows, 0)], -1).astype(np.int32)[first]
        accepting = accepting[first]
        initial = int(inv[initial])
    return rows, accepting, initial


# --------------------------------------------------------------------------------------------------
# Fast path: interegular's parse tree -> byte-level Thompson NFA -> subset construction
# --------------------------------------------------------------------------------------------------
#
# Why not only interegular's to_fsm: it builds every sub-machine over the *union* alphabet of the whole
# pattern and crawls each state over every symbol of it (catching an exception for each dead one). For
# a JSON-schema regex (~100 distinct symbols from the keys) that is 2.5x the time of the NFA engine
# (bench schema of ``bench.py``: 0.8 s vs 0.3 s). Here each NFA state carries only its own byte ranges, so
# the subset construction touches only the transitions that exist. Parse trees with lookarounds (or
# anything else unexpected) fall back to ``to_fsm`` + ``_char_fsm_to_bytes``; the tests cross-check
# both engines on the same regexes.


class _NeedsFallback(Exception):
    pass


def _utf8_encode(cp: int) -> bytes:
    return chr(cp).encode("utf-8", "surrogatepass")


def _utf8_sequences(lo: int, hi: int):
    """Split code points [lo, hi] (no surrogates) into UTF-8 byte-range sequences [(b_lo, b_hi), ...]
    whose cartesian products are exactly the encodings (the classic utf8-ranges construction)."""
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        split = False
        for bound in (0x7F, 0x7FF, 0xFFFF):
            if lo <= bound < hi:
                stack.append((bound + 1, hi))
                stack.append((lo, bound))
                split = True
                break
        if split:
            continue
        if hi < 0x80:
            yield [(lo, hi)]
            continue
        for i in range(1, 4):
            m = (1 << (6 * i)) - 1
            if (lo & ~m) != (hi & ~m):
                if (lo & m) != 0:
                    stack.append(((lo | m) + 1, hi))
                    stack.append((lo, lo | m))
                    split = True
                    break
                if (hi & m) != m:
                    stack.append((hi & ~m, hi))
                    stack.append((lo, (hi & ~m) - 1))
                    split = True
                    break
        if split:
            continue
        a, b = _utf8_encode(lo), _utf8_encode(hi)
        yield list(zip(a, b))


def _valid_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Clip code-point intervals to Unicode scalar values (drop surrogates)."""
    out = []
    for lo, hi in intervals:
        hi = min(hi, _MAX_CP)
        if lo > hi:
            continue
        if lo < _SURR_LO <= hi or lo <= _SURR_HI < hi or (_SURR_LO <= lo and hi <= _SURR_HI):
            if lo < _SURR_LO:
                out.append((lo, _SURR_LO - 1))
            if hi > _SURR_HI:
                out.append((_SURR_HI + 1, hi))
        else:
            out.append((lo, hi))
    return out


class _NFA:
    def __init__(self, max_states: int):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []
        self.max_states = max_states
        self._class_cache: dict = {}

    def state(self) -> int:
        self.eps.append([])
        self.edges.append([])
        n = len(self.eps)
        if (n & 1023) == 0:
            if n > self.max_states:
                raise _TooComplex(f"more than {self.max_states} NFA states")
            _check_budget(0)
        return n - 1

    def char_class(self, intervals: list[tuple[int, int]]) -> tuple[int, int]:
        start, end = self.state(), self.state()
        seqs = self._class_cache.get(tuple(intervals))
        if seqs is None:
            seqs = [seq for lo, hi in _valid_intervals(intervals) for seq in _utf8_sequences(lo, hi)]
            self._class_cache[tuple(intervals)] = seqs
        # One NFA path per byte-range sequence; duplicated continuation tails are folded after the
        # subset construction (_merge_identical).
        for seq in seqs:
            cur = start
            for k, (blo, bhi) in enumerate(seq):
                nxt = end if k == len(seq) - 1 else self.state()
                self.edges[cur].append((blo, bhi, nxt))
                cur = nxt
        return start, end


def _class_intervals(chars, negated: bool, insensitive: bool) -> list[tuple[int, int]]:
    if insensitive:
        chars = {v for c in chars for v in (c, c.lower(), c.upper()) if len(v) == 1}
    ivs = _chars_to_intervals(chars)
    return _complement(ivs) if negated else ivs


def _build_nfa(node, nfa: _NFA, flags, depth: int = 0) -> tuple[int, int]:
    if depth > 400:
        raise RecursionError
    name = type(node).__name__
    if isinstance(node, P.Pattern):
        flags = (flags | node.added_flags) & ~node.removed_flags
        if len(node.options) == 1:
            return _build_nfa(node.options[0], nfa, flags, depth + 1)
        start, end = nfa.state(), nfa.state()
        for opt in node.options:
            s, e = _build_nfa(opt, nfa, flags, depth + 1)
            nfa.eps[start].append(s)
            nfa.eps[e].append(end)
        return start, end
    if isinstance(node, P._Concatenation):
        start = cur = nfa.state()
        for part in node.parts:
            if not isinstance(part, P._BasePattern):  # lookaround (_NonCapturing)
                raise _NeedsFallback(type(part).__name__)
            s, e = _build_nfa(part, nfa, flags, depth + 1)
            nfa.eps[cur].append(s)
            cur = e
        return start, cur
    if isinstance(node, P._CharGroup):
        insensitive = bool(flags & P.REFlags.CASE_INSENSITIVE)
        return nfa.char_class(_class_intervals(node.chars, node.negated, insensitive))
    if name.endswith("DotCls"):
        excluded = () if flags & P.REFlags.SINGLE_LINE else ("\n",)
        return nfa.char_class(_class_intervals(excluded, True, False))
    if name.endswith("EmptyCls"):
        s = nfa.state()
        return s, s
    if isinstance(node, P._Repeated):
        lo, hi = node.min, node.max
        start = cur = nfa.state()
        for _ in range(lo):
            s, e = _build_nfa(node.base, nfa, flags, depth + 1)
            nfa.eps[cur].append(s)
            cur = e
        if hi is None:
            s, e = _build_nfa(node.base, nfa, flags, depth + 1)
            loop = nfa.state()
            nfa.eps[cur].append(loop)
            nfa.eps[loop].append(s)
            nfa.eps[e].append(loop)
            return start, loop
        if hi > lo:
            end = nfa.state()
            nfa.eps[cur].append(end)
            for _ in range(hi - lo):
                s, e = _build_nfa(node.base, nfa, flags, depth + 1)
                nfa.eps[cur].append(s)
                nfa.eps[e].append(end)
                cur = e
            return start, end
        return start, cur
    raise _NeedsFallback(name)


def _nfa_to_dfa(nfa: _NFA, start: int, final: int, max_states: int) -> tuple[list[list[int]], list[int]]:
    eps, edges = nfa.eps, nfa.edges
    # Epsilon-free view: keep only states with byte edges (or the final state) in subsets.
    important = [bool(edges[i]) or i == final for i in range(len(eps))]
    closure_cache: dict[int, frozenset] = {}

    def closure(s: int) -> frozenset:
        hit = closure_cache.get(s)
        if hit is not None:
            return hit
        seen = {s}
        stack = [s]
        while stack:
            x = stack.pop()
            for y in eps[x]:
                if y not in seen:
                    seen.add(y)
                    stack.append(y)
        res = frozenset(x for x in seen if important[x])
        closure_cache[s] = res
        return res

    init = closure(start)
    index = {init: 0}
    subsets = [init]
    rows: list[list[int]] = []
    finals: list[int] = []
    i = 0
    while i < len(subsets):
        if (i & 63) == 0:
            _check_budget(0)
        cur = subsets[i]
        if final in cur:
            finals.append(i)
        row = [-1] * 256
        out = [e for st in cur for e in edges[st]]
        if out:
            if len(out) == 1:
                blo, bhi, t = out[0]
                tgt = closure(t)
                j = index.get(tgt)
                if j is None:
                    j = len(subsets)
                    subsets.append(tgt)
                    index[tgt] = j
                row[blo:bhi + 1] = [j] * (bhi - blo + 1)
            else:
                bounds = sorted({e[0] for e in out} | {e[1] + 1 for e in out})
                for a, b in zip(bounds, bounds[1:]):
                    targets = [e[2] for e in out if e[0] <= a <= e[1]]
                    if not targets:
                        continue
                    if len(targets) == 1:
                        tgt = closure(targets[0])
                    else:
                        acc: set = set()
                        for t in targets:
                            acc |= closure(t)
                        tgt = frozenset(acc)
                    j = index.get(tgt)
                    if j is None:
                        j = len(subsets)
                        if j >= max_states:
                            raise _TooComplex(f"more than {max_states} byte-level states")
                        subsets.append(tgt)
                        index[tgt] = j
                    row[a:b] = [j] * (b - a)
        rows.append(row)
        i += 1
    return rows, finals


def _compile_nfa_engine(parsed, max_byte_states: int) -> tuple[list[list[int]], list[int], int]:
    nfa = _NFA(max_states=max_byte_states * 8)
    start, final = _build_nfa(parsed, nfa, REFlags(0))
    rows, finals = _nfa_to_dfa(nfa, start, final, max_byte_states)
    return rows, finals, 0


# --------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------


def compile_regex(
    pattern: str,
    *,
    max_char_states: int = DEFAULT_MAX_CHAR_STATES,
    max_byte_states: int = DEFAULT_MAX_BYTE_STATES,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    engine: str = "auto",
) -> ByteDFA:
    """Compile ``pattern`` (Python regex syntax, full-match semantics) into a trimmed byte DFA.

    ``engine``: "auto" (byte NFA + subset construction from interegular's parse tree; falls back to
    "interegular" for lookarounds), "nfa", or "interegular" (``to_fsm`` + UTF-8 conversion).

    Raises ``ValueError`` for invalid or unsupported regexes ("invalid regex ...: reason"), for regexes
    that match nothing ("... matches no string"), and past the compile budget ("regex too complex").
    """
    if engine not in ("auto", "nfa", "interegular"):
        raise ValueError(f"unknown regex engine {engine!r}")
    if not isinstance(pattern, str):
        raise ValueError(f"invalid regex {pattern!r}: expected a string, got {type(pattern).__name__}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"invalid regex {pattern!r}: {e}") from None
    except (OverflowError, RecursionError) as e:
        raise ValueError(f"invalid regex {pattern!r}: {e}") from None
    rewritten = _preprocess(pattern)

    _install_crawl()
    try:
        parsed = interegular.parse_pattern(rewritten)
    except Unsupported as e:
        raise ValueError(f"invalid regex {pattern!r}: unsupported feature ({e or 'not implemented'})") from None
    except InvalidSyntax as e:
        raise ValueError(f"invalid regex {pattern!r}: {e or 'syntax not supported'}") from None
    except RecursionError:
        raise ValueError(f"regex too complex: {pattern[:80]!r} is nested too deeply") from None
    except Exception as e:  # the parser raises assorted internal errors on exotic syntax
        raise ValueError(f"invalid regex {pattern!r}: unsupported syntax ({type(e).__name__}: {e})") from None

    _budget.max_states = max_char_states
    _budget.timeout_s = timeout_s
    _budget.deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        rows = None
        if engine in ("auto", "nfa"):
            try:
                rows, finals, initial = _compile_nfa_engine(parsed, max_byte_states)
            except _NeedsFallback as e:
                if engine == "nfa":
                    raise ValueError(f"invalid regex {pattern!r}: unsupported by the NFA engine ({e})") from None
        if rows is None:
            try:
                fsm = parsed.to_fsm()
            except Unsupported as e:
                raise ValueError(f"invalid regex {pattern!r}: unsupported feature ({e or 'not implemented'})") from None
            if len(fsm.states) > max_char_states:
                raise _TooComplex(f"more than {max_char_states} character-level states")
            _check_budget(len(fsm.states))
            rows, finals, initial = _char_fsm_to_bytes(fsm, max_byte_states)
        _check_budget(0)
    except _TooComplex as e:
        raise ValueError(f"regex too complex: {pattern[:120]!r}: {e}") from None
    except RecursionError:
        raise ValueError(f"regex too complex: {pattern[:120]!r} is nested too deeply") from None
    finally:
        _budget.max_states = None
        _budget.deadline = None

    table = np.asarray(rows, dtype=np.int32).reshape(len(rows), 256)
    accepting = np.zeros(len(rows), dtype=bool)
    accepting[finals] = True
    table, accepting, initial = _merge_identical(table, accepting, initial)
    trimmed = _trim(table, accepting, initial)
    if trimmed is None:
        raise ValueError(f"regex {pattern!r} matches no string (its language is empty)")
    table, accepting = trimmed
    return ByteDFA(pattern=pattern, transitions=np.ascontiguousarray(table), accepting=accepting, initial=0)
