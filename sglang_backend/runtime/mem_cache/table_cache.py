"""The "no tree" ablation of the paper (Fig. 8c): a table of cached sequences that is only ever reused whole.

Every finished request (and every running prompt, as with the radix cache) becomes one entry: its token
sequence and the KV slots for it. A new request reuses the longest entry whose *whole* sequence is a prefix
of its prompt, i.e. an exact match of a previously cached prompt (or prompt + output, as in a chat's next
turn). Entries are never split: two prompts that share a few-shot header but differ after it share nothing,
unless the header itself was sent as a request (a frontend prefix hint) and so became an entry.

To store no KV twice, an entry keeps only the slots of the tokens after the entry it was built on (its
``parent``); reuse walks that chain. Eviction is LRU over entries nothing else is built on, as in the tree.
The interface is RadixCache's, so the scheduler and the schedule policies use it unchanged (page size 1).
"""

from __future__ import annotations

import itertools
from typing import Hashable, Iterator

import torch

from .base_cache import _EMPTY, CachedKVPool
from .radix_cache import MatchResult, _as_list


class TableEntry:
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: "TableEntry | None", extra_key: Hashable,
                 tick: int):
        self.id = next(TableEntry._ids)
        self.full_key = key  # the whole cached sequence
        self.value = value  # slots of full_key[len(parent.full_key):]
        self.parent = parent
        self.extra_key = extra_key
        self.children: dict[int, list[TableEntry]] = {}  # by the first token after this entry
        self.lock_ref = 0
        self.last_access_time = tick

    @property
    def key(self) -> list[int]:
        """The tokens this entry owns slots for (after its parent's sequence)."""
        start = len(self.parent.full_key) if self.parent is not None else 0
        return self.full_key[start:]

    @property
    def is_leaf(self) -> bool:
        return not self.children


class TableCache(CachedKVPool):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int = 1):
        if page_size != 1:
            raise ValueError("the table cache supports page_size 1 only")
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, 1)

    def _new_root(self) -> TableEntry:
        return TableEntry([], _EMPTY, None, None, 0)

    # ------------------------------------------------------------------ lookup

    def _candidates(self, entry: TableEntry, key: list[int], extra_key: Hashable) -> list[TableEntry]:
        """Children of ``entry`` whose whole sequence is a prefix of ``key`` (slice compares, no token loop)."""
        start = len(entry.full_key)
        if start >= len(key):
            return []
        out = []
        for child in entry.children.get(key[start], ()):
            n = len(child.full_key)
            if n <= len(key) and child.extra_key == extra_key and key[start:n] == child.full_key[start:]:
                out.append(child)
        return out

    def _longest(self, key: list[int], extra_key: Hashable) -> TableEntry:
        best = self.root_node
        stack = self._candidates(self.root_node, key, extra_key)
        while stack:
            entry = stack.pop()
            if len(entry.full_key) > len(best.full_key):
                best = entry
            stack.extend(self._candidates(entry, key, extra_key))
        return best

    def _slots(self, entry: TableEntry) -> torch.Tensor:
        parts = []
        while entry is not None and entry is not self.root_node:
            parts.append(entry.value)
            entry = entry.parent
        return torch.cat(parts[::-1]) if parts else _EMPTY.clone()

    def match_prefix(self, token_ids, extra_key: Hashable = None) -> MatchResult:
        entry = self._longest(_as_list(token_ids), extra_key)
        tick = self._tick()
        node = entry
        while node is not None and node is not self.root_node:
            node.last_access_time = tick
            node = node.parent
        return MatchResult(self._slots(entry), entry)

    def insert(self, token_ids, kv_indices: torch.Tensor, extra_key: Hashable = None,
               base: TableEntry | None = None) -> tuple[TableEntry, int]:
        """Adds ``token_ids`` as an entry built on ``base`` (an entry that is a prefix of it; default: the
        longest one). Returns (the entry now holding the sequence, how many of the given slots it did not
        take: all of them when the sequence was already cached)."""
        key = _as_list(token_ids)
        base = base if base is not None else self._longest(key, extra_key)
        start = len(base.full_key)
        if start == len(key):
            return base, len(key)
        for child in base.children.get(key[start], ()):
            if child.full_key == key and child.extra_key == extra_key:
                child.last_access_time = self._tick()
                return child, len(key)  # the same sequence is already an entry
        value = kv_indices[start : len(key)].to("cpu", torch.int64).clone()
        entry = TableEntry(list(key), value, base, extra_key, self._tick())  # own copy: _as_list may alias
        base.children.setdefault(key[start], []).append(entry)
        self._evictable += len(value)
        return entry, start

    # ------------------------------------------------------------------ eviction (LRU leaves, in the base class)

    def _detach(self, entry: TableEntry) -> None:
        parent = entry.parent
        siblings = parent.children[entry.full_key[len(parent.full_key)]]
        siblings.remove(entry)
        if not siblings:
            del parent.children[entry.full_key[len(parent.full_key)]]

    # ------------------------------------------------------------------ request hooks

    def _store(self, req, token_ids) -> tuple[TableEntry, torch.Tensor]:
        """Files the request's sequence as an entry on top of the entry it matched; frees the slots the
        table does not take. Returns (entry, the request's KV row)."""
        token_ids = _as_list(token_ids)
        n, n_prefix = len(token_ids), len(req.prefix_indices)
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].clone()
        base = req.last_node if req.last_node is not None else self.root_node
        assert len(base.full_key) == n_prefix, "the request's matched entry does not end at its prefix"
        entry, not_taken = self.insert(token_ids, kv, getattr(req, "extra_key", None), base)
        if not_taken > n_prefix:
            self._free(kv[n_prefix:n])  # the sequence was cached already: ours are duplicates
        return entry, kv

    def cache_finished_req(self, req, token_ids) -> None:
        self._store(req, token_ids)
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None

    def cache_unfinished_req(self, req, token_ids) -> None:
        entry, _ = self._store(req, token_ids)
        slots = self._slots(entry)
        self.req_to_token_pool.write(req.req_pool_idx, 0, slots)
        self.inc_lock_ref(entry)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = slots
        req.last_node = entry

    # ------------------------------------------------------------------ checks and debugging

    def _iter_nodes(self) -> Iterator[TableEntry]:
        stack = [c for cs in self.root_node.children.values() for c in cs]
        while stack:
            entry = stack.pop()
            yield entry
            stack.extend(c for cs in entry.children.values() for c in cs)

    def check_invariants(self) -> None:
        evictable = protected = 0
        slots = []
        for e in self._iter_nodes():
            assert e.parent is not None and e.full_key[: len(e.parent.full_key)] == e.parent.full_key
            assert len(e.value) == len(e.full_key) - len(e.parent.full_key) > 0
            if e.lock_ref:
                protected += len(e.value)
            else:
                evictable += len(e.value)
            slots.append(e.value)
        assert (evictable, protected) == (self._evictable, self._protected), "sizes drifted"
        if slots:
            all_slots = torch.cat(slots)
            assert len(torch.unique(all_slots)) == len(all_slots), "a KV slot is held by two entries"

    def debug_nodes(self) -> list[dict]:
        return [{"id": e.id, "len": len(e.full_key), "own": len(e.value), "lock_ref": e.lock_ref}
                for e in self._iter_nodes()]

    def debug_tree(self, extra_key: Hashable = None) -> dict:
        return {}

    def pretty_print(self) -> None:
        for d in self.debug_nodes():
            print(d)
