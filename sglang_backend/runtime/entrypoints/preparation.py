"""Request preparation (tokenizing, chat templates, image decoding, grammar compilation) off the event loop, on a
pool of threads sized to the machine, so one request's slow preparation never holds the others up.

Every job is bounded: grammars by their compile budget (``constrained/budget.py``), chat templates by their time
limit (``managers/chat_templates.py``), prompts by their size (``managers/validation.py``). On top of that the pool
admits no more prompts than the server's in-flight bound (503 + Retry-After past it), waits at most
``--request-timeout`` (504), and stops a job whose client has gone: the job's ``cancel`` event is set, which
ends a grammar compilation at its next budget check.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from starlette.requests import Request

T = TypeVar("T")

DISCONNECT_POLL_S = 0.5


def default_workers() -> int:
    return min(8, max(2, os.cpu_count() or 2))


class PreparationPool:
    def __init__(self, workers: int, check_room: Callable[[int], None], timeout_s: float | None):
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prepare")
        self._check_room = check_room  # raises Overloaded when n more prompts would pass the in-flight bound
        self._timeout_s = timeout_s
        self.in_flight = 0  # prompts being prepared or waiting for a worker

    async def run(self, request: Request, job: Callable[[threading.Event], T], prompts: int = 1) -> T:
        """``job(cancel)`` on a worker thread; its result, or its exception. Raises ``Overloaded`` (503) when the
        server is full, ``PreparationAborted`` when the client left or the request timed out."""
        self._check_room(self.in_flight + prompts)
        cancel = threading.Event()
        self.in_flight += prompts
        future = asyncio.get_running_loop().run_in_executor(self._pool, job, cancel)
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        try:
            while True:
                wait = DISCONNECT_POLL_S if deadline is None else min(DISCONNECT_POLL_S, deadline - time.monotonic())
                done, _ = await asyncio.wait({future}, timeout=max(0.0, wait))
                if done:
                    return future.result()
                if deadline is not None and time.monotonic() >= deadline:
                    raise PreparationAborted(f"preparing the request took longer than {self._timeout_s:g}s "
                                             f"(--request-timeout)", 504)
                if await request.is_disconnected():
                    raise PreparationAborted("client disconnected", 499)
        finally:
            self.in_flight -= prompts
            if not future.done():
                cancel.set()  # a grammar compilation stops at its next budget check
                future.cancel()  # a job still waiting for a worker never starts


class PreparationAborted(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
