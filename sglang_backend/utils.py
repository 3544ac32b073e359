"""Small helpers shared across the package."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterator, TypeVar

T = TypeVar("T")


async def iterate_in_thread(it: Iterator[T]) -> AsyncIterator[T]:
    """An async iterator over a blocking iterator: each ``next`` runs in a worker thread."""
    sentinel = object()
    while True:
        item = await asyncio.to_thread(next, it, sentinel)
        if item is sentinel:
            return
        yield item
