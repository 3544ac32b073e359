"""One compile budget for the whole grammar path: JSON schema -> regex -> byte DFA -> token index.

A request's grammar is untrusted input whose compile cost can grow exponentially with its size (a schema of
15 nested ``$defs``, each object with two properties pointing at the next, is 2.4 KB but expands to a regex of
millions of characters). The budget is counted in sizes and states, never in seconds, so the verdict on a
grammar does not depend on how loaded the machine is (issue 25: a wall-clock limit refused standard LangChain
schemas on a busy host):

* ``max_regex_chars``: the size of the regex a JSON schema may expand to (``$ref`` expansion is bounded by size,
  not only by cycles), checked as the regex is built, so an oversized schema fails in milliseconds;
* ``max_states``: llguidance's lexer states (our own engine stops at ``regex_fsm``'s byte-DFA state limits);
* ``lexer_fuel`` / ``step_fuel``: llguidance's deterministic work counters for building the grammar and for
  one token mask (``llguidance_backend``);
* ``cancel``: a ``threading.Event`` the caller sets when the request is gone (client disconnected), which stops
  the work at the next check;
* ``timeout_s``: off by default (``None``). Only an operator's last-resort safety net
  (``--grammar-compile-timeout``); when set, a compile past it fails with :class:`GrammarTimeout`, which is
  never cached since it depends on the load.

The stages call :func:`check` at their loop heads (cheap). The budget travels in a thread-local set by
:func:`active`, so the stages keep their signatures. Exceeding it raises :class:`GrammarTooComplex` (a
``ValueError``, the usual "bad grammar" error, a 400 on the server); cancellation raises
:class:`CompileCancelled`, which caches never remember.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = None  # no wall-clock limit (see the module docstring)
DEFAULT_MAX_REGEX_CHARS = 64 * 1024
DEFAULT_MAX_STATES = 250_000  # llguidance's own default for lexer states (1-2 kB each)
DEFAULT_LEXER_FUEL = 1_000_000  # llguidance's default: ~20 ms of regex analysis per grammar
DEFAULT_STEP_FUEL = 200_000  # llguidance's default: ~15 ms of lexer work per token mask at most


class GrammarTooComplex(ValueError):
    """The grammar exceeded its compile budget (deterministic limits: size or states)."""


class GrammarTimeout(GrammarTooComplex):
    """The grammar did not compile within the deadline (depends on load, so never cached as a verdict)."""


class CompileCancelled(ValueError):
    """The request that wanted this grammar is gone; the work stopped. Never cached."""


@dataclass
class GrammarBudget:
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    max_regex_chars: int = DEFAULT_MAX_REGEX_CHARS
    cancel: threading.Event | None = None
    max_states: int = DEFAULT_MAX_STATES
    lexer_fuel: int = DEFAULT_LEXER_FUEL
    step_fuel: int = DEFAULT_STEP_FUEL

    def __post_init__(self):
        self.deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def check(self, where: str = "") -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise CompileCancelled("grammar compilation cancelled: the request is gone")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise GrammarTimeout(f"grammar too complex: compiling it took longer than {self.timeout_s:g}s"
                                 + (f" (during {where})" if where else ""))

    def check_regex_size(self, size: int) -> None:
        if size > self.max_regex_chars:
            raise GrammarTooComplex(f"grammar too complex: the JSON schema expands to a regex of more than "
                                    f"{self.max_regex_chars} characters (deeply nested or repeated $ref?)")


_local = threading.local()


@contextlib.contextmanager
def active(budget: GrammarBudget | None):
    """Makes ``budget`` the one :func:`check` sees on this thread (nested calls keep the outer budget)."""
    outer = getattr(_local, "budget", None)
    if outer is not None or budget is None:
        yield outer
        return
    _local.budget = budget
    try:
        yield budget
    finally:
        _local.budget = None


def current() -> GrammarBudget | None:
    return getattr(_local, "budget", None)


def check(where: str = "") -> None:
    budget = getattr(_local, "budget", None)
    if budget is not None:
        budget.check(where)
