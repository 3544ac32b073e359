"""Program-level scheduling: among waiting requests, programs that have been served least go first.

A program is the ``session_id`` its calls carry (the DSPy and LangChain adapters attach one without user code).
Its attained service is the tokens the engine computed for its calls so far (prompt tokens the cache did not hold,
plus generated tokens), charged when each call finishes. The waiting queue is ordered by the service's level first
(``level``: 0 below ``quantum`` tokens, then one level per doubling), and by the cache-aware policy within a level
(Autellix's program-level least-attained-service, with discretised levels so that the cache order still decides
among programs of similar age). A request without a session is a program of one call: level 0. So one long agent
does not hold back many short programs behind it; a long one keeps its place within its level, and the starvation
bound still puts any request passed over too often first.

Programs are forgotten when their session ends (``end``) and least recently charged first past ``MAX_PROGRAMS``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_PROGRAMS = 4096
MAX_LEVEL = 16


@dataclass
class ProgramServiceStats:
    num_priority_rounds: int = 0  # scheduling rounds whose order the levels changed


class ProgramService:
    def __init__(self, quantum: int):
        self.quantum = quantum
        self.attained: OrderedDict[str, int] = OrderedDict()  # program -> tokens computed; least recently charged first
        self.stats = ProgramServiceStats()

    def charge(self, session_id: str | None, tokens: int) -> None:
        if session_id is None or tokens <= 0:
            return
        self.attained[session_id] = self.attained.pop(session_id, 0) + tokens
        while len(self.attained) > MAX_PROGRAMS:
            self.attained.popitem(last=False)

    def level(self, session_id: str | None) -> int:
        served = self.attained.get(session_id, 0) if session_id is not None else 0
        level = 0
        while served >= self.quantum and level < MAX_LEVEL:
            served //= 2
            level += 1
        return level

    def end(self, session_id: str) -> None:
        self.attained.pop(session_id, None)

    def prioritise(self, ordered: list) -> list:
        """``ordered`` (the policy's order of waiting requests) stably sorted by their programs' levels."""
        if not self.attained:
            return ordered
        levels = [self.level(r.session_id) for r in ordered]
        if not any(levels) or levels == sorted(levels):
            return ordered
        self.stats.num_priority_rounds += 1
        return [r for _, _, r in sorted(zip(levels, range(len(ordered)), ordered), key=lambda t: t[:2])]

    def report(self) -> dict:
        return {"program_tracked": len(self.attained), "program_priority_rounds": self.stats.num_priority_rounds}
