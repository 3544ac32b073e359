"""Running requests for the HTTP routes: preparation off the event loop, then generation, aborted when the client
goes away."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import AsyncIterator, Callable

from starlette.requests import Request

from ..managers import chat_templates
from ..managers.io_struct import PoolingParams
from ..managers.request_frontend import embedding_result
from ..managers.tokenizer_manager import GenerateInput, TokenizerManager
from .app_context import AppContext
from .errors import APIError, ended_by_pipeline, preparation_error
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


def render_chat_prompt(ctx: AppContext, messages: list[dict], **kwargs) -> str:
    """The server's chat template over ``messages`` (a preparation job: call it on the pool); a template that is
    too slow, or messages that do not fit it, are the client's error (400)."""
    try:
        return chat_templates.render_chat(ctx.tm.tokenizer, messages, ctx.server_args.chat_template_timeout, **kwargs)
    except chat_templates.TemplateTooSlow as e:
        raise APIError(str(e), param="messages")
    except Exception as e:  # jinja TemplateError and friends: the messages do not fit the template
        raise APIError(f"the messages do not fit the model's chat template: {e}", param="messages")


def check_dimensions(ctx: AppContext, dimensions: int | None) -> None:
    """An embedding's size is the model's hidden size: a causal LM's final hidden state cannot be shortened."""
    hidden_size = ctx.tm.info.get("hidden_size")
    if dimensions is not None and dimensions != hidden_size:
        raise APIError(f"dimensions must be the model's hidden size ({hidden_size}): the embeddings of this server "
                       f"are its final hidden states, which cannot be shortened; got {dimensions}",
                       param="dimensions")


async def run_embeddings(ctx: AppContext, request: Request, prompts: list, dimensions: int | None = None) -> list[dict]:
    """Embeds each prompt (a string or a list of token ids) with the server's pooling, normalized, batched by the
    scheduler: ``Engine.encode``'s results, {"embedding", "meta_info"}, in order. Every embedding route of every
    API family runs through here."""
    check_dimensions(ctx, dimensions)
    spec = PoolingParams(ctx.server_args.embedding_pooling)
    items = [dict(text=p, pooling=spec) if isinstance(p, str) else dict(input_ids=p, pooling=spec) for p in prompts]
    outs = await run_all(ctx, request, await prepare_all(ctx, request, items))
    for out in outs:
        fr = out["meta_info"].get("finish_reason") or {}
        if "embedding" not in out["meta_info"]:  # ended without one (an abort the scheduler answered)
            raise ended_by_pipeline(fr, "the request ended without an embedding")
    return [embedding_result(out) for out in outs]
