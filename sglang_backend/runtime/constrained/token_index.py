"""Token index: for every state of a byte DFA, the set of vocabulary tokens that may come next.

Vocabulary (:class:`TokenVocabulary`, built once per tokenizer)
----------------------------------------------------------------
Every token id gets the exact bytes it contributes to the output:

* byte-level BPE (GPT-2, SmolLM2, Llama-3, Qwen: decoder ``ByteLevel``): token strings are written in
  the GPT-2 ``bytes_to_unicode`` alphabet (``Ġ`` = space, ``Ċ`` = newline, ``é ľ į`` = the three bytes
  of ``霍``), mapped back byte by byte;
* SentencePiece style (Llama-2, Mistral: ``▁`` word marker, ``<0xNN>`` byte-fallback tokens): ``▁`` is a
  space and ``<0xNN>`` is the single byte ``NN``;
* anything else: the token string as UTF-8.

Added tokens that are not special are literal text (their UTF-8). Special tokens get no bytes and are
never allowed; EOS ids are allowed exactly in accepting states. Ids at or above the model's
``vocab_size`` (logit width) do not exist; logit rows wider than the tokenizer are masked off.

The byte strings are arranged in a trie (numpy CSR arrays, built vectorised by sorting the token byte
matrix), so tokens sharing a prefix share the DFA walk over it.

Index construction (eager, vectorised)
--------------------------------------
1. **Mask classes.** A state's allowed set depends only on which byte strings of length
   ``<= max_token_len`` it can read, so states are partitioned by ``max_token_len`` rounds of Moore
   refinement (all live states start in one class; vectorised with 128-bit multiset hashes of the
   ``(byte, class of target)`` edges - collisions are astronomically unlikely), then split by
   "accepting" (EOS). Long runs like ``[a-z]{0,500}`` collapse to ~``max_token_len`` classes, and the
   walk below runs once per class instead of once per state.
2. **Trie walk.** For a chunk of (up to 64) class representatives, the DFA state of every
   (trie node, representative) pair is computed one trie level at a time with numpy gathers
   (``state[child] = T[state[parent], byte[child]]``), dense over the representatives and sparse over
   nodes: a node is expanded only if some representative is still alive at its parent, and chunks group
   representatives of similar fan-out, so narrow states (digits, punctuation) touch a few nodes and a
   free-text state costs one pass over the trie (100k nodes for SmolLM2). A token is allowed where its
   end node's state is alive.
3. **Masks** are stored bit-packed (``np.packbits``, 6 KiB per class for a 49k vocabulary) with the EOS
   bits set for accepting classes. Matchers turn a class into a cached tensor on first use.

Token-level liveness: if acceptance is reachable from every live DFA state using single-byte tokens
only (checked per grammar), every live state is token-live and the fast path above is exact. That is
the normal case even for vocabularies lacking a few bytes - SmolLM2 has no single-byte token for 0x04,
0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1, 0xF2 (nor the never-valid 0xC0, 0xC1, 0xF5-0xFF) - since such a
byte is almost never the *only* way forward. Otherwise classes are per state, the walk records where
each token lands, and a fixpoint removes tokens that lead to states from which no token path reaches
acceptance; a grammar whose initial state is not token-live is rejected ("unrealisable by this
tokenizer").

Caching and async builds: :class:`TokenIndexCache` (memory LRU + on-disk ``.npz`` under
``<cache root>/fsm/``, keyed by a hash of the regex, the vocabulary fingerprint, ``vocab_size`` and the
EOS ids) with ``submit(regex) -> Future`` on a thread pool.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..model_loader.embedded import cache_root
from . import budget as grammar_budget
from .regex_fsm import DEFAULT_TIMEOUT_S, ByteDFA, compile_regex

__all__ = [
    "TokenVocabulary",
    "TokenIndex",
    "TokenIndexCache",
    "build_token_index",
    "get_vocabulary",
    "fsm_cache_dir",
    "INDEX_FORMAT_VERSION",
]

INDEX_FORMAT_VERSION = 2


# --------------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the standard construction)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _tokenizer_style(tokenizer) -> str:
    """'byte_level', 'sentencepiece' or 'plain', from the fast tokenizer's decoder/model config."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None and hasattr(tokenizer, "to_str"):
        backend = tokenizer
    if backend is not None:
        try:
            cfg = json.loads(backend.to_str())
        except Exception:
            cfg = {}
        blob = json.dumps({"decoder": cfg.get("decoder"), "pre_tokenizer": cfg.get("pre_tokenizer")},
                          ensure_ascii=False)
        if '"ByteLevel"' in blob:
            return "byte_level"
        model = cfg.get("model") or {}
        if '"Metaspace"' in blob or "\u2581" in blob or model.get("byte_fallback"):
            return "sentencepiece"
        return "plain"
    # Slow tokenizers: guess from the vocabulary.
    vocab = tokenizer.get_vocab()
    if "Ġ" in "".join(list(vocab)[:5000]):
        return "byte_level"
    if any(t.startswith("\u2581") for t in vocab):
        return "sentencepiece"
    return "plain"


def _token_to_bytes(tok: str, style: str) -> bytes:
    if style == "byte_level":
        try:
            return bytes(_UNICODE_TO_BYTE[c] for c in tok)
        except KeyError:
            return tok.encode("utf-8")
    if style == "sentencepiece":
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            try:
                return bytes([int(tok[3:5], 16)])
            except ValueError:
                pass
        return tok.replace("\u2581", " ").encode("utf-8")
    return tok.encode("utf-8")


class TokenVocabulary:
    """Byte strings of a tokenizer's tokens + a byte trie over them (built once per tokenizer)."""

    def __init__(self, token_bytes: list[bytes | None], special_ids: set[int], style: str = "byte_level"):
        self.token_bytes = token_bytes
        self.special_ids = set(special_ids)
        self.style = style
        self.size = len(token_bytes)
        h = hashlib.sha256()
        h.update(f"vocab-v1\0{style}\0{self.size}\0".encode())
        for i, b in enumerate(token_bytes):
            if b is None:
                h.update(b"\xff\xff\xff\xff")
            else:
                h.update(len(b).to_bytes(4, "little"))
                h.update(b)
        self.fingerprint = h.hexdigest()
        self._build_trie()
        singles = {b[0] for b in token_bytes if b is not None and len(b) == 1}
        self.byte_complete = len(singles) == 256
        self.single_byte_token = {}
        for i, b in enumerate(token_bytes):
            if b is not None and len(b) == 1 and b[0] not in self.single_byte_token:
                self.single_byte_token[b[0]] = i

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenVocabulary":
        style = _tokenizer_style(tokenizer)
        vocab = tokenizer.get_vocab()
        added = {}
        getter = getattr(tokenizer, "added_tokens_decoder", None)
        if getter is not None and not callable(getter):
            added = dict(getter)
        elif hasattr(tokenizer, "get_added_tokens_decoder"):
            added = dict(tokenizer.get_added_tokens_decoder())
        special_ids: set[int] = set()
        for tid, tok in added.items():
            if getattr(tok, "special", False):
                special_ids.add(int(tid))
        for tid in getattr(tokenizer, "all_special_ids", []) or []:
            special_ids.add(int(tid))
        size = max(vocab.values()) + 1 if vocab else 0
        token_bytes: list[bytes | None] = [None] * size
        for tok, tid in vocab.items():
            if tid in special_ids:
                continue
            if tid in added:
                content = getattr(added[tid], "content", tok)
                token_bytes[tid] = content.encode("utf-8")
            else:
                token_bytes[tid] = _token_to_bytes(tok, style)
        for tid, b in enumerate(token_bytes):
            if b is not None and len(b) == 0:
                token_bytes[tid] = None
        return cls(token_bytes, special_ids, style)

    def _build_trie(self) -> None:
        ids = np.array([i for i, b in enumerate(self.token_bytes) if b], dtype=np.int64)
        bs = [self.token_bytes[i] for i in ids.tolist()]
        lens = np.array([len(b) for b in bs], dtype=np.int64)
        self.max_len = int(lens.max()) if len(lens) else 0
        n, L = len(bs), self.max_len
        if n == 0:
            self.num_nodes = 1
            self.node_parent = np.full(1, -1, np.int64)
            self.level_ptr = np.array([0, 1], np.int64)
            self.tok_node = np.zeros(0, np.int64)
            self.node_byte = np.zeros(1, np.int32)
            self.child_ptr = np.zeros(2, np.int64)
            self.tok_ptr = np.zeros(2, np.int64)
            self.tok_ids = np.zeros(0, np.int32)
            return
        mat = np.full((n, L), -1, dtype=np.int16)
        flat = np.frombuffer(b"".join(bs), dtype=np.uint8).astype(np.int16)
        rows = np.repeat(np.arange(n), lens)
        starts = np.cumsum(lens) - lens
        cols = np.arange(len(flat)) - np.repeat(starts, lens)
        mat[rows, cols] = flat
        order = np.lexsort(mat.T[::-1])  # lexicographic, shorter (padded with -1) first
        mat, lens, ids = mat[order], lens[order], ids[order]
        diff = np.ones((n, L), dtype=bool)
        diff[1:] = mat[1:] != mat[:-1]
        diff = np.logical_or.accumulate(diff, axis=1)
        exists = np.arange(L)[None, :] < lens[:, None]
        new = diff & exists
        node_at = np.zeros((n, L), dtype=np.int64)
        next_id = 1  # node 0 is the root
        parents, nbytes = [np.zeros(1, np.int64)], [np.zeros(1, np.int32)]
        for d in range(L):
            col_new = new[:, d]
            cnt = int(col_new.sum())
            tagged = np.full(n, -1, dtype=np.int64)
            tagged[col_new] = np.arange(next_id, next_id + cnt)
            node_at[:, d] = np.maximum.accumulate(tagged)
            sel = np.nonzero(col_new)[0]
            parents.append(node_at[sel, d - 1] if d > 0 else np.zeros(cnt, np.int64))
            nbytes.append(mat[sel, d].astype(np.int32))
            next_id += cnt
        parent = np.concatenate(parents)
        parent[0] = -1
        self.num_nodes = next_id
        self.node_parent = parent
        self.level_ptr = np.cumsum([0, 1] + [len(x) for x in nbytes[1:]]).astype(np.int64)
        self.node_byte = np.concatenate(nbytes)
        # BFS order => parent ids are non-decreasing => children of p are contiguous.
        self.child_ptr = np.searchsorted(parent[1:], np.arange(next_id + 1), side="left").astype(np.int64) + 1
        end_node = node_at[np.arange(n), lens - 1]
        o = np.argsort(end_node, kind="stable")
        self.tok_ids = ids[o].astype(np.int32)
        self.tok_node = end_node[o].astype(np.int64)
        self.tok_ptr = np.searchsorted(end_node[o], np.arange(next_id + 1), side="left").astype(np.int64)

    def greedy_tokenize(self, data: bytes) -> list[int]:
        """Longest-match tokenization of ``data`` with this vocabulary (fallback when the real
        tokenizer cannot reproduce ``data`` exactly)."""
        out: list[int] = []
        i = 0
        while i < len(data):
            node, best, best_len = 0, None, 0
            j = i
            while j < len(data):
                lo, hi = int(self.child_ptr[node]), int(self.child_ptr[node + 1])
                k = lo + int(np.searchsorted(self.node_byte[lo:hi], data[j]))
                if k >= hi or self.node_byte[k] != data[j]:
                    break
                node = k
                j += 1
                if self.tok_ptr[node + 1] > self.tok_ptr[node]:
                    best, best_len = int(self.tok_ids[self.tok_ptr[node]]), j - i
            if best is None:
                raise ValueError(f"byte {data[i]:#x} cannot be produced by any token of this vocabulary")
            out.append(best)
            i += best_len
        return out


_VOCAB_CACHE: dict[int, tuple[object, TokenVocabulary]] = {}
_VOCAB_LOCK = threading.Lock()


def get_vocabulary(tokenizer) -> TokenVocabulary:
    """The (cached) :class:`TokenVocabulary` of ``tokenizer``."""
    if isinstance(tokenizer, TokenVocabulary):
        return tokenizer
    with _VOCAB_LOCK:
        hit = _VOCAB_CACHE.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        vocab = TokenVocabulary.from_tokenizer(tokenizer)
        if len(_VOCAB_CACHE) > 16:
            _VOCAB_CACHE.clear()
        _VOCAB_CACHE[id(tokenizer)] = (tokenizer, vocab)  # keeps the tokenizer alive: the id stays valid
        return vocab


# --------------------------------------------------------------------------------------------------
# Index construction
# --------------------------------------------------------------------------------------------------

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 finaliser, vectorised (uint64 wrap-around arithmetic)."""
    z = x.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def mask_classes(dfa: ByteDFA, depth: int) -> np.ndarray:
    """Partition states so that states in one class have the same allowed-token set (tokens of at most
    ``depth`` bytes) and the same acceptance. Returns ``class_of_state`` (int32, classes 0..C-1)."""
    t = dfa.transitions
    n = t.shape[0]
    src, byt = np.nonzero(t >= 0)
    dst = t[src, byt].astype(np.int64)
    ptr = np.searchsorted(src, np.arange(n + 1))
    cls = np.zeros(n, dtype=np.int64)
    n_cls = 1
    byt64 = byt.astype(np.uint64)
    with np.errstate(over="ignore"):
        for _ in range(depth):
            key = (cls[dst].astype(np.uint64) << np.uint64(8)) | byt64
            sigs = []
            for seed in (1, 2):
                h = _mix64(key, seed)
                cs = np.concatenate([np.zeros(1, np.uint64), np.cumsum(h, dtype=np.uint64)])
                sigs.append(cs[ptr[1:]] - cs[ptr[:-1]])
            stacked = np.ascontiguousarray(np.stack([cls.astype(np.uint64), sigs[0], sigs[1]], axis=1))
            _, inv = np.unique(stacked.view(np.dtype((np.void, 24))).reshape(-1), return_inverse=True)
            inv = inv.reshape(-1)
            new_n = int(inv.max()) + 1 if n else 0
            cls = inv.astype(np.int64)
            if new_n == n_cls:
                break
            n_cls = new_n
    final = cls * 2 + dfa.accepting.astype(np.int64)
    _, inv = np.unique(final, return_inverse=True)
    return inv.reshape(-1).astype(np.int32)


def _walk(dfa: ByteDFA, vocab: TokenVocabulary, reps: np.ndarray) -> np.ndarray:
    """Walk the vocabulary trie from each state in ``reps`` at once.

    Returns ``end`` of shape [len(vocab.tok_ids), len(reps)]: the DFA state reached after reading token
    ``vocab.tok_ids[i]`` from ``reps[j]``, or ``dfa.num_states`` (dead). Level-synchronous over the
    trie, dense over the representatives, sparse over trie nodes: a node is expanded only if some
    representative is still alive at its parent.
    """
    t = dfa.transitions
    n = t.shape[0]
    dead = n
    T = np.empty((n + 1) * 256, dtype=np.int32)
    T[: n * 256] = np.where(t >= 0, t, dead).reshape(-1)
    T[n * 256:] = dead
    parent, node_byte, level_ptr = vocab.node_parent, vocab.node_byte, vocab.level_ptr
    R = len(reps)
    full = np.full((vocab.num_nodes, R), dead, dtype=np.int32)
    full[0] = reps
    alive_prev = np.ones(1, dtype=bool)  # the root level
    prev_lo = 0
    for d in range(1, len(level_ptr) - 1):
        lo, hi = int(level_ptr[d]), int(level_ptr[d + 1])
        par = parent[lo:hi]
        sel = np.nonzero(alive_prev[par - prev_lo])[0]
        if sel.size == 0:
            break
        nodes = sel + lo
        if sel.size == hi - lo:
            block = full[par]
            full[lo:hi] = T[block * 256 + node_byte[lo:hi, None]]
            alive_prev = (full[lo:hi] != dead).any(axis=1)
        else:
            block = full[par[sel]]
            vals = T[block * 256 + node_byte[nodes, None]]
            full[nodes] = vals
            alive_prev = np.zeros(hi - lo, dtype=bool)
            alive_prev[sel] = (vals != dead).any(axis=1)
        prev_lo = lo
    return full[vocab.tok_node]


@dataclass
class TokenIndex:
    """Allowed-token masks of every DFA state (shared by all matchers of one grammar)."""

    vocab_size: int
    state_class: np.ndarray  # int32 [n_states]
    masks: np.ndarray  # uint8 [n_classes, ceil(vocab_size / 8)], packbits (big-endian bit order)
    class_num_tokens: np.ndarray  # int64 [n_classes]: allowed non-EOS tokens
    token_live: np.ndarray  # bool [n_states]: some token path reaches acceptance from here
    build_seconds: float = 0.0

    @property
    def num_classes(self) -> int:
        return int(self.masks.shape[0])

    def allowed_bool(self, state: int) -> np.ndarray:
        return np.unpackbits(self.masks[self.state_class[state]], count=self.vocab_size).astype(bool)

    def is_allowed(self, state: int, token_id: int) -> bool:
        if token_id < 0 or token_id >= self.vocab_size:
            return False
        byte = self.masks[self.state_class[state], token_id >> 3]
        return bool((byte >> (7 - (token_id & 7))) & 1)

    def allowed_token_ids(self, state: int) -> np.ndarray:
        return np.nonzero(self.allowed_bool(state))[0]


def _single_byte_live(dfa: ByteDFA, vocab: TokenVocabulary) -> np.ndarray:
    """States from which acceptance is reachable using single-byte tokens only (a lower bound of
    token-liveness; equal to byte-liveness when every byte the DFA uses has a single-byte token)."""
    t = dfa.transitions
    n = t.shape[0]
    producible = np.zeros(256, dtype=bool)
    producible[list(vocab.single_byte_token)] = True
    usable = (t >= 0) & producible[None, :]
    src, byt = np.nonzero(usable)
    dst = t[src, byt]
    order = np.argsort(dst, kind="stable")
    rsrc, rdst = src[order], dst[order]
    ptr = np.searchsorted(rdst, np.arange(n + 1))
    live = dfa.accepting.copy()
    stack = np.nonzero(live)[0].tolist()
    while stack:
        grammar_budget.check("token index")
        q = stack.pop()
        preds = rsrc[ptr[q]:ptr[q + 1]]
        new = np.unique(preds[~live[preds]])
        if new.size:
            live[new] = True
            stack.extend(new.tolist())
    return live


def _chunks(reps: np.ndarray, dfa: ByteDFA, size: int):
    """Group representatives with similar first-byte fan-out so a chunk's walk stays node-sparse."""
    fan = (dfa.transitions[reps] >= 0).sum(axis=1)
    order = np.argsort(fan, kind="stable")
    for i in range(0, len(order), size):
        yield order[i:i + size]


def build_token_index(dfa: ByteDFA, vocab: TokenVocabulary, vocab_size: int, eos_token_ids,
                      chunk_size: int = 64, timeout_s: float | None = None) -> TokenIndex:
    """Eager, vectorised construction (see the module docstring). Raises ``ValueError`` when the grammar
    cannot be produced with this vocabulary, or ("regex too complex") past ``timeout_s``."""
    t0 = time.perf_counter()

    def check_time():
        if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
            raise ValueError(f"regex too complex: {dfa.pattern[:120]!r}: token index build took longer than "
                             f"{timeout_s:g}s ({dfa.num_states} states)")
        grammar_budget.check("token index")

    n = dfa.num_states
    eos = sorted(int(e) for e in eos_token_ids if 0 <= int(e) < vocab_size)
    nbytes = (vocab_size + 7) // 8
    in_range = vocab.tok_ids < vocab_size
    tok_ids = vocab.tok_ids[in_range]
    if _single_byte_live(dfa, vocab).all():
        # Fast path: every byte-live state is token-live; one walk per mask class.
        state_class = mask_classes(dfa, max(1, vocab.max_len))
        n_cls = int(state_class.max()) + 1
        reps = np.zeros(n_cls, dtype=np.int64)
        reps[state_class] = np.arange(n)  # any member represents its class
        token_live = np.ones(n, dtype=bool)
        masks = np.zeros((n_cls, nbytes), dtype=np.uint8)
        counts = np.zeros(n_cls, dtype=np.int64)
        dense_t = np.zeros((nbytes * 8, chunk_size), dtype=bool)  # [token, rep]: row scatters
        all_in = bool(in_range.all())
        for idx in _chunks(reps, dfa, chunk_size):
            check_time()
            end = _walk(dfa, vocab, reps[idx])
            ok = (end if all_in else end[in_range]) != n
            dense_t[:, :len(idx)] = False
            dense_t[tok_ids, :len(idx)] = ok
            masks[idx] = np.packbits(dense_t[:, :len(idx)], axis=0).T
            counts[idx] = np.count_nonzero(ok, axis=0)
        class_accepting = np.zeros(n_cls, dtype=bool)
        class_accepting[state_class] = dfa.accepting
    else:
        # Exact path: per-state classes, token transitions recorded, token-level liveness fixpoint.
        state_class = np.arange(n, dtype=np.int32)
        src_l, tok_l, dst_l = [], [], []
        all_states = np.arange(n, dtype=np.int64)
        for idx in _chunks(all_states, dfa, chunk_size):
            check_time()
            end = _walk(dfa, vocab, all_states[idx])[in_range]
            ti, rj = np.nonzero(end != n)
            src_l.append(idx[rj])
            tok_l.append(tok_ids[ti])
            dst_l.append(end[ti, rj])
        src = np.concatenate(src_l) if src_l else np.zeros(0, np.int64)
        tok = np.concatenate(tok_l) if tok_l else np.zeros(0, np.int64)
        dst = np.concatenate(dst_l) if dst_l else np.zeros(0, np.int64)
        live = dfa.accepting.copy()
        while True:
            new_live = live.copy()
            new_live[src[live[dst]]] = True
            if new_live.sum() == live.sum():
                break
            live = new_live
        token_live = live
        if not live[dfa.initial]:
            raise ValueError(f"regex {dfa.pattern[:120]!r} is unrealisable by this tokenizer: no token sequence "
                             f"of its vocabulary matches it")
        good = live[dst]
        dense = np.zeros((n, vocab_size), dtype=bool)
        dense[src[good], tok[good]] = True
        masks = np.packbits(dense, axis=1)
        counts = np.count_nonzero(dense, axis=1).astype(np.int64)
        class_accepting = dfa.accepting.copy()
    # EOS bits on accepting classes (counts stay "non-EOS continuations").
    for e in eos:
        byte, bit = e >> 3, np.uint8(1 << (7 - (e & 7)))
        had = (masks[:, byte] & bit) != 0
        counts -= had.astype(np.int64)  # an EOS id that is also a normal token is not a continuation
        masks[:, byte] = np.where(class_accepting, masks[:, byte] | bit, masks[:, byte] & ~bit)
    return TokenIndex(vocab_size=vocab_size, state_class=state_class.astype(np.int32), masks=masks,
                      class_num_tokens=counts, token_live=token_live,
                      build_seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------
# Caching (memory LRU + disk) and async builds
# --------------------------------------------------------------------------------------------------


def fsm_cache_dir() -> str:
    """``<cache root>/fsm`` where the cache root is ``$SGLANG_BACKEND_CACHE`` (else
    ``$XDG_CACHE_HOME/sglang_backend``, else ``~/.cache/sglang_backend``)."""
    return os.path.join(cache_root(), "fsm")


def _save(path: str, dfa: ByteDFA, index: TokenIndex) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(
                f,
                pattern=np.frombuffer(dfa.pattern.encode("utf-8"), dtype=np.uint8),
                transitions=dfa.transitions, accepting=dfa.accepting,
                vocab_size=np.array([index.vocab_size]), state_class=index.state_class, masks=index.masks,
                class_num_tokens=index.class_num_tokens, token_live=index.token_live,
            )
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _load(path: str, pattern: str) -> tuple[ByteDFA, TokenIndex] | None:
    try:
        with np.load(path) as z:
            if bytes(z["pattern"]).decode("utf-8") != pattern:
                return None
            dfa = ByteDFA(pattern=pattern, transitions=np.ascontiguousarray(z["transitions"]),
                          accepting=z["accepting"].astype(bool))
            index = TokenIndex(vocab_size=int(z["vocab_size"][0]), state_class=z["state_class"], masks=z["masks"],
                               class_num_tokens=z["class_num_tokens"], token_live=z["token_live"].astype(bool))
        return dfa, index
    except Exception:  # missing, truncated or from another version: rebuild
        return None


class TokenIndexCache:
    """Compiled (DFA, TokenIndex) pairs for one tokenizer: memory LRU, disk cache, async builds.

    Thread-safe. Failed compilations (``ValueError``) are remembered too, so a bad grammar sent again
    fails at once. Concurrent requests for the same regex share one build.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None, eos_token_ids=(), *,
                 cache_dir: str | None = None, disk_cache: bool = True, max_memory_entries: int = 128,
                 max_workers: int = 1, regex_options: dict | None = None):
        self.vocab = get_vocabulary(tokenizer)
        self.vocab_size = int(vocab_size if vocab_size is not None else self.vocab.size)
        self.eos_token_ids = sorted({int(e) for e in eos_token_ids})
        self.cache_dir = cache_dir
        self.disk_cache = disk_cache
        self.max_memory_entries = max_memory_entries
        self.regex_options = dict(regex_options or {})
        self._lru: OrderedDict[str, object] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self.stats = {"memory_hits": 0, "disk_hits": 0, "builds": 0, "errors": 0}

    def key(self, regex: str) -> str:
        h = hashlib.sha256()
        opts = json.dumps(self.regex_options, sort_keys=True)
        h.update(f"index-v{INDEX_FORMAT_VERSION}\0{self.vocab.fingerprint}\0{self.vocab_size}\0"
                 f"{self.eos_token_ids}\0{opts}\0".encode())
        h.update(regex.encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def _disk_path(self, key: str) -> str:
        return os.path.join(self.cache_dir or fsm_cache_dir(), key[:2], key + ".npz")

    def _remember(self, key: str, value) -> None:
        with self._lock:
            self._lru[key] = value
            self._lru.move_to_end(key)
            while len(self._lru) > self.max_memory_entries:
                self._lru.popitem(last=False)

    def get(self, regex: str) -> tuple[ByteDFA, TokenIndex]:
        """Compile (or fetch) ``regex``; raises ``ValueError`` for bad grammars."""
        key = self.key(regex)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                self.stats["memory_hits"] += 1
            else:
                fut = self._inflight.get(key)
                owner = fut is None
                if owner:
                    fut = Future()
                    self._inflight[key] = fut
        if hit is not None:
            if isinstance(hit, Exception):
                raise ValueError(str(hit))
            return hit  # type: ignore[return-value]
        if not owner:
            try:
                return fut.result()
            except grammar_budget.CompileCancelled:
                return self.get(regex)  # the build we waited for was cancelled, not this request: build it here
        try:
            result = self._build(key, regex)
        except ValueError as e:
            with self._lock:
                self.stats["errors"] += 1
                self._inflight.pop(key, None)
            if not isinstance(e, (grammar_budget.GrammarTimeout, grammar_budget.CompileCancelled)):
                self._remember(key, e)  # a verdict on the grammar; a timeout depends on the load, so retry it later
            fut.set_exception(e)
            raise
        except BaseException as e:
            with self._lock:
                self._inflight.pop(key, None)
            fut.set_exception(e)
            raise
        self._remember(key, result)
        with self._lock:
            self._inflight.pop(key, None)
        fut.set_result(result)
        return result

    def _build(self, key: str, regex: str) -> tuple[ByteDFA, TokenIndex]:
        path = self._disk_path(key) if self.disk_cache else None
        if path is not None and os.path.exists(path):
            loaded = _load(path, regex)
            if loaded is not None:
                with self._lock:
                    self.stats["disk_hits"] += 1
                return loaded
        dfa = compile_regex(regex, **self.regex_options)
        index = build_token_index(dfa, self.vocab, self.vocab_size, self.eos_token_ids,
                                  timeout_s=self.regex_options.get("timeout_s", DEFAULT_TIMEOUT_S))
        if not index.token_live[dfa.initial]:
            raise ValueError(f"regex {regex[:120]!r} is unrealisable by this tokenizer")
        with self._lock:
            self.stats["builds"] += 1
        if path is not None:
            try:
                _save(path, dfa, index)
            except OSError:
                pass  # a read-only cache dir only costs rebuilds
        return dfa, index

    def submit(self, regex: str) -> Future:
        """Compile on the pool; the Future's result is ``(ByteDFA, TokenIndex)`` or raises ValueError."""
        key = self.key(regex)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                fut: Future = Future()
                if isinstance(hit, Exception):
                    fut.set_exception(ValueError(str(hit)))
                else:
                    fut.set_result(hit)
                return fut
        return self._pool.submit(self.get, regex)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
