"""RadixAttention's prefix cache: a radix tree over token ids whose nodes hold KV slot indices.

Each edge carries a run of token ids (``node.key``) and the KV slots that hold their K/V (``node.value``,
same length). A path from the root spells a cached prefix; ``match_prefix`` finds the longest one and
returns its slots so prefill only has to compute the rest.

* Sharing is in whole pages: every edge length is a multiple of ``page_size`` and children are keyed by
  their first page, so a KV page belongs to exactly one node (or one request, or the free list).
* Namespaces: the root's children are keyed by ``(extra_key, first_page)``, so keys with different
  ``extra_key`` (image hash, LoRA id, cache salt; ``None`` is a namespace too) never share a node.
* Running requests lock the path to their matched prefix (``lock_ref`` counts); only unlocked leaves are
  evicted, least recently used first, and a parent that becomes an unlocked leaf is evicted in turn.
* ``evictable_size`` / ``protected_size`` are kept exact incrementally; ``check_invariants`` recounts.
* A second tier (``host``, a ``HostKVPool``): eviction then copies a leaf's KV to host memory and keeps the node
  (``value`` empty, ``host_value`` its host slots) instead of dropping it. ``match_prefix`` returns the device part
  of a match and says how far it goes on into host-only nodes; ``load_back`` copies that part to fresh device slots.
  Nodes on the device always form a prefix-closed subtree (a host-only node's children are host-only), a node that
  was loaded back keeps its host copy (evicting it again costs no copy), and when the host is full the least
  recently used host copies go: host-only leaves leave the tree, device nodes just lose their backup. A load may be
  asynchronous (``load_back(wait=False)``): its path stays locked and ``loading_on_path`` says so until
  ``poll_loads`` sees its copy done; nobody may compute on those slots before.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Hashable, Iterator

import torch

from .base_cache import _EMPTY, CachedKVPool



_SCAN_BLOCK = 64  # tokens compared per slice when looking for where two token lists part


def _as_list(token_ids) -> list[int]:
    """The ids as a list the tree may read but never keeps (nodes store slices, i.e. copies)."""
    if type(token_ids) is list:
        return token_ids
    # Tensors must become plain ints: tensor scalars hash by identity and would never match a dict key.
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return list(token_ids)


class TreeNode:
    _ids = itertools.count()

    __slots__ = ("id", "key", "value", "host_value", "children", "parent", "lock_ref", "last_access_time", "extra_key")

    def __init__(
        self,
        key: list[int] | None = None,
        value: torch.Tensor | None = None,
        parent: TreeNode | None = None,
        extra_key: Hashable = None,
        last_access_time: int = 0,
    ):
        self.id = next(TreeNode._ids)  # unique, breaks ties in the eviction heap
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else _EMPTY  # device slots; empty: host-only
        self.host_value: torch.Tensor | None = None  # host slots of a copy in the second tier
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.extra_key = extra_key

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def on_host_only(self) -> bool:
        return self.host_value is not None and len(self.value) == 0

    def __repr__(self) -> str:
        key = self.key if len(self.key) <= 8 else self.key[:8] + ["..."]
        return f"TreeNode(id={self.id}, key={key}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class HostLoad:
    """A load back from the host still copying: ``end``'s path stays locked until ``done`` (an event) is."""

    done: Any
    end: TreeNode
    node_ids: frozenset[int]  # TreeNode.id of the nodes being filled


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # KV slots of the matched prefix (cpu int64)
    last_node: TreeNode  # node whose path ends exactly at the matched length (root if nothing matched)
    host_hit_len: int = 0  # tokens the match goes on for in host-only nodes (second tier), after device_indices
    last_host_node: TreeNode | None = None  # where that host part ends (``load_back`` takes it)


class RadixCache(CachedKVPool):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int = 1, host=None):
        if token_to_kv_pool_allocator is not None:
            assert token_to_kv_pool_allocator.page_size == page_size, "tree and allocator disagree on page_size"
        self.host = host  # HostKVPool (second tier) or None
        self.num_host_evicted_tokens = 0  # host copies dropped for room, cumulative
        self.loads: list[HostLoad] = []  # asynchronous loads back still copying, oldest first
        self._loading_ids: set[int] = set()
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)

    # ------------------------------------------------------------------ basics

    def _new_root(self) -> TreeNode:
        return TreeNode()

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _child_key(self, parent: TreeNode, key: list[int], pos: int, extra_key: Hashable):
        first = key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])
        # The namespace only needs to separate the root's children: everything below inherits it.
        return (extra_key, first) if parent is self.root_node else first

    def _common_len(self, edge: list[int], key: list[int], pos: int) -> int:
        """Leading tokens shared by ``edge`` and ``key[pos:]``, rounded down to whole pages."""
        n = min(len(edge), len(key) - pos)
        if edge[:n] == key[pos : pos + n]:  # the usual case, compared in C
            return self._aligned(n)
        # Narrow to the first differing block by slice comparisons, then scan that block token by token.
        i = 0
        while n - i > _SCAN_BLOCK and edge[i : i + _SCAN_BLOCK] == key[pos + i : pos + i + _SCAN_BLOCK]:
            i += _SCAN_BLOCK
        while i < n and edge[i] == key[pos + i]:
            i += 1
        return self._aligned(i)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node.

        The lower half keeps the original node object, so a request holding it as ``last_node`` still
        points at the end of its prefix. The upper half inherits lock_ref (every lock through the child
        also passes through it) and the access time, so sizes and LRU order are unchanged.
        """
        parent = child.parent
        upper = TreeNode(child.key[:n], child.value[:n], parent, child.extra_key, child.last_access_time)
        upper.lock_ref = child.lock_ref
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        parent.children[self._child_key(parent, child.key, 0, child.extra_key)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[self._child_key(upper, child.key, 0, child.extra_key)] = child
        return upper

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, token_ids, extra_key: Hashable = None) -> MatchResult:
        key = _as_list(token_ids)
        aligned = self._aligned(len(key))
        if aligned < len(key):
            key = key[:aligned]
        tick = self._tick()
        node, pos, values = self.root_node, 0, []
        walk = node  # the deepest matched node, on either tier; ``node`` stays the deepest on the device
        host_node, host_len = None, 0
        while pos < len(key):
            child = walk.children.get(self._child_key(walk, key, pos, extra_key))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)  # >= one page: the first page matched the dict key
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = tick
            pos += n
            walk = child
            if child.on_host_only:  # and so is everything below it
                host_node, host_len = child, host_len + n
            else:
                values.append(child.value)
                node = child
        indices = torch.cat(values) if values else _EMPTY.clone()
        return MatchResult(indices, node, host_len, host_node)

    def insert(self, token_ids, kv_indices: torch.Tensor, extra_key: Hashable = None) -> int:
        return self._insert(token_ids, kv_indices, extra_key)[0]

    def _insert(self, token_ids, kv_indices: torch.Tensor, extra_key: Hashable = None) -> tuple[int, list, TreeNode]:
        """Insert the page-aligned part; returns (how many leading tokens were already cached on the device, the
        slot tensors of the nodes along the key's path, the node where the key ends): the path is what a match of
        the same key would return. Host-only nodes on the path take the given slots as they are (the caller's KV
        becomes theirs; their host copy stays)."""
        key = _as_list(token_ids)
        aligned = self._aligned(len(key))
        key = key[:aligned]
        assert len(kv_indices) >= aligned, "fewer KV slots than tokens"
        # Own copy: callers often pass a view of a req_to_token row that will be reused.
        value = kv_indices[:aligned].to("cpu", torch.int64).clone()
        tick = self._tick()
        node, pos, path = self.root_node, 0, []
        present = None  # where the first host-only node on the path starts (None: none met)
        while pos < aligned:
            ck = self._child_key(node, key, pos, extra_key)
            child = node.children.get(ck)
            if child is None:
                leaf = TreeNode(key[pos:], value[pos:], node, extra_key, tick)
                node.children[ck] = leaf
                self._evictable += len(leaf.key)  # new nodes start unlocked
                path.append(leaf.value)
                return (pos if present is None else present), path, leaf
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = tick
            if child.on_host_only:
                present = pos if present is None else present
                child.value = value[pos : pos + n].clone()
                self._count_device_tokens(child, n)
            path.append(child.value)
            pos += n
            node = child
        return (pos if present is None else present), path, node

    def _count_device_tokens(self, node: TreeNode, n: int) -> None:
        """``n`` device tokens came to ``node`` (loaded back, or taken over from a request)."""
        if node.lock_ref > 0:
            self._protected += n
        else:
            self._evictable += n

    # ------------------------------------------------------------------ eviction (LRU leaves, in the base class)

    def _detach(self, node: TreeNode) -> None:
        del node.parent.children[self._child_key(node.parent, node.key, 0, node.extra_key)]

    # ------------------------------------------------------------------ the second tier (host memory)

    def reset(self) -> None:
        if self.host is not None and self.root_node is not None:
            held = [n.host_value for n in self._iter_nodes() if n.host_value is not None]
            if held:
                self.host.free(torch.cat(held))
        super().reset()

    @staticmethod
    def _device_leaf(node: TreeNode) -> bool:
        """On the device, unlocked, and nothing below it on the device: what device eviction may take next."""
        return len(node.value) > 0 and node.lock_ref == 0 and not any(len(c.value) for c in node.children.values())

    def evict(self, num_tokens: int) -> int:
        """Frees at least ``num_tokens`` device slots if it can (LRU device leaves first). With a host tier the
        evicted nodes stay in the tree with their KV copied to host memory (one copy for the whole call); without
        one they leave it."""
        if self.host is None:
            return super().evict(num_tokens)
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._device_nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed, slots, backups = 0, [], []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if not self._backup(node, backups):
                self._drop_subtree(node)  # the host is full of locked copies: this node's KV goes, as without a tier
            slots.append(node.value)
            freed += len(node.value)
            self._evictable -= len(node.value)
            node.value = _EMPTY
            if parent is not self.root_node and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        self._copy_backups(backups)  # before the slots are freed: the gather is queued ahead of any reuse
        self._free(slots)
        self.num_evicted_tokens += freed
        return freed

    def _device_nodes(self) -> Iterator[TreeNode]:
        """The nodes on the device (all but the root). A host-only node has only host-only nodes below it, so
        the walk never enters the host tier's part of the tree, which may be many times larger."""
        stack = [c for c in self.root_node.children.values() if len(c.value)]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(c for c in node.children.values() if len(c.value))

    def _backup(self, node: TreeNode, backups: list) -> bool:
        """Gives a device node host slots for a copy (it may have one already); the copy itself is queued in
        ``backups`` (device slots, host slots) for ``_copy_backups``. False: no host room."""
        if node.host_value is not None:
            return True
        n = len(node.value)
        short = n - self.host.available_size()
        if short > 0:
            self._copy_backups(backups)  # queued before host_evict may hand their rows to another node
            self.evict_host(short)
        host_slots = self.host.alloc(n)
        if host_slots is None:
            return False
        backups.append((node.value, host_slots))
        node.host_value = host_slots
        return True

    def _copy_backups(self, backups: list) -> None:
        if backups:
            self.host.backup(torch.cat([d for d, _ in backups]), torch.cat([h for _, h in backups]))
            backups.clear()

    def _drop_subtree(self, node: TreeNode) -> None:
        """Takes ``node`` (a device leaf being evicted) and its host-only descendants out of the tree, host copies
        freed; the caller frees ``node``'s device slots."""
        self._detach(node)
        stack, held = [node], []
        while stack:
            cur = stack.pop()
            if cur.host_value is not None:
                held.append(cur.host_value)
                cur.host_value = None
            stack.extend(cur.children.values())
        if held:
            self.host.free(torch.cat(held))
            self.num_host_evicted_tokens += sum(len(h) for h in held)

    def evict_host(self, num_tokens: int) -> int:
        """Frees at least ``num_tokens`` host slots if it can, least recently used copies first: a host-only leaf
        leaves the tree (then perhaps its parent), a node also on the device only loses its backup."""
        heap = [(n.last_access_time, n.id, n) for n in self._iter_nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed, held = 0, []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            held.append(node.host_value)
            freed += len(node.host_value)
            node.host_value = None
            if len(node.value) == 0:  # host-only: nothing holds its KV any more
                parent = node.parent
                self._detach(node)
                node.parent = None
                if parent is not self.root_node and self._host_evictable(parent):
                    heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if held:
            self.host.free(torch.cat(held))
        self.num_host_evicted_tokens += freed
        return freed

    @staticmethod
    def _host_evictable(node: TreeNode) -> bool:
        if node.host_value is None:
            return False
        if len(node.value):
            return True  # the device copy stays
        return node.lock_ref == 0 and not node.children  # host-only: a leaf not being loaded back

    def load_back(self, host_node: TreeNode, alloc, wait: bool = True) -> bool:
        """Copies the host-only path ending at ``host_node`` (a ``MatchResult.last_host_node``) to device slots from
        ``alloc(n)`` (which may evict); afterwards a match reaches it on the device. False: no device room.
        ``wait=False``: the copy runs on while the call returns; until ``poll_loads`` sees it done, the path stays
        locked and ``loading_on_path`` is true below it (nothing may read the slots)."""
        chain, cur = [], host_node
        while cur.on_host_only:
            chain.append(cur)
            cur = cur.parent
        chain.reverse()
        n = sum(len(c.key) for c in chain)
        self.inc_lock_ref(host_node)  # neither tier may evict the path while the slots are found
        done = None
        try:
            slots = alloc(n)
            if slots is None:
                return False
            done = self.host.restore(torch.cat([c.host_value for c in chain]), slots, wait=wait)
            offset = 0
            for c in chain:
                c.value = slots[offset : offset + len(c.key)].clone()
                self._count_device_tokens(c, len(c.key))
                offset += len(c.key)
            return True
        finally:
            if done is None:
                self.dec_lock_ref(host_node)
            else:
                ids = frozenset(c.id for c in chain)
                self.loads.append(HostLoad(done, host_node, ids))
                self._loading_ids |= ids

    def poll_loads(self) -> int:
        """Ends the asynchronous loads whose copies are done (their paths unlock); returns how many are left."""
        left = []
        for load in self.loads:
            if load.done.query():
                self.dec_lock_ref(load.end)
                self._loading_ids -= load.node_ids
            else:
                left.append(load)
        self.loads = left
        return len(left)

    def wait_for_load(self) -> bool:
        """Blocks until the oldest asynchronous load is done and ends it. False: none in flight."""
        if not self.loads:
            return False
        self.loads[0].done.synchronize()
        self.poll_loads()
        return True

    def loading_on_path(self, node: TreeNode) -> bool:
        """Whether a node on the path from the root to ``node`` is still being loaded back."""
        while self._loading_ids and node is not None:
            if node.id in self._loading_ids:
                return True
            node = node.parent
        return False

    def host_held_tokens(self) -> int:
        """Host slots the tree's nodes hold (counted by walking the tree)."""
        return sum(len(n.host_value) for n in self._iter_nodes() if n.host_value is not None)

    def host_report(self) -> dict:
        if self.host is None:
            return {}
        used = self.host.size - self.host.available_size()
        return {"kv_host_total_tokens": self.host.size, "kv_host_used_tokens": used,
                "kv_host_written_tokens": self.host.written_tokens, "kv_host_loaded_tokens": self.host.loaded_tokens,
                "kv_host_evicted_tokens": self.num_host_evicted_tokens, "kv_host_loads_in_flight": len(self.loads)}

    # ------------------------------------------------------------------ request hooks

    def cache_finished_req(self, req, token_ids) -> TreeNode:
        """Hand a finished request's KV to the tree; free what the tree cannot or need not keep. Returns the node
        where the cached (page-aligned) sequence ends (a session pin locks its path)."""
        token_ids = _as_list(token_ids)
        n, aligned, n_prefix = len(token_ids), self._aligned(len(token_ids)), len(req.prefix_indices)
        assert n >= n_prefix
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].clone()
        present, _, last = self._insert(token_ids[:aligned], kv[:aligned], getattr(req, "extra_key", None))
        assert present >= n_prefix, "the locked prefix vanished from the tree"
        # [n_prefix, present): another request cached these tokens meanwhile; ours are duplicates.
        # [aligned, n): a partial page cannot be shared, so it is not cached.
        self._free([kv[n_prefix:present], kv[aligned:]])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        return last

    def cache_unfinished_req(self, req, token_ids) -> None:
        """Cache a running request's KV so far (chunked prefill / sharing a prompt) and re-lock it.

        Afterwards the request's row points at the tree's slots for the page-aligned part; the partial
        last page stays owned by the request.
        """
        token_ids = _as_list(token_ids)
        n, aligned, n_prefix = len(token_ids), self._aligned(len(token_ids)), len(req.prefix_indices)
        assert n >= n_prefix
        row = req.req_pool_idx
        kv = self.req_to_token_pool.req_to_token[row, :aligned].clone()
        present, path, last = self._insert(token_ids[:aligned], kv, getattr(req, "extra_key", None))
        assert present >= n_prefix, "the locked prefix vanished from the tree"
        indices = torch.cat(path) if path else _EMPTY.clone()
        assert len(indices) == aligned
        # [n_prefix, present): another request cached these tokens meanwhile; ours are duplicates, freed, and the
        # row takes the tree's. The rest of the row already holds the tree's slots (the locked prefix, and the
        # slots the insert just took over as they are).
        self._free(kv[n_prefix:present])
        if present > n_prefix:
            self.req_to_token_pool.write(row, n_prefix, indices[n_prefix:present])
        self.inc_lock_ref(last)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = indices
        req.last_node = last

    # ------------------------------------------------------------------ debugging

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """All nodes except the root, parents before children."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _recount(self) -> tuple[int, int]:
        """(evictable, protected) by walking the tree."""
        evictable = protected = 0
        for node in self._iter_nodes():
            if node.lock_ref > 0:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        return evictable, protected

    def check_invariants(self) -> None:
        ps = self.page_size
        root = self.root_node
        assert root.parent is None and root.lock_ref == 0 and not root.key
        slots, host_slots = [], []
        for node in self._iter_nodes():
            parent = node.parent
            assert parent is not None, f"{node} has no parent"
            assert len(node.key) > 0 and len(node.key) % ps == 0, f"{node}: empty or not whole pages"
            if node.on_host_only:
                assert self.host is not None, f"{node}: host-only without a host tier"
                assert all(c.on_host_only for c in node.children.values()), f"{node}: a device node under a host-only one"
            else:
                assert len(node.value) == len(node.key), f"{node}: {len(node.value)} slots for {len(node.key)} tokens"
            if node.host_value is not None:
                assert len(node.host_value) == len(node.key), f"{node}: {len(node.host_value)} host slots"
                host_slots.append(node.host_value)
            # Stored under its own first page, so two children can never share one (dict keys are unique).
            assert parent.children.get(self._child_key(parent, node.key, 0, node.extra_key)) is node, (
                f"{node} is not filed under its first page in its parent"
            )
            if parent is not root:
                assert node.extra_key == parent.extra_key, f"{node} left its parent's namespace"
                # Every access to a node also touches its ancestors, so parents are never older.
                assert parent.last_access_time >= node.last_access_time, f"{node} is newer than its parent"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), f"{node}: lock_ref too small"
            slots.append(node.value)
        evictable, protected = self._recount()
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes drifted: counted {(evictable, protected)}, tracked {(self._evictable, self._protected)}"
        )
        if slots:
            all_slots = torch.cat(slots)
            assert len(torch.unique(all_slots)) == len(all_slots), "a KV slot is held by two tree positions"
            assert int(all_slots.min()) >= ps, "the tree holds the reserved padding page"
            alloc = self.token_to_kv_pool_allocator
            if alloc is not None:
                pages = torch.unique(all_slots // ps)
                assert not torch.isin(pages, alloc.free_pages).any(), "a cached KV page is also on the free list"
        if self.host is not None:
            held = torch.cat(host_slots) if host_slots else _EMPTY
            assert len(torch.unique(held)) == len(held), "a host slot is held by two tree positions"
            assert not torch.isin(held, self.host.free_slots).any(), "a held host slot is also free"
            assert len(held) + self.host.available_size() == self.host.size, (
                f"host slots: {len(held)} held + {self.host.available_size()} free != {self.host.size}")

    def debug_nodes(self) -> list[dict]:
        """One dict per node (DFS, children sorted by key): path and edge tokens, slots, lock, namespace."""
        out = []

        def walk(node: TreeNode, path: tuple, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: (repr(c.extra_key), c.key)):
                child_path = path + tuple(child.key)
                out.append(
                    {
                        "depth": depth,
                        "key": tuple(child.key),
                        "path": child_path,
                        "value": child.value.tolist(),
                        "lock_ref": child.lock_ref,
                        "extra_key": child.extra_key,
                        "last_access_time": child.last_access_time,
                    }
                )
                walk(child, child_path, depth + 1)

        walk(self.root_node, (), 0)
        return out

    def debug_tree(self, extra_key: Hashable = None) -> dict:
        """The shape of one namespace as nested dicts: {edge tokens (tuple): {child edge: ...}}."""

        def walk(node: TreeNode) -> dict:
            return {tuple(c.key): walk(c) for c in node.children.values()}

        return {tuple(c.key): walk(c) for c in self.root_node.children.values() if c.extra_key == extra_key}

    def pretty_print(self) -> None:
        for d in self.debug_nodes():
            key = list(d["key"]) if len(d["key"]) <= 16 else list(d["key"][:16]) + ["..."]
            ns = f" ns={d['extra_key']!r}" if d["depth"] == 0 and d["extra_key"] is not None else ""
            print(f"{'  ' * d['depth']}{key} len={len(d['key'])} lock={d['lock_ref']} t={d['last_access_time']}{ns}")
        print(f"#tokens: {self.total_size()} (evictable {self._evictable}, protected {self._protected})")
