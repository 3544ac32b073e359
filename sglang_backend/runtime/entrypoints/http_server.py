"""FastAPI server: native /generate, OpenAI-compatible /v1/*, and operations endpoints.

Every error a client can cause is a 4xx with an OpenAI-style body {"error": {"message", "type", "param",
"code"}}; internal failures are 5xx without stack traces.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..managers.detokenizer_manager import format_logprob_pairs
from ..managers.tokenizer_manager import GenerateInput, ServerUnavailable, TokenizerManager
from .metrics import ServerMetrics
from .openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

logger = logging.getLogger(__name__)

OPEN_ROUTES = {"/health", "/health_generate"}
DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param


def error_response(message: str, status: int = 400, err_type: str = "invalid_request_error", param=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}}, status_code=status)


def create_app(tm: TokenizerManager, server_args) -> FastAPI:
    app = FastAPI(title="sglang_backend", version="0.1.0")
    metrics = ServerMetrics()
    tm.metrics = metrics
    model_name = server_args.served_model_name or (server_args.model_path or "SmolLM2-135M-Instruct")

    @app.on_event("startup")
    async def _start():
        tm.start_background()

    # Errors ------------------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.message, exc.status, exc.err_type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(x) for x in first.get("loc", []) if x != "body")
        return error_response(f"{loc or 'body'}: {first.get('msg', 'invalid request')}", 400, param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code, "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal_error(_, exc: Exception):
        logger.exception("internal error")
        return error_response("internal server error", 500, "internal_error")

    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)

    async def read_json(request: Request) -> Any:
        body = await request.body()
        try:
            return json.loads(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise APIError("request body is not valid UTF-8")
        except json.JSONDecodeError as e:
            raise APIError(f"request body is not valid JSON: {e}")

    def parse(model_cls, data):
        from pydantic import ValidationError

        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors())

    def check_model(name: str | None) -> None:
        if name and name not in (model_name, "default") and name != server_args.model_path:
            raise APIError(f"The model {name!r} does not exist; this server serves {model_name!r}", 404,
                           "not_found_error", "model")

    def prepare(**kwargs) -> GenerateInput:
        try:
            return tm.prepare(**kwargs)
        except ServerUnavailable as e:
            raise APIError(f"server unavailable: {e}", 503, "server_error")
        except ValueError as e:
            raise APIError(str(e))

    async def run_to_end(request: Request, gi: GenerateInput) -> dict:
        """Runs one request; if the client disconnects first, cancelling aborts it and frees its KV."""
        async def consume():
            last = None
            async for out in tm.generate(gi):
                last = out
            return last

        task = asyncio.create_task(consume())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not done and await request.is_disconnected():
                task.cancel()
                raise APIError("client disconnected", 499)
        try:
            return task.result()
        except ServerUnavailable as e:
            raise APIError(f"server unavailable: {e}", 503, "server_error")

    # Native API ---------------------------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        obj = parse(GenerateRequest, await read_json(request))
        if (obj.text is None) == (obj.input_ids is None):
            raise APIError("give exactly one of text or input_ids")
        is_batch = isinstance(obj.text, list) or (obj.input_ids is not None and bool(obj.input_ids) and isinstance(obj.input_ids[0], list))
        items = (obj.text if obj.text is not None else obj.input_ids) if is_batch else [obj.text if obj.text is not None else obj.input_ids]
        n = len(items)
        if is_batch and n == 0:
            raise APIError("empty batch")

        def per(value, name):
            if isinstance(value, list):
                if not is_batch:
                    raise APIError(f"{name} is a list but the request has one prompt", param=name)
                if len(value) != n:
                    raise APIError(f"{name} has {len(value)} entries for {n} prompts", param=name)
                return value
            return [value] * n

        sps, lps, starts, tops, rids = (per(obj.sampling_params, "sampling_params"), per(obj.return_logprob, "return_logprob"),
                                        per(obj.logprob_start_len, "logprob_start_len"), per(obj.top_logprobs_num, "top_logprobs_num"),
                                        per(obj.rid, "rid") if obj.rid is not None else [None] * n)
        if obj.rid is not None and len(set(rids)) != len(rids):
            raise APIError("rid values must be unique within a batch", param="rid")
        if obj.stream and is_batch:
            raise APIError("stream=true takes a single prompt")
        # image_data: one prompt takes an image or a list of them; a batch takes one such entry per prompt.
        images = [obj.image_data] if not is_batch else per(obj.image_data, "image_data")
        gis = []
        for item, sp, lp, st, top, rid, im in zip(items, sps, lps, starts, tops, rids, images):
            text, ids = (item, None) if isinstance(item, str) else (None, item)
            gis.append(prepare(text=text, input_ids=ids, sampling_params=sp, rid=rid, stream=obj.stream,
                               return_logprob=bool(lp), logprob_start_len=st, top_logprobs_num=top, image_data=im))
        with_text = obj.return_text_in_logprobs

        def finish(out: dict) -> dict:
            meta = out["meta_info"]
            for key in ("input_token_logprobs", "output_token_logprobs"):
                if key in meta:
                    meta[key] = format_logprob_pairs(meta[key], tm.tokenizer, with_text)
            for key in ("input_top_logprobs", "output_top_logprobs"):
                if key in meta:
                    meta[key] = [None if t is None else format_logprob_pairs(t, tm.tokenizer, with_text) for t in meta[key]]
            return out

        if obj.stream:
            async def sse():
                try:
                    async for out in tm.generate(gis[0]):
                        yield f"data: {json.dumps(finish(out))}\n\n"
                except ServerUnavailable as e:
                    yield f"data: {json.dumps({'error': {'message': f'server unavailable: {e}', 'code': 503}})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        outs = await asyncio.gather(*[run_to_end(request, gi) for gi in gis])
        outs = [finish(o) for o in outs]
        return outs if is_batch else outs[0]

    # OpenAI-compatible API ------------------------------------------------------------------------------------------
    def sampling_from_openai(req, max_tokens: int | None) -> dict:
        sp: dict[str, Any] = {}
        if max_tokens is not None:
            sp["max_new_tokens"] = max_tokens
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                             ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                             ("repetition_penalty", "repetition_penalty"), ("min_new_tokens", "min_tokens"),
                             ("stop_token_ids", "stop_token_ids"), ("seed", "seed")):
            value = getattr(req, theirs)
            if value is not None:
                sp[ours] = value
        if req.stop is not None:
            stops = [req.stop] if isinstance(req.stop, str) else req.stop
            if len(stops) > 16:
                raise APIError("at most 16 stop sequences", param="stop")
            sp["stop"] = stops
        if req.logit_bias:
            try:
                sp["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                raise APIError("logit_bias keys must be token ids", param="logit_bias")
        sp["ignore_eos"] = req.ignore_eos
        sp["skip_special_tokens"] = req.skip_special_tokens
        sp["no_stop_trim"] = req.no_stop_trim
        for name in ("regex", "json_schema", "ebnf"):
            value = getattr(req, name)
            if value is not None:
                sp[name] = value if isinstance(value, str) else json.dumps(value)
        return sp

    def seeds_for(sp: dict, n: int) -> list[dict]:
        if n == 1:
            return [sp]
        # n samples of one prompt: distinct seeds (if seeded) so the samples differ but stay reproducible.
        return [{**sp, "seed": (sp["seed"] + i) % 2**64} if "seed" in sp else dict(sp) for i in range(n)]

    def usage(outs: list[dict], prompt_outs: list[dict] | None = None) -> dict:
        prompt_outs = prompt_outs or outs[:1]
        prompt = sum(o["meta_info"].get("prompt_tokens", 0) for o in prompt_outs)
        completion = sum(o["meta_info"].get("completion_tokens", 0) for o in outs)
        cached = sum(o["meta_info"].get("cached_tokens", 0) for o in prompt_outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def finish_reason(out: dict) -> str | None:
        fr = out["meta_info"].get("finish_reason")
        if fr is None:
            return None
        return {"stop": "stop", "length": "length"}.get(fr["type"], "abort")

    def chat_logprobs(out: dict, top: int, start: int = 0) -> dict:
        """OpenAI chat logprobs for output tokens from ``start`` (streams send each token once)."""
        items = []
        tops = out["meta_info"].get("output_top_logprobs") or []
        for i, (lp, tid) in enumerate(out["meta_info"].get("output_token_logprobs", [])):
            if i < start:
                continue
            tok = tm.tokenizer.decode([tid])
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
            if top and i < len(tops):
                entry["top_logprobs"] = [{"token": tm.tokenizer.decode([t]), "logprob": v,
                                          "bytes": list(tm.tokenizer.decode([t]).encode("utf-8"))} for v, t in tops[i]]
            items.append(entry)
        return {"content": items}

    def completion_logprobs(out: dict, start: int = 0) -> dict:
        tokens, lps, tops = [], [], []
        top_list = out["meta_info"].get("output_top_logprobs") or []
        for i, (lp, tid) in enumerate(out["meta_info"].get("output_token_logprobs", [])):
            if i < start:
                continue
            tokens.append(tm.tokenizer.decode([tid]))
            lps.append(lp)
            tops.append({tm.tokenizer.decode([t]): v for v, t in top_list[i]} if i < len(top_list) else None)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if top_list else None, "text_offset": []}

    def sent_logprobs(out: dict) -> int:
        return len(out["meta_info"].get("output_token_logprobs", []))

    def render_chat(req: ChatCompletionRequest, images: list | None = None) -> str:
        """The chat prompt; image parts become the model's image placeholder, their URLs go to ``images``."""
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    kind = part.get("type")
                    if kind == "text":
                        parts.append(str(part.get("text", "")))
                    elif kind in ("image_url", "input_image", "image"):
                        if tm.mm_processor is None or images is None:
                            raise APIError("this model takes no images", param="messages")
                        url = part.get("image_url", part.get("image"))
                        images.append(url.get("url") if isinstance(url, dict) else url)
                        parts.append(tm.mm_processor.image_token)
                    else:
                        raise APIError(f"unsupported content part type {kind!r}", param="messages")
                content = "".join(parts)
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            messages.append(msg)
        if req.tools:
            raise APIError("tool calling is not supported by this server yet", param="tools")
        try:
            return tm.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=not req.continue_final_message,
                continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
        except APIError:
            raise
        except Exception as e:  # jinja TemplateError and friends: the messages do not fit the template
            raise APIError(f"the messages do not fit the model's chat template: {e}", param="messages")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request))
        check_model(req.model)
        images: list = []
        prompt = render_chat(req, images)
        sp = sampling_from_openai(req, req.max_completion_tokens or req.max_tokens)
        if req.response_format is not None and req.response_format.type != "text":
            sp.pop("regex", None)
            sp["json_schema"] = json.dumps(response_format_schema(req.response_format))
        top = req.top_logprobs or 0
        # With images, the tokenizer manager tokenizes the prompt and expands its image placeholders.
        src = (dict(text=prompt, image_data=images, add_special_tokens=False) if images
               else dict(input_ids=tm.tokenizer.encode(prompt, add_special_tokens=False)))
        gis = [prepare(**src, sampling_params=s, stream=req.stream, return_logprob=req.logprobs,
                       top_logprobs_num=top, rid=(f"{req.rid}-{i}" if req.rid and req.n > 1 else req.rid))
               for i, s in enumerate(seeds_for(sp, req.n))]
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        name = req.model or model_name
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def sse():
                finals: dict[int, dict] = {}
                first = {i: True for i in range(len(gis))}
                lp_sent = [0] * len(gis)
                try:
                    async for i, out in merge_streams([tm.generate(gi) for gi in gis]):
                        delta = {"content": out["text"]}
                        if first[i]:
                            delta["role"] = "assistant"
                            first[i] = False
                        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason(out)}
                        if req.logprobs and sent_logprobs(out) > lp_sent[i]:
                            choice["logprobs"] = chat_logprobs(out, top, lp_sent[i])
                            lp_sent[i] = sent_logprobs(out)
                        if choice["finish_reason"] is not None:
                            finals[i] = out
                        yield sse_event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": name, "choices": [choice]})
                    if include_usage:
                        yield sse_event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                                         "choices": [], "usage": usage(list(finals.values()))})
                except ServerUnavailable as e:
                    yield sse_event({"error": {"message": f"server unavailable: {e}", "type": "server_error", "code": 503}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        outs = await asyncio.gather(*[run_to_end(request, gi) for gi in gis])
        choices = []
        for i, out in enumerate(outs):
            choice = {"index": i, "message": {"role": "assistant", "content": out["text"]},
                      "logprobs": chat_logprobs(out, top) if req.logprobs else None, "finish_reason": finish_reason(out)}
            choices.append(choice)
        return {"id": cid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                "usage": usage(outs)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request))
        check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError("best_of is not supported", param="best_of")
        if isinstance(req.prompt, str):
            prompts: list = [req.prompt]
        elif req.prompt and isinstance(req.prompt[0], int):
            prompts = [req.prompt]
        else:
            prompts = list(req.prompt)
        if not prompts:
            raise APIError("prompt is empty", param="prompt")
        sp = sampling_from_openai(req, req.max_tokens)
        top = req.logprobs or 0
        gis = []
        many = len(prompts) * req.n > 1
        for p in prompts:
            for s in seeds_for(sp, req.n):
                text, ids = (p, None) if isinstance(p, str) else (None, p)
                rid = f"{req.rid}-{len(gis)}" if req.rid and many else req.rid
                gis.append(prepare(text=text, input_ids=ids, sampling_params=s, stream=req.stream,
                                   return_logprob=req.logprobs is not None, top_logprobs_num=top, rid=rid))
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        name = req.model or model_name
        echo_texts = [(p if isinstance(p, str) else tm.tokenizer.decode(p)) if req.echo else "" for p in prompts for _ in range(req.n)]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def sse():
                finals: dict[int, dict] = {}
                echoed = set()
                lp_sent = [0] * len(gis)
                try:
                    async for i, out in merge_streams([tm.generate(gi) for gi in gis]):
                        text = out["text"]
                        if req.echo and i not in echoed:
                            text, _ = echo_texts[i] + text, echoed.add(i)
                        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason(out)}
                        if req.logprobs is not None:
                            choice["logprobs"] = completion_logprobs(out, lp_sent[i])
                            lp_sent[i] = sent_logprobs(out)
                        if choice["finish_reason"] is not None:
                            finals[i] = out
                        yield sse_event({"id": cid, "object": "text_completion", "created": created, "model": name, "choices": [choice]})
                    if include_usage:
                        outs = list(finals.values())
                        yield sse_event({"id": cid, "object": "text_completion", "created": created, "model": name,
                                         "choices": [], "usage": usage(outs, outs[:: req.n])})
                except ServerUnavailable as e:
                    yield sse_event({"error": {"message": f"server unavailable: {e}", "type": "server_error", "code": 503}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        outs = await asyncio.gather(*[run_to_end(request, gi) for gi in gis])
        choices = [{"index": i, "text": echo_texts[i] + out["text"],
                    "logprobs": completion_logprobs(out) if req.logprobs is not None else None,
                    "finish_reason": finish_reason(out)} for i, out in enumerate(outs)]
        return {"id": cid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                "usage": usage(outs, outs[:: req.n])}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        data = await read_json(request)
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
            raise APIError('give the text as {"prompt": "..."}', param="prompt")
        tokens = tm.tokenize(data["prompt"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": tm.info.get("context_len")}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "sglang_backend",
                                            "max_model_len": tm.info.get("context_len")}]}

    # Operations ---------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not tm.healthy:
            return error_response(f"unhealthy: {tm.dead_reason or 'a pipeline process exited'}", 503, "server_error")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        if not tm.healthy:
            return error_response(f"unhealthy: {tm.dead_reason or 'a pipeline process exited'}", 503, "server_error")
        gi = prepare(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        await run_to_end(request, gi)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": tm.info.get("model_dir"), "tokenizer_path": server_args.tokenizer_path or tm.info.get("model_dir"),
                "is_generation": True, "served_model_name": model_name}

    @app.get("/get_server_info")
    async def get_server_info():
        import dataclasses

        info = {k: v for k, v in dataclasses.asdict(server_args).items() if k != "api_key"}
        info.update({"version": "0.1.0", **{k: v for k, v in tm.info.items() if k != "pid"}})
        return info

    async def load_info() -> dict:
        stats = await tm.control("get_stats")
        return {"num_running_reqs": stats["num_running"], "num_waiting_reqs": stats["num_waiting"],
                "num_reqs": stats["num_running"] + stats["num_waiting"],
                "num_tokens": stats["max_total_num_tokens"] - stats["free_tokens"] - stats["evictable_tokens"],
                "token_usage": 1 - (stats["free_tokens"] + stats["evictable_tokens"]) / stats["max_total_num_tokens"],
                "cache_hit_rate": stats["cache_hit_rate"]}

    @app.get("/get_load")
    async def get_load():
        try:
            return [{"dp_rank": 0, **await load_info()}]
        except ServerUnavailable as e:
            raise APIError(f"server unavailable: {e}", 503, "server_error")

    @app.get("/v1/loads")
    async def v1_loads():
        try:
            load = await load_info()
        except ServerUnavailable as e:
            raise APIError(f"server unavailable: {e}", 503, "server_error")
        return {"timestamp": time.time(), "dp_rank_count": 1, "loads": [{"dp_rank": 0, **load}]}

    @app.get("/get_stats")
    async def get_stats():
        return await tm.control("get_stats")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if tm.num_running() or not await tm.control("flush_cache"):
            return error_response("cannot flush the cache while requests are running", 409, "conflict")
        return Response("Cache flushed.", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        data = await read_json(request)
        rid = data.get("rid") if isinstance(data, dict) else None
        if not isinstance(rid, str):
            raise APIError("give the request id as {\"rid\": \"...\"}", param="rid")
        if not tm.abort(rid):
            raise APIError(f"no running request with id {rid!r}", 404, "not_found_error", "rid")
        return {"success": True}

    @app.get("/check_pool")
    async def check_pool():
        problem = await tm.control("check_pool")
        return {"whole": problem is None, "problem": problem}

    @app.get("/metrics")
    async def metrics_endpoint():
        try:
            stats = await tm.control("get_stats", timeout=5)
        except (ServerUnavailable, asyncio.TimeoutError):
            stats = None
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    return app


class APIKeyMiddleware:
    """Bearer-token check as plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client
    disconnects from the handlers, and a disconnect must abort its request)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        response = error_response("invalid or missing API key", 401, "authentication_error")
        await response(scope, receive, send)


def response_format_schema(rf) -> dict:
    """OpenAI response_format -> the JSON schema the output is constrained to."""
    if rf.type == "json_object":
        return {"type": "object"}
    spec = rf.json_schema or {}
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError("response_format.json_schema.schema must be a JSON schema object", param="response_format")
    return schema


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def merge_streams(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleaves several result streams as (index, item), in arrival order."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as e:  # noqa: BLE001 - surfaced to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def launch_server(server_args) -> None:
    """Starts the pipeline processes and serves HTTP until interrupted; no orphan processes are left."""
    import uvicorn

    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    tm = TokenizerManager(server_args)
    tm.launch()
    app = create_app(tm, server_args)
    try:
        uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level, timeout_keep_alive=30,
                    timeout_graceful_shutdown=10)
    finally:
        tm.shutdown()
        tm.cleanup_ipc()
