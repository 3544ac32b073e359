"""Waiting-queue order: which requests to try first when forming a prefill batch.

* ``lpm``: longest cached-prefix match first (maximises reuse now).
* ``dfs-weight``: depth-first over the radix tree, heavier subtrees first (Theorem 3.1: a DFS order over the
  request tree reaches the optimal hit rate when the cache holds the longest request).
* ``fcfs`` / ``random``: ablations.

On top of any policy: program-level priority (``ProgramService``: programs served least go first, the policy's
order within a level), the starvation bound (a request skipped ``starvation_limit`` rounds goes first, in
arrival order), and in-batch prefix dedup (see ``InBatchPrefixIndex``).
"""

from __future__ import annotations

import random
from collections import defaultdict

from .program_service import ProgramService
from .schedule_batch import Req

# Below this many tokens of shared uncached prefix, holding a request back is not worth a round trip.
IN_BATCH_DEDUP_MIN_TOKENS = 32
# Below this many tokens, a match that goes on in host memory (second tier) counts for nothing: the request computes
# those tokens (fewer than a copy back is worth) and is ordered by its device match alone. Evicted KV stays in the
# tree as host-only nodes until the host fills, so the node where a shared prefix ends gathers a child for each first
# token that prompts went on with (an Evaluate run's examples after their common demos): most newcomers then "hit" a
# word or two of an unrelated example there, and counting that as a cached prefix put them ahead of the older
# requests that hit none, round after round (one Evaluate example waited ~35 s behind 50 later ones).
MIN_HOST_HIT_TOKENS = 16


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache, starvation_limit: int = 64, seed: int = 0,
                 programs: ProgramService | None = None):
        self.policy = policy
        self.tree_cache = tree_cache
        self.starvation_limit = starvation_limit
        self.rng = random.Random(seed)
        self.programs = programs

    def match(self, req: Req) -> None:
        """Refresh the request's cached prefix from the tree (cheap; the tree may have changed)."""
        result = self.tree_cache.match_prefix(_ids_through(req, req.max_prefix_len()), extra_key=req.extra_key)
        req.prefix_indices, req.last_node = result.device_indices, result.last_node
        # A hit in host memory costs a copy, not a prefill: it counts for the order as a device hit does, if it is
        # long enough to be more than a coincidence (MIN_HOST_HIT_TOKENS).
        host_hit = result.host_hit_len if result.host_hit_len >= MIN_HOST_HIT_TOKENS else 0
        req.last_host_node = result.last_host_node if host_hit else None
        req.prefix_len_at_match = len(req.prefix_indices) + host_hit

    def matches_when_ordering(self) -> bool:
        """Whether ``order`` matches every waiting request against the tree (the cache-aware policies)."""
        return not self.tree_cache.disable and self.policy in ("lpm", "dfs-weight")

    def order(self, waiting: list[Req]) -> list[Req]:
        if self.policy == "random":
            ordered = list(waiting)
            self.rng.shuffle(ordered)
        elif not self.matches_when_ordering():
            ordered = list(waiting)  # fcfs, or a cache-aware policy without a cache (every match empty): FCFS
        else:
            for req in waiting:
                self.match(req)
            if self.policy == "lpm":
                # Stable sort keeps arrival order among equal matches.
                ordered = sorted(waiting, key=lambda r: -r.prefix_len_at_match)
            else:
                ordered = self._dfs_weight(waiting)
        if self.programs is not None:
            ordered = self.programs.prioritise(ordered)
        starved = [r for r in ordered if r.skipped_rounds >= self.starvation_limit]
        if starved:
            starved.sort(key=lambda r: r.created_time)
            ids = {id(r) for r in starved}
            ordered = starved + [r for r in ordered if id(r) not in ids]
        return ordered

    def _dfs_weight(self, waiting: list[Req]) -> list[Req]:
        """Group requests by the tree node their match ends at; visit the tree depth-first, children with
        more waiting requests below them first, emitting each node's requests after its subtree's."""
        at_node: dict[int, list[Req]] = defaultdict(list)
        nodes = {}
        for r in waiting:
            at_node[id(r.last_node)].append(r)
            nodes[id(r.last_node)] = r.last_node
        weight: dict[int, int] = defaultdict(int)
        children: dict[int, list] = defaultdict(list)
        root = self.tree_cache.root_node
        for key, node in nodes.items():
            n = len(at_node[key])
            cur = node
            while cur is not None:
                weight[id(cur)] += n
                parent = cur.parent
                if parent is not None and cur not in children[id(parent)]:
                    children[id(parent)].append(cur)
                cur = parent
        ordered: list[Req] = []

        def visit(node):
            # Post-order: requests matching deeper (more of their prompt cached) go before shallower ones.
            for child in sorted(children.get(id(node), []), key=lambda c: -weight[id(c)]):
                visit(child)
            ordered.extend(at_node.get(id(node), []))

        visit(root)
        # Requests whose node is not reachable from the root (should not happen) keep arrival order.
        seen = {id(r) for r in ordered}
        return ordered + [r for r in waiting if id(r) not in seen]


def ids_through(req: Req, need: int) -> list[int]:
    """A list whose first ``need`` ids are the request's (the prompt, then any output: a retracted request's prompt
    grew); the prompt itself, uncopied, when it is long enough."""
    return req.origin_input_ids if len(req.origin_input_ids) >= need else req.all_ids


def _ids_through(req: Req, need: int) -> list[int]:
    """The request's first ``need`` token ids."""
    return ids_through(req, need)[:need]


def common_len(a: list[int], b: list[int], start: int, end: int) -> int:
    """How many ids from ``start`` on ``a`` and ``b`` share, up to ``end``: slices compared in C, in blocks that
    double while they agree, then the first differing block halved down to 8 ids, then id by id."""
    i, step = start, 64
    while i < end:
        j = min(i + step, end)
        if a[i:j] != b[i:j]:
            break
        i, step = j, step * 2
    else:
        return max(end - start, 0)
    while j - i > 8:  # a[i:j] differs somewhere: keep the half that does
        mid = (i + j) // 2
        if a[i:mid] == b[i:mid]:
            i = mid
        else:
            j = mid
    while i < j and a[i] == b[i]:
        i += 1
    return i - start


class InBatchPrefixIndex:
    """The requests admitted to the prefill batch being formed, for in-batch prefix dedup: a waiting request
    that shares at least IN_BATCH_DEDUP_MIN_TOKENS not-yet-cached prefix tokens with an admitted one is held
    back one round, so that it hits the KV that request is about to compute instead of computing it twice.

    Admitted prompts are indexed by the window of IN_BATCH_DEDUP_MIN_TOKENS ids that starts where the asking
    request's cached prefix ends (one table per such start, built on first use), so a question costs one dict
    lookup plus a full comparison only for real candidates. Comparing each waiting request with every admitted
    one cost O(n^2) slices of the whole prefix: tens of milliseconds for 128 requests on a 1k-token prefix."""

    def __init__(self):
        self.reqs: list[Req] = []
        self.by_start: dict[int, dict[tuple, list[Req]]] = {}

    def add(self, req: Req) -> None:
        self.reqs.append(req)
        for start, table in self.by_start.items():
            self._put(table, start, req)

    @staticmethod
    def _put(table: dict, start: int, req: Req) -> None:
        need = start + IN_BATCH_DEDUP_MIN_TOKENS
        if req.seq_len >= need:
            table.setdefault((req.extra_key, tuple(_ids_through(req, need)[start:])), []).append(req)

    def shares_uncached_prefix(self, req: Req) -> bool:
        return self.sharer(req) is not None

    def sharer(self, req: Req) -> Req | None:
        """An admitted request whose prompt goes on like ``req``'s for at least IN_BATCH_DEDUP_MIN_TOKENS ids past
        ``req``'s cached prefix, or None: the latest admitted such one, which in arrival order is usually the one
        sharing the most (the endings of one question after another's; comparing them all would cost O(n^2))."""
        start = len(req.prefix_indices)
        need = start + IN_BATCH_DEDUP_MIN_TOKENS
        if req.seq_len < need or not self.reqs:
            return None
        table = self.by_start.get(start)
        if table is None:
            table = self.by_start[start] = {}
            for other in self.reqs:
                self._put(table, start, other)
        head = _ids_through(req, need)
        candidates = table.get((req.extra_key, tuple(head[start:])), ())
        return next((other for other in reversed(candidates) if _ids_through(other, need) == head), None)


_DECODED = object()  # trie mark: this prefix's last token was produced by decoding, not by a prompt


def optimal_hit_rate(requests: list[tuple]) -> float:
    """The best possible prompt-cache hit rate for a set of (namespace, prompt ids) with a cache that holds
    everything (Theorem 3.1): each token of the request tree is computed once. One refinement for a real
    engine: a request always computes at least its last token (its logits are sampled), so every exact
    duplicate of an earlier prompt still costs one token.

    An entry may carry a third item, the request's output ids. Decoding computes the KV of every generated
    token but the last, so a later prompt that contains them (chat history, a DSL program's next call) can
    hit those tokens without any prefill: they cost nothing."""
    total = sum(len(r[1]) for r in requests)
    if total == 0:
        return 0.0
    decoded: dict = {}
    for ns, ids, *out in requests:
        if out and len(out[0]) > 1:
            node = decoded.setdefault(("ns", ns), {})
            for i, t in enumerate([*ids, *out[0][:-1]]):
                node = node.setdefault(t, {})
                if i >= len(ids):
                    node[_DECODED] = True
    trie: dict = {}
    computed = 0
    # Lexicographic order puts every prompt before its extensions, the order that needs the fewest tokens.
    for ns, ids, *_ in sorted(requests, key=lambda r: (repr(r[0]), list(r[1]))):
        node = trie.setdefault(("ns", ns), {})
        dnode = decoded.get(("ns", ns))
        new_tokens = 0
        for t in ids:
            dnode = dnode.get(t) if dnode is not None else None
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                if dnode is None or _DECODED not in dnode:
                    new_tokens += 1
            node = nxt
        computed += max(new_tokens, 1 if ids else 0)
    return 1.0 - computed / total
