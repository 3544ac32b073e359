"""Compressed FSM (SGLang paper §4, Appendix B.1) over a byte DFA.

Definitions (Appendix B.1, at byte granularity):

* a **singular transition edge** leaves a state that has exactly one successor over exactly one
  symbol (byte) and that is not accepting - an accepting state always has a second option, "stop";
* a **compressed edge** is an edge ``e0`` followed by the maximal chain ``e1..ek`` of singular
  transition edges; its label is the concatenation of their labels.

Merging every singular chain into its predecessor edge gives the compressed FSM. At decode time the
label of a chain that starts at the current state is the **forced string**: whatever the model does,
these bytes come next, so the runtime appends them in one step (jump-forward) instead of running one
forward pass per token.

``forced_bytes(state)`` follows singular edges from ``state`` and returns their labels (b'' when the
state has a choice, is accepting, or has no continuation). A chain stops *on* an accepting state, never
passes through one. ``forced_text(state)`` is the longest prefix of that which is whole UTF-8
characters (``''`` when ``state`` sits inside a multi-byte character, i.e. the last token ended
mid-character: the next token completes it first); jump-forward text must be ``str`` because it is
re-tokenized with the real tokenizer (Appendix B.2).

``edges(state)`` lists the compressed edges leaving ``state`` as ``(label, target)``; ``graph()`` is the
whole compressed FSM reachable from the initial state (for inspection and the Fig. 4 test).
"""

from __future__ import annotations

import numpy as np

from .regex_fsm import ByteDFA

__all__ = ["CompressedFSM", "utf8_complete_prefix_len"]


def utf8_complete_prefix_len(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that ends on a UTF-8 character boundary, assuming
    ``data`` itself starts on one."""
    n = len(data)
    i = n
    # Walk back over at most 3 continuation bytes to the last lead byte.
    k = 0
    while i > 0 and k < 4 and (data[i - 1] & 0xC0) == 0x80:
        i -= 1
        k += 1
    if i == 0:
        return 0 if k else n
    lead = data[i - 1]
    if lead < 0x80:
        need = 1
    elif lead >= 0xF0:
        need = 4
    elif lead >= 0xE0:
        need = 3
    elif lead >= 0xC0:
        need = 2
    else:
        return i - 1
    return n if (n - (i - 1)) >= need else i - 1


class CompressedFSM:
    """Singular-chain analysis of a :class:`ByteDFA` (lazy, memoised per state)."""

    def __init__(self, dfa: ByteDFA, max_forced_len: int = 1 << 16):
        self.dfa = dfa
        t = dfa.transitions
        live = t >= 0
        self.out_degree = live.sum(axis=1).astype(np.int32)
        # For degree-1 states: the single byte and its target.
        first = np.argmax(live, axis=1)
        self.single_byte = np.where(self.out_degree == 1, first, -1).astype(np.int32)
        self.single_next = np.where(self.out_degree == 1, t[np.arange(t.shape[0]), first], -1).astype(np.int32)
        # singular(s): one option only -> the chain continues through s.
        self.singular = (self.out_degree == 1) & ~dfa.accepting
        self.max_forced_len = max_forced_len
        self._memo: dict[int, tuple[bytes, int]] = {}

    def chain(self, state: int) -> tuple[bytes, int]:
        """(forced bytes, state reached at the end of the singular chain) from ``state``."""
        hit = self._memo.get(state)
        if hit is not None:
            return hit
        singular, sbyte, snext = self.singular, self.single_byte, self.single_next
        out = bytearray()
        s = state
        seen = set()
        while singular[s] and len(out) < self.max_forced_len:
            if s in seen:  # cannot happen in a trimmed DFA (a singular cycle never accepts)
                break
            seen.add(s)
            memo = self._memo.get(s)
            if memo is not None and s != state:
                out += memo[0]
                s = memo[1]
                break
            out.append(int(sbyte[s]))
            s = int(snext[s])
        res = (bytes(out), s)
        self._memo[state] = res
        return res

    def forced_bytes(self, state: int) -> bytes:
        return self.chain(state)[0]

    def forced_text(self, state: int) -> str:
        """Whole-character prefix of the forced bytes, as text ('' mid-character or if none)."""
        data = self.forced_bytes(state)
        if not data or (data[0] & 0xC0) == 0x80:
            return ""
        return data[:utf8_complete_prefix_len(data)].decode("utf-8")

    def edges(self, state: int) -> list[tuple[bytes, int]]:
        """Compressed edges out of ``state``: one per outgoing byte, extended through singular chains."""
        row = self.dfa.transitions[state]
        out = []
        for b in np.nonzero(row >= 0)[0].tolist():
            nxt = int(row[b])
            tail, end = self.chain(nxt)
            out.append((bytes([b]) + tail, end))
        return out

    def graph(self) -> dict[int, list[tuple[bytes, int]]]:
        """The compressed FSM: its nodes are the initial state and the targets of compressed edges."""
        g: dict[int, list[tuple[bytes, int]]] = {}
        todo = [self.dfa.initial]
        while todo:
            s = todo.pop()
            if s in g:
                continue
            g[s] = self.edges(s)
            todo.extend(t for _, t in g[s] if t not in g)
        return g
