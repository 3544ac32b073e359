"""What the radix tree and the exact-match table (its ablation) share: KV slot accounting, lock references
along the path to the root, and LRU eviction of unlocked leaves.

A node here is anything with ``value`` (the KV slots it owns), ``parent``, ``is_leaf``, ``lock_ref``,
``last_access_time`` and ``id``; a subclass says how to make a root (``_new_root``), how to unhook a node from
its parent (``_detach``) and how to walk its nodes (``_iter_nodes``).
"""

from __future__ import annotations

import heapq

import torch

_EMPTY = torch.empty(0, dtype=torch.int64)


class CachedKVPool:
    disable = False

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.num_evicted_tokens = 0  # cumulative over the cache's life, flushes included
        self.root_node = None
        self.reset()

    def _new_root(self):
        raise NotImplementedError

    def _detach(self, node) -> None:
        raise NotImplementedError

    def _iter_nodes(self):
        raise NotImplementedError

    # ------------------------------------------------------------------ accounting

    def reset(self) -> None:
        if self.root_node is not None:
            assert self._protected == 0, "reset() while requests still lock cached prefixes"
            self._free([node.value for node in self._iter_nodes()])
        self.root_node = self._new_root()
        self._evictable = 0
        self._protected = 0
        self._clock = 0

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def _tick(self) -> int:
        # A counter, not wall time: strictly ordered and deterministic in tests.
        self._clock += 1
        return self._clock

    def _free(self, slots) -> None:
        if isinstance(slots, list):
            slots = torch.cat(slots) if slots else _EMPTY
        if len(slots) and self.token_to_kv_pool_allocator is not None:
            self.token_to_kv_pool_allocator.free(slots)

    # ------------------------------------------------------------------ eviction and locking

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._iter_nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, slots = 0, []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._detach(node)
            node.parent = None
            slots.append(node.value)
            freed += len(node.value)
            self._evictable -= len(node.value)
            # Leaves first: a shared ancestor goes only once nothing below it is left.
            if parent is not self.root_node and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        self._free(slots)
        self.num_evicted_tokens += freed
        return freed

    def inc_lock_ref(self, node) -> None:
        while node is not None and node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
                self._protected += len(node.value)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node) -> None:
        while node is not None and node is not self.root_node:
            assert node.lock_ref > 0, f"unlocking an unlocked node {node}"
            if node.lock_ref == 1:
                self._protected -= len(node.value)
                self._evictable += len(node.value)
            node.lock_ref -= 1
            node = node.parent
