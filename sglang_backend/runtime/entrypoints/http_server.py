"""FastAPI server: native /generate, OpenAI-compatible /v1/*, and operations endpoints.

Every error a client can cause is a 4xx with an OpenAI-style body {"error": {"message", "type", "param",
"code"}}; internal failures are 5xx without stack traces.

Hostile-input and overload defences (README "Reliability and security"): request bodies are capped
(``--max-request-body-bytes``, 413) and parsed JSON is checked for depth and invalid Unicode before any model
sees it; slow clients are closed at the header and body read timeouts (``connection_guard``); tokenizing, chat
templates, images and grammar compilation run on a bounded pool of threads, each job within its budget
(``preparation``), so one heavy request never stalls the event loop or the others; past
``max_running_requests + max_queued_requests`` requests in flight new ones get 503 + Retry-After;
``--request-timeout`` aborts slow requests (504). Request ids are scoped to the credential that sent them (the
Authorization header), so one client cannot abort another's request.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...utils import die_with_parent_if_requested
from ..managers import chat_templates
from ..managers.detokenizer_manager import format_logprob_pairs
from ..managers.tokenizer_manager import GenerateInput, Overloaded, RequestFailed, ServerUnavailable, TokenizerManager
from ..managers.validation import MAX_PROMPTS_PER_REQUEST, check_text
from ..sampling_params import parallel_samples, sample_count
from .metrics import ServerMetrics
from .openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from .preparation import PreparationAborted, PreparationPool, default_workers

logger = logging.getLogger(__name__)

OPEN_ROUTES = {"/health", "/health_generate"}
DISCONNECT_POLL_S = 0.5
MAX_JSON_DEPTH = 64
RETRY_AFTER_S = 1
PIPELINE_DEATH_GRACE_S = 0.3  # after a pipeline process dies: time for error replies to reach clients before exit


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param


def error_response(message: str, status: int = 400, err_type: str = "invalid_request_error", param=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}}, status_code=status,
                        headers=headers)


def error_body(exc: Exception) -> dict:
    """The OpenAI-style error of a pipeline-side failure (for JSON replies and SSE error events)."""
    if isinstance(exc, Overloaded):
        return {"message": f"server overloaded: {exc}; retry later", "type": "server_error", "code": 503}
    if isinstance(exc, ServerUnavailable):
        return {"message": f"server unavailable: {exc}", "type": "server_error", "code": 503}
    if isinstance(exc, RequestFailed):
        return {"message": str(exc), "type": "timeout_error" if exc.status == 504 else "server_error", "code": exc.status}
    if isinstance(exc, TimeoutError):
        return {"message": "the scheduler did not answer in time", "type": "timeout_error", "code": 504}
    return {"message": "internal server error", "type": "internal_error", "code": 500}


def json_body(schema) -> dict:
    """``openapi_extra`` that documents a route's JSON body (the handlers read raw JSON themselves, to
    control every error). A pydantic model's ``$defs`` are inlined so the schema stands alone."""
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    defs = schema.get("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def request_owner(request: Request) -> str:
    """Who sent a request: a digest of its credential (the Authorization header; "" when there is none).
    Request ids live in this owner's namespace only."""
    auth = request.headers.get("authorization")
    return hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()[:32] if auth else ""


def check_json_value(data: Any) -> None:
    """Iterative walk (no recursion to exhaust): nesting at most MAX_JSON_DEPTH, and every string valid
    Unicode (JSON escapes can smuggle in lone surrogates, which no tokenizer or encoder accepts)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (str, list, dict)))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError("request body contains a string that is not valid Unicode (a lone surrogate escape)") from None


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

    @app.exception_handler(ServerUnavailable)
    @app.exception_handler(Overloaded)
    @app.exception_handler(RequestFailed)
    @app.exception_handler(TimeoutError)
    async def _pipeline_error(_, exc: Exception):
        err = error_body(exc)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, Overloaded) else None
        return error_response(err["message"], err["code"], err["type"], headers=headers)

    @app.exception_handler(Exception)
    async def _internal_error(_, exc: Exception):
        logger.exception("internal error")
        return error_response("internal server error", 500, "internal_error")

    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server_args.max_request_body_bytes)
    # Tokenizing, chat templates, images and grammar compilation run off the event loop (streams, health checks
    # and aborts keep flowing), on several threads, each job bounded (preparation.py).
    prep = PreparationPool(server_args.prepare_workers or default_workers(), tm.check_room,
                           server_args.request_timeout)
    app.state.preparation = prep

    async def off_loop(request: Request, job, prompts: int = 1):
        """``job(cancel)`` on the preparation pool; a ValueError from it is the client's error (400)."""
        try:
            return await prep.run(request, job, prompts)
        except PreparationAborted as e:
            raise APIError(str(e), e.status, "timeout_error" if e.status == 504 else "invalid_request_error")
        except ValueError as e:
            raise APIError(str(e))

    async def read_json(request: Request) -> Any:
        # A JSON body must say so. Browsers send text/plain and form bodies cross-origin without a preflight,
        # so parsing those as JSON would let any web page drive a server that has no API key (CSRF).
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype and ctype != "application/json" and not ctype.endswith("+json"):
            raise APIError(f"Content-Type must be application/json, got {ctype!r}", 415)
        body = await request.body()
        try:
            data = json.loads(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise APIError("request body is not valid UTF-8")
        except json.JSONDecodeError as e:
            raise APIError(f"request body is not valid JSON: {e}")
        except RecursionError:
            raise APIError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
        check_json_value(data)
        return data

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

    def check_count(n: int) -> None:
        if n > MAX_PROMPTS_PER_REQUEST:
            raise APIError(f"one request may carry at most {MAX_PROMPTS_PER_REQUEST} prompts x n, got {n}")

    async def prepare_all(request: Request, items: list[dict]) -> list[GenerateInput]:
        """Tokenizes and validates every prompt of one HTTP request (off the event loop), then checks the
        queue bound for all of them together."""
        check_count(len(items))
        owner = request_owner(request)

        def work(cancel):
            return [tm.prepare(**kw, owner=owner, cancel=cancel) for kw in items]

        gis = await off_loop(request, work, len(items))
        tm.check_capacity(gis)
        return gis

    async def run_all(request: Request, gis: list[GenerateInput]) -> list[dict]:
        """Runs requests to the end; if the client disconnects first (or one of them fails), the others are
        cancelled, which aborts them and frees their KV."""
        async def consume(gi):
            last = None
            async for out in tm.generate(gi):
                last = out
            return last

        tasks = [asyncio.create_task(consume(gi)) for gi in gis]
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

    async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
        """An SSE body that ends with an error event (not a broken connection) when the request fails."""
        try:
            async for event in events:
                yield event
        except (ServerUnavailable, RequestFailed) as e:
            yield sse_event({"error": error_body(e)})
        except Exception:  # noqa: BLE001 - never a stack trace to the client; the log has it
            logger.exception("internal error in a stream")
            yield sse_event({"error": error_body(RuntimeError())})
        yield "data: [DONE]\n\n"

    # Native API ---------------------------------------------------------------------------------------------------
    @app.post("/generate", openapi_extra=json_body(GenerateRequest))
    async def generate(request: Request):
        obj = parse(GenerateRequest, await read_json(request))
        for flag in ("background", "return_hidden_states", "return_bytes", "return_entropy"):
            if getattr(obj, flag):
                raise APIError(f"{flag} is not supported by this server", param=flag)
        check_model(obj.model)
        if (obj.text is None) == (obj.input_ids is None):
            raise APIError("give exactly one of text or input_ids")
        is_batch = isinstance(obj.text, list) or (obj.input_ids is not None and bool(obj.input_ids) and isinstance(obj.input_ids[0], list))
        items = (obj.text if obj.text is not None else obj.input_ids) if is_batch else [obj.text if obj.text is not None else obj.input_ids]
        n = len(items)
        if is_batch and n == 0:
            raise APIError("empty batch")
        check_count(n)

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

        # sampling_params.n (upstream's parallel sampling): n samples of each prompt, grouped per prompt, all of them
        # counted against the per-request cap.
        try:
            counts = {sample_count(sp) if isinstance(sp, dict) else 1 for sp in sps}
        except ValueError as e:
            raise APIError(str(e), param="n")
        if len(counts) > 1:
            raise APIError("sampling_params.n must be the same for every prompt of a batch", param="n")
        n_samples = counts.pop()
        if n * n_samples > MAX_PROMPTS_PER_REQUEST:  # checked before a single copy is made
            raise APIError(f"sampling_params.n = {n_samples} for {n} prompt(s) asks for {n * n_samples} samples; one request "
                           f"may carry at most {MAX_PROMPTS_PER_REQUEST} (prompts x n)", param="n")
        sps = [c for sp in sps for c in (parallel_samples(sp) if isinstance(sp, dict) else [sp])]
        if n_samples > 1:
            items, lps, starts, tops, images = ([v for v in vals for _ in range(n_samples)]
                                                for vals in (items, lps, starts, tops, images))
            rids = [None if rid is None else f"{rid}-{i}" for rid in rids for i in range(n_samples)]  # still unique
        kwargs = []
        for item, sp, lp, st, top, rid, im in zip(items, sps, lps, starts, tops, rids, images):
            text, ids = (item, None) if isinstance(item, str) else (None, item)
            kwargs.append(dict(text=text, input_ids=ids, sampling_params=sp, rid=rid, stream=obj.stream,
                               return_logprob=bool(lp), logprob_start_len=st, top_logprobs_num=top, image_data=im))
        gis = await prepare_all(request, kwargs)
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
                if len(gis) == 1:
                    async for out in tm.generate(gis[0]):
                        yield sse_event(finish(out))
                    return
                # n > 1: the samples' chunks interleave; each carries its sample's "index" (as upstream's).
                async for i, out in merge_streams([tm.generate(gi) for gi in gis]):
                    yield sse_event({**finish(out), "index": i})

            return StreamingResponse(sse_stream(sse()), media_type="text/event-stream")
        outs = [finish(o) for o in await run_all(request, gis)]
        return outs if is_batch or n_samples > 1 else outs[0]

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

    # apply_chat_template's own parameters (chat_template, tokenize, tools, ...) and the conversation itself:
    # not template variables, so never taken from a request's chat_template_kwargs.
    reserved_template_args = {name for name, p in inspect.signature(tm.tokenizer.apply_chat_template).parameters.items()
                              if p.kind is not inspect.Parameter.VAR_KEYWORD} | {"messages", "conversation"}

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
        template_vars = req.chat_template_kwargs or {}
        refused = sorted(set(template_vars) & reserved_template_args)
        if refused:
            # Only the server's template runs (a client's template is code: chat_templates.py); clients set
            # template variables, as upstream's chat_template_kwargs does.
            raise APIError(f"chat_template_kwargs sets template variables only; {refused} cannot be set "
                           f"(the server renders its own chat template)", param="chat_template_kwargs")
        try:
            return chat_templates.render_chat(
                tm.tokenizer, messages, server_args.chat_template_timeout,
                add_generation_prompt=not req.continue_final_message,
                continue_final_message=req.continue_final_message, **template_vars)
        except chat_templates.TemplateTooSlow as e:
            raise APIError(str(e), param="messages")
        except Exception as e:  # jinja TemplateError and friends: the messages do not fit the template
            raise APIError(f"the messages do not fit the model's chat template: {e}", param="messages")

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request))
        check_model(req.model)
        images: list = []
        prompt = await off_loop(request, lambda _cancel: render_chat(req, images))
        sp = sampling_from_openai(req, req.max_completion_tokens or req.max_tokens)
        if req.response_format is not None and req.response_format.type != "text":
            sp.pop("regex", None)
            sp["json_schema"] = json.dumps(response_format_schema(req.response_format))
        top = req.top_logprobs or 0
        # With images, the tokenizer manager tokenizes the prompt and expands its image placeholders.
        src = dict(text=prompt, image_data=images or None, add_special_tokens=False)
        gis = await prepare_all(request, [dict(**src, sampling_params=s, stream=req.stream, return_logprob=req.logprobs,
                                               top_logprobs_num=top, rid=(f"{req.rid}-{i}" if req.rid and req.n > 1 else req.rid))
                                          for i, s in enumerate(parallel_samples({**sp, "n": req.n}))])
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        name = req.model or model_name
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def sse():
                finals: dict[int, dict] = {}
                first = {i: True for i in range(len(gis))}
                lp_sent = [0] * len(gis)
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

            return StreamingResponse(sse_stream(sse()), media_type="text/event-stream")
        outs = await run_all(request, gis)
        choices = []
        for i, out in enumerate(outs):
            choice = {"index": i, "message": {"role": "assistant", "content": out["text"]},
                      "logprobs": chat_logprobs(out, top) if req.logprobs else None, "finish_reason": finish_reason(out)}
            choices.append(choice)
        return {"id": cid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                "usage": usage(outs)}

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
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
        check_count(len(prompts) * req.n)
        sp = sampling_from_openai(req, req.max_tokens)
        top = req.logprobs or 0
        kwargs = []
        many = len(prompts) * req.n > 1
        for p in prompts:
            for s in parallel_samples({**sp, "n": req.n}):
                text, ids = (p, None) if isinstance(p, str) else (None, p)
                rid = f"{req.rid}-{len(kwargs)}" if req.rid and many else req.rid
                kwargs.append(dict(text=text, input_ids=ids, sampling_params=s, stream=req.stream,
                                   return_logprob=req.logprobs is not None, top_logprobs_num=top, rid=rid))
        gis = await prepare_all(request, kwargs)
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

            return StreamingResponse(sse_stream(sse()), media_type="text/event-stream")
        outs = await run_all(request, gis)
        choices = [{"index": i, "text": echo_texts[i] + out["text"],
                    "logprobs": completion_logprobs(out) if req.logprobs is not None else None,
                    "finish_reason": finish_reason(out)} for i, out in enumerate(outs)]
        return {"id": cid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                "usage": usage(outs, outs[:: req.n])}

    @app.post("/tokenize", openapi_extra=json_body({"type": "object", "properties": {"prompt": {"type": "string"}},
                                                     "required": ["prompt"]}))
    async def tokenize(request: Request):
        data = await read_json(request)
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
            raise APIError('give the text as {"prompt": "..."}', param="prompt")
        try:
            check_text(data["prompt"], tm.limits)
        except ValueError as e:
            raise APIError(str(e), param="prompt")
        tokens = await off_loop(request, lambda _cancel: tm.tokenize(data["prompt"]))
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
        gis = await prepare_all(request, [dict(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})])
        await run_all(request, gis)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")  # the name sglang-router asks for first
    async def get_model_info():
        return {"model_path": tm.info.get("model_dir"), "tokenizer_path": server_args.tokenizer_path or tm.info.get("model_dir"),
                "is_generation": True, "served_model_name": model_name}

    @app.get("/get_server_info")
    @app.get("/server_info")  # the name sglang-router asks for first
    async def get_server_info():
        import dataclasses

        info = {k: v for k, v in dataclasses.asdict(server_args).items() if k != "api_key"}
        info.update({"version": "0.1.0", **{k: v for k, v in tm.info.items() if k != "pid"}})
        info["pipeline_pids"] = {p.name.removeprefix("sglang-backend-"): p.pid for p in tm.procs}  # for operators
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

    @app.post("/abort_request", openapi_extra=json_body({"type": "object", "properties": {"rid": {"type": "string"}},
                                                         "required": ["rid"]}))
    async def abort_request(request: Request):
        data = await read_json(request)
        rid = data.get("rid") if isinstance(data, dict) else None
        if not isinstance(rid, str):
            raise APIError("give the request id as {\"rid\": \"...\"}", param="rid")
        if not tm.abort(rid, request_owner(request)):  # another client's request is "not found" too
            raise APIError(f"no running request with id {rid[:300]!r}", 404, "not_found_error", "rid")
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
    disconnects from the handlers, and a disconnect must abort its request).

    ``api_key`` may list several keys separated by commas (one per client or tenant); request ids are scoped
    per key. The check compares SHA-256 digests with ``hmac.compare_digest`` against every key, so its time
    tells nothing about the keys' contents or lengths."""

    def __init__(self, app, api_key: str):
        self.app = app
        keys = [k.strip() for k in api_key.split(",") if k.strip()]
        self.expected = [hashlib.sha256(f"Bearer {k}".encode()).digest() for k in keys]

    def allowed(self, header: bytes) -> bool:
        given = hashlib.sha256(header).digest()
        ok = False
        for expected in self.expected:  # no early exit: every key is compared
            ok |= hmac.compare_digest(given, expected)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if self.allowed(given):
            return await self.app(scope, receive, send)
        response = error_response("invalid or missing API key", 401, "authentication_error")
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from Content-Length, or as soon as a chunked body passes
    the limit (counted while it is read, so an oversized body is never buffered whole)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self) -> APIError:
        return APIError(f"request body is larger than the server's limit of {self.max_bytes} bytes", 413)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            err = self.too_large() if declared.isdigit() else APIError("invalid Content-Length header")
            return await error_response(err.message, err.status)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self.too_large()  # inside the app: answered by its APIError handler
            return message

        await self.app(scope, limited_receive, send)


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


class _StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM for ``launch_server``. The first one prints one line and is remembered (it
    picks the exit status); during start-up it raises KeyboardInterrupt to unwind the start (``launch`` stops
    the processes it started), while serving it asks uvicorn to stop. Later ones change nothing: the shutdown
    already under way is bounded."""

    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.received: list[int] = []
        self.server = None  # the uvicorn server, once serving
        self.previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self.previous = {sig: signal.signal(sig, self.handle) for sig in self.NAMES}

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def note(self, sig: int) -> None:
        if not self.received:
            os.write(2, f"sglang-backend: shutting down ({self.NAMES.get(sig, sig)})\n".encode())
        self.received.append(sig)

    def handle(self, sig: int, frame) -> None:
        first = not self.received
        self.note(sig)
        if self.server is not None:
            self.server.should_exit = True
        elif first:
            raise KeyboardInterrupt

    @property
    def interrupted(self) -> bool:
        return bool(self.received) and self.received[0] == signal.SIGINT

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 0  # 128 + SIGINT, as a shell reports a Ctrl-C'd program


def launch_server(server_args) -> None:
    """Starts the pipeline processes and serves HTTP until stopped; no orphan processes are left.

    Ctrl-C (SIGINT, which a terminal sends to the whole process group; the pipeline processes ignore it) or
    SIGTERM, at any time, start-up included: one line on stderr ("sglang-backend: shutting down (Ctrl-C)"), the
    requests in flight end with a 503 (after Ctrl-C at once; after SIGTERM once they had up to
    ``--graceful-shutdown-timeout`` seconds to finish), new connections are refused and a request sent meanwhile on
    a connection kept alive gets 503 + Retry-After without being run (``connection_guard``), the pipeline
    processes are stopped, and the process exits with 130 after Ctrl-C, 0 after SIGTERM, 1 if a pipeline process
    died. A second Ctrl-C stops waiting for open connections. With ``SGLANG_BACKEND_DIE_WITH_PARENT=1`` in the
    environment this process also dies with its parent, even a SIGKILLed one (``utils.die_with_parent_if_requested``).
    """
    import uvicorn

    from .connection_guard import DrainingMiddleware, guarded_h11_protocol

    die_with_parent_if_requested()
    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    stop = _StopSignals()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # uvicorn's own handler while it serves
            stop.note(sig)
            super().handle_exit(sig, frame)

    stop.install()
    tm = TokenizerManager(server_args)
    try:
        tm.launch()  # model loading (on a first run also the embedded model's conversion)
        app = create_app(tm, server_args)
        # Outermost: once stopping, requests (on connections still open) get 503 + Retry-After, not started.
        app.add_middleware(DrainingMiddleware, is_draining=lambda: server.should_exit, retry_after=RETRY_AFTER_S)
        # h11 with header and body read timeouts (slow clients), idle connections kept for the drain's 503s.
        protocol = guarded_h11_protocol(server_args.header_read_timeout, server_args.body_read_timeout,
                                        server_args.body_idle_timeout)
        server = Server(uvicorn.Config(app, host=server_args.host, port=server_args.port, http=protocol,
                                       log_level=server_args.log_level,
                                       timeout_keep_alive=server_args.keep_alive_timeout,
                                       timeout_graceful_shutdown=server_args.graceful_shutdown_timeout + 2))
        stop.server = server
        if stop.received:  # a signal between the end of start-up and here
            server.should_exit = True

        async def serve():
            async def exit_when_pipeline_dies():
                # The tokenizer manager has already failed every pending request; give the replies a moment to
                # reach their clients, then stop serving so a supervisor sees a non-zero exit and restarts us.
                await tm.died.wait()
                await asyncio.sleep(PIPELINE_DEATH_GRACE_S)
                server.should_exit = True

            async def end_requests_when_stopping():
                # uvicorn stops accepting at once, then waits for the requests in flight: end them (503) at
                # once after a Ctrl-C, after a drain period otherwise, rather than have uvicorn cancel them.
                while not server.should_exit:
                    await asyncio.sleep(0.1)
                deadline = time.monotonic() + (0 if stop.interrupted else server_args.graceful_shutdown_timeout)
                while tm.num_running() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                tm.fail_requests("the server is shutting down")

            watchers = [asyncio.create_task(exit_when_pipeline_dies()),
                        asyncio.create_task(end_requests_when_stopping())]
            try:
                await server.serve()
            finally:
                for w in watchers:
                    w.cancel()

        asyncio.run(serve())
    except KeyboardInterrupt:  # raised by stop.handle during start-up
        if not stop.received:
            raise
    finally:
        tm.shutdown()
        if getattr(tm, "ipc_dir", None):
            tm.cleanup_ipc()
        stop.restore()
    if tm.dead_reason is not None:
        logger.error("exiting: %s", tm.dead_reason)
        # Everything is answered and stopped; skip the interpreter's teardown (torch and friends took ~1 s of
        # it), so a supervisor can restart us sooner: the whole path from a killed child to exit takes ~0.6 s.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if stop.received:
        raise SystemExit(stop.exit_code)
