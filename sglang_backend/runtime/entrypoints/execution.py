"""Running requests for the HTTP routes: preparation off the event loop, then generation, aborted when the client
goes away."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import AsyncIterator, Callable

from starlette.requests import Request

from ..managers.tokenizer_manager import GenerateInput, TokenizerManager
from .app_context import AppContext
from .errors import APIError, preparation_error
from .preparation import PreparationAborted
from .request_parsing import check_count, request_owner

DISCONNECT_POLL_S = 0.5


async def off_loop(ctx: AppContext, request: Request, job: Callable, prompts: int = 1):
    """``job(cancel)`` on the preparation pool; a ValueError from it is the client's error (400)."""
    try:
        return await ctx.prep.run(request, job, prompts)
    except (PreparationAborted, ValueError) as e:
        raise preparation_error(e)


async def prepare_all(ctx: AppContext, request: Request, items: list[dict]) -> list[GenerateInput]:
    """Tokenizes and validates every prompt of one HTTP request (off the event loop), then checks the
    queue bound for all of them together."""
    check_count(len(items))
    job = functools.partial(prepare_inputs, ctx.tm, items, request_owner(request))
    gis = await off_loop(ctx, request, job, len(items))
    ctx.tm.check_capacity(gis)
    return gis


def prepare_inputs(tm: TokenizerManager, items: list[dict], owner: str, cancel: threading.Event) -> list[GenerateInput]:
    """A preparation job: every prompt of a request tokenized and validated, in the caller's namespace."""
    return [tm.prepare(**kw, owner=owner, cancel=cancel) for kw in items]


async def last_output(tm: TokenizerManager, gi: GenerateInput) -> dict | None:
    last = None
    async for out in tm.generate(gi):
        last = out
    return last


async def run_all(ctx: AppContext, request: Request, gis: list[GenerateInput]) -> list[dict]:
    """Runs requests to the end; if the client disconnects first (or one of them fails), the others are
    cancelled, which aborts them and frees their KV."""
    tasks = [asyncio.create_task(last_output(ctx.tm, gi)) for gi in gis]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            if pending and await request.is_disconnected():
                raise APIError("client disconnected", 499)
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()


def output_streams(ctx: AppContext, gis: list[GenerateInput]) -> list[AsyncIterator[dict]]:
    return [ctx.tm.generate(gi) for gi in gis]
