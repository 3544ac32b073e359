"""Operations and utility routes: health, model and server info, load, stats, cache, aborts, metrics, tokenizing."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..managers.tokenizer_manager import ServerUnavailable
from ..managers.validation import check_session_id, check_text, scoped_session_id
from .app_context import AppContext, get_context
from .errors import APIError, error_response, unavailable
from .execution import off_loop, prepare_all, run_all
from .request_parsing import json_body, read_json, request_owner

VERSION = "0.1.0"
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4"


def string_field_body(name: str) -> dict:
    """``openapi_extra`` of a body {name: "..."}."""
    return json_body({"type": "object", "properties": {name: {"type": "string"}}, "required": [name]})


def string_field(data, name: str, message: str) -> str:
    value = data.get(name) if isinstance(data, dict) else None
    if not isinstance(value, str):
        raise APIError(message, param=name)
    return value


def health_probe() -> dict:
    """/health_generate's request: one token, greedy."""
    return dict(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})


def unhealthy_response(tm):
    """503 if a pipeline process has died, else None."""
    if tm.healthy:
        return None
    return error_response(f"unhealthy: {tm.dead_reason or 'a pipeline process exited'}", 503, "server_error")


def load_from_stats(stats: dict) -> dict:
    """A scheduler's stats as sglang-router's load report (session-pinned KV counts as free: the scheduler takes it
    back when work needs the memory)."""
    free = stats["free_tokens"] + stats["evictable_tokens"] + stats.get("session_pinned_tokens", 0)
    return {"num_running_reqs": stats["num_running"], "num_waiting_reqs": stats["num_waiting"],
            "num_reqs": stats["num_running"] + stats["num_waiting"],
            "num_tokens": stats["max_total_num_tokens"] - free,
            "token_usage": 1 - free / stats["max_total_num_tokens"],
            "cache_hit_rate": stats["cache_hit_rate"]}


async def load_info(ctx: AppContext) -> dict:
    try:
        return load_from_stats(await ctx.tm.control("get_stats"))
    except ServerUnavailable as e:
        raise unavailable(e)


def server_info(ctx: AppContext) -> dict:
    """The server's arguments (never the API key), pipeline info and process ids (for operators)."""
    info = {k: v for k, v in dataclasses.asdict(ctx.server_args).items() if k != "api_key"}
    info.update({"version": VERSION, **{k: v for k, v in ctx.tm.info.items() if k != "pid"}})
    info["pipeline_pids"] = {p.name.removeprefix("sglang-backend-"): p.pid for p in ctx.tm.procs}
    return info


async def tokenize(request: Request):
    ctx = get_context(request)
    prompt = string_field(await read_json(request), "prompt", 'give the text as {"prompt": "..."}')
    try:
        check_text(prompt, ctx.tm.limits)
    except ValueError as e:
        raise APIError(str(e), param="prompt")
    tokens = await off_loop(ctx, request, lambda _cancel: ctx.tm.tokenize(prompt))
    return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.tm.info.get("context_len")}


async def models(request: Request):
    ctx = get_context(request)
    context_len = ctx.tm.info.get("context_len")
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "sglang_backend",
                                        "max_model_len": context_len} for name in ctx.model_names]}


async def health(request: Request):
    return unhealthy_response(get_context(request).tm) or Response(status_code=200)


async def health_generate(request: Request):
    ctx = get_context(request)
    unhealthy = unhealthy_response(ctx.tm)
    if unhealthy is not None:
        return unhealthy
    await run_all(ctx, request, await prepare_all(ctx, request, [health_probe()]))
    return Response(status_code=200)


async def get_model_info(request: Request):
    ctx = get_context(request)
    return {"model_path": ctx.tm.info.get("model_dir"),
            "tokenizer_path": ctx.server_args.tokenizer_path or ctx.tm.info.get("model_dir"),
            "is_generation": True, "served_model_name": ctx.model_name,
            "architecture": ctx.tm.info.get("architecture")}


async def get_server_info(request: Request):
    return server_info(get_context(request))


async def get_load(request: Request):
    return [{"dp_rank": 0, **await load_info(get_context(request))}]


async def v1_loads(request: Request):
    load = await load_info(get_context(request))
    return {"timestamp": time.time(), "dp_rank_count": 1, "loads": [{"dp_rank": 0, **load}]}


async def get_stats(request: Request):
    return await get_context(request).tm.control("get_stats")


async def flush_cache(request: Request):
    tm = get_context(request).tm
    if tm.num_running() or not await tm.control("flush_cache"):
        return error_response("cannot flush the cache while requests are running", 409, "conflict")
    return Response("Cache flushed.", status_code=200)


async def abort_request(request: Request):
    rid = string_field(await read_json(request), "rid", "give the request id as {\"rid\": \"...\"}")
    if not get_context(request).tm.abort(rid, request_owner(request)):  # another client's request is "not found" too
        raise APIError(f"no running request with id {rid[:300]!r}", 404, "not_found_error", "rid")
    return {"success": True}


async def end_session(request: Request):
    """A program / session is over: its pinned KV (requests sent with its ``session_id``) becomes evictable now."""
    session_id = string_field(await read_json(request), "session_id",
                              "give the session as {\"session_id\": \"...\"}")
    try:
        check_session_id(session_id)
    except ValueError as e:
        raise APIError(str(e), param="session_id") from None
    released = await get_context(request).tm.control("end_session",
                                                      payload=scoped_session_id(request_owner(request), session_id))
    return {"success": True, "released": bool(released)}


async def check_pool(request: Request):
    problem = await get_context(request).tm.control("check_pool")
    return {"whole": problem is None, "problem": problem}


async def metrics_endpoint(request: Request):
    ctx = get_context(request)
    try:
        stats = await ctx.tm.control("get_stats", timeout=5)
    except (ServerUnavailable, asyncio.TimeoutError):
        stats = None
    return Response(ctx.metrics.render(stats), media_type=METRICS_MEDIA_TYPE)


def register(app: FastAPI) -> None:
    app.post("/tokenize", openapi_extra=string_field_body("prompt"))(tokenize)
    app.get("/v1/models")(models)
    app.get("/health")(health)
    app.get("/health_generate")(health_generate)
    app.get("/model_info")(get_model_info)  # the name sglang-router asks for first
    app.get("/get_model_info")(get_model_info)
    app.get("/server_info")(get_server_info)  # the name sglang-router asks for first
    app.get("/get_server_info")(get_server_info)
    app.get("/get_load")(get_load)
    app.get("/v1/loads")(v1_loads)
    app.get("/get_stats")(get_stats)
    app.api_route("/flush_cache", methods=["GET", "POST"])(flush_cache)
    app.post("/abort_request", openapi_extra=string_field_body("rid"))(abort_request)
    app.post("/end_session", openapi_extra=string_field_body("session_id"))(end_session)
    app.get("/check_pool")(check_pool)
    app.get("/metrics")(metrics_endpoint)
