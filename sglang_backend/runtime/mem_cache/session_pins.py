"""Session pins: a live program's KV kept between its calls.

A request that names a ``session_id`` leaves, when it finishes (stop or length, not an abort), a pin on the radix
tree node where its sequence ends: the path from the root to that node stays locked, so eviction cannot take it.
The pin lasts until the session's next request finishes (the pin moves to that request's sequence), the session
ends (``end``), its time to live passes, or the scheduler needs the memory for work it could not otherwise run
(the oldest pins go first). A program whose tool is running, or whose user is thinking, thus finds its prefix
cached when it calls again, while eviction takes the KV of finished programs and of sessions without a pin first.

Time to live: ``ttl`` seconds if given; else adaptive: twice the 90th percentile of the gaps seen between one
of a session's requests finishing and the session's next request arriving (the last 256 gaps, also those longer
than the time to live then in force, whose pins had expired: an agent's slow tool calls must raise it), kept within
[``MIN_TTL_S``, ``ttl_max``], and ``DEFAULT_TTL_S`` before any gap is seen. The tokens under all pins together are
bounded by ``max_tokens``: a new pin that passes the bound releases the oldest pins; one that alone passes it is
not taken. A session whose last call reused only part of its pin (calls that share a prefix without extending each
other) has its next pins cut back to the prefix that call reused.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

MIN_TTL_S = 1.0
DEFAULT_TTL_S = 10.0
GAP_WINDOW = 256
REMEMBERED_SESSIONS = 4096  # sessions whose last finish is kept after their pin went, to measure their next gap


def _remember(table: OrderedDict, session_id: str, value) -> None:
    """Sets the session's entry as the most recent one; past ``REMEMBERED_SESSIONS`` the oldest is forgotten."""
    table[session_id] = value
    table.move_to_end(session_id)
    if len(table) > REMEMBERED_SESSIONS:
        table.popitem(last=False)


@dataclass
class SessionPin:
    node: Any  # the tree node where the pinned sequence ends (its path to the root is locked)
    tokens: int  # the pinned sequence's length
    deadline: float


@dataclass
class SessionPinStats:
    num_pinned: int = 0
    num_expired: int = 0
    num_ended: int = 0
    num_released_for_memory: int = 0
    num_over_bound: int = 0  # pins not taken (alone past the bound) or released to keep the bound
    reused_tokens: int = 0  # cached prompt tokens of requests that arrived to a pin of their session


class SessionPins:
    def __init__(self, tree, max_tokens: int, ttl: float | None, ttl_max: float,
                 clock: Callable[[], float] = time.monotonic):
        self.tree = tree  # a RadixCache: inc_lock_ref / dec_lock_ref along a node's path
        self.max_tokens = max_tokens
        self.fixed_ttl = ttl
        self.ttl_max = ttl_max
        self.clock = clock
        self.pins: dict[str, SessionPin] = {}  # oldest first (a moved pin goes to the end)
        self.gaps: deque[float] = deque(maxlen=GAP_WINDOW)
        self.last_finished: OrderedDict[str, float] = OrderedDict()  # session -> when its last request finished
        # session -> how much of its pin its last call reused, when that was not all of it (pins hold only that much)
        self.shared_depth: OrderedDict[str, int] = OrderedDict()
        self.stats = SessionPinStats()

    def __bool__(self) -> bool:
        return bool(self.pins)

    def ttl(self) -> float:
        if self.fixed_ttl is not None:
            return self.fixed_ttl
        if not self.gaps:
            return min(DEFAULT_TTL_S, self.ttl_max)
        ordered = sorted(self.gaps)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return min(max(2.0 * p90, MIN_TTL_S), self.ttl_max)

    # Requests ---------------------------------------------------------------------------------------------------
    def on_arrival(self, session_id: str) -> SessionPin | None:
        """A request of the session arrived: the gap since the session's last finish is recorded (pinned or
        not); returns the session's pin (None: none)."""
        finished_at = self.last_finished.pop(session_id, None)
        if finished_at is not None:
            self.gaps.append(max(self.clock() - finished_at, 0.0))
        return self.pins.get(session_id)

    def on_admitted(self, session_id: str, cached_tokens: int) -> None:
        """A request of the session starts with ``cached_tokens`` cached. If it did not reach the end of the session's
        pin (its calls share a prefix but do not extend each other: an ``Evaluate`` thread's examples behind one
        set of demos), the session's next pins hold only that much."""
        pin = self.pins.get(session_id)
        if pin is None:
            return
        self.stats.reused_tokens += min(cached_tokens, pin.tokens)
        depth = self.shared_depth.get(session_id)
        extends = cached_tokens > depth if depth is not None else cached_tokens >= pin.tokens
        if extends:  # it reached the end of its predecessor (past a cut-back pin: beyond the shared prefix)
            self.shared_depth.pop(session_id, None)
        else:
            _remember(self.shared_depth, session_id, cached_tokens)

    def pin(self, session_id: str, node, tokens: int) -> bool:
        """Moves the session's pin to ``node`` (the end of a ``tokens``-long sequence a request just cached)."""
        now = self.clock()
        _remember(self.last_finished, session_id, now)
        depth = self.shared_depth.get(session_id)
        while node is not None and depth is not None and tokens > depth and node is not self.tree.root_node:
            tokens -= len(node.key)  # up to the prefix the session's calls share
            node = node.parent
        if node is None or tokens <= 0 or tokens > self.max_tokens:
            if tokens > self.max_tokens:
                self.stats.num_over_bound += 1
            self._release_if_pinned(session_id)  # the session moved on: its older sequence is not worth keeping
            return False
        self.tree.inc_lock_ref(node)  # before the old pin goes, so a shared path is never unlocked between
        old = self.pins.pop(session_id, None)
        if old is not None:
            self.tree.dec_lock_ref(old.node)
        self.pins[session_id] = SessionPin(node, tokens, now + self.ttl())
        self.stats.num_pinned += 1
        while self.pinned_tokens() > self.max_tokens and len(self.pins) > 1:
            self._release(next(iter(self.pins)))
            self.stats.num_over_bound += 1
        return True

    # Releases ---------------------------------------------------------------------------------------------------
    def end(self, session_id: str) -> bool:
        """The session is over: its pin goes now, and its last finish is forgotten. False if it held no pin."""
        self.last_finished.pop(session_id, None)
        self.shared_depth.pop(session_id, None)
        if not self._release_if_pinned(session_id):
            return False
        self.stats.num_ended += 1
        return True

    def _release_if_pinned(self, session_id: str) -> bool:
        if session_id not in self.pins:
            return False
        self._release(session_id)
        return True

    def expire(self) -> int:
        """Releases the pins whose time to live has passed; returns how many."""
        if not self.pins:
            return 0
        now = self.clock()
        expired = [sid for sid, pin in self.pins.items() if pin.deadline <= now]
        for sid in expired:
            self._release(sid)
        self.stats.num_expired += len(expired)
        return len(expired)

    def release_oldest(self) -> bool:
        """Memory is needed for work that cannot run otherwise: the oldest pin goes. False if there is none."""
        if not self.pins:
            return False
        self._release(next(iter(self.pins)))
        self.stats.num_released_for_memory += 1
        return True

    def release_all(self) -> None:
        """Every pin goes (a cache flush empties the tree)."""
        for session_id in list(self.pins):
            self._release(session_id)
        self.last_finished.clear()
        self.shared_depth.clear()

    def _release(self, session_id: str) -> None:
        self.tree.dec_lock_ref(self.pins.pop(session_id).node)

    # Reporting --------------------------------------------------------------------------------------------------
    def pinned_tokens(self) -> int:
        """Tokens on the pinned paths, each counted once (sessions may share a prefix)."""
        seen, total = set(), 0
        for pin in self.pins.values():
            node = pin.node
            while node is not None and node is not self.tree.root_node and id(node) not in seen:
                seen.add(id(node))
                total += len(node.value)
                node = node.parent
        return total

    def report(self) -> dict:
        s = self.stats
        return {"session_pinned_sessions": len(self.pins), "session_pinned_tokens": self.pinned_tokens(),
                "session_ttl_s": self.ttl(), "session_pins_taken": s.num_pinned,
                "session_pins_expired": s.num_expired, "session_pins_ended": s.num_ended,
                "session_pins_released_for_memory": s.num_released_for_memory,
                "session_pins_over_bound": s.num_over_bound, "session_reused_tokens": s.reused_tokens}
