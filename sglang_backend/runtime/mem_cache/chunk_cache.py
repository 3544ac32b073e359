"""The cache used with --disable-radix-cache: same interface as RadixCache, but it never shares KV.

Nothing is kept between requests. A running request keeps its own slots across prefill chunks
(``cache_unfinished_req`` only records them as its prefix) and frees them all when it finishes.
"""

from __future__ import annotations

from typing import Hashable

import torch

from .radix_cache import MatchResult, TreeNode, _as_list


class ChunkCache:
    disable = True

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int = 1):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.num_evicted_tokens = 0
        self.root_node = TreeNode()  # sentinel returned as last_node; locking it is a no-op

    def reset(self) -> None:
        pass

    def match_prefix(self, token_ids, extra_key: Hashable = None) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), self.root_node)

    def insert(self, token_ids, kv_indices: torch.Tensor, extra_key: Hashable = None) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node) -> None:
        pass

    def dec_lock_ref(self, node) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def cache_finished_req(self, req, token_ids) -> None:
        n = len(_as_list(token_ids))
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].clone()
        if n:
            self.token_to_kv_pool_allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None

    def cache_unfinished_req(self, req, token_ids) -> None:
        # The slots stay with the request; the next chunk only needs to know they hold its prefix.
        n = len(_as_list(token_ids))
        req.prefix_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].clone()

    def check_invariants(self) -> None:
        assert not self.root_node.children

    def debug_nodes(self) -> list[dict]:
        return []

    def debug_tree(self, extra_key: Hashable = None) -> dict:
        return {}

    def pretty_print(self) -> None:
        print("ChunkCache (radix cache disabled): nothing cached")
