"""Ollama's API on the server's port, so ``ollama.Client(host=...)`` and ``ChatOllama(base_url=...)`` work unchanged:
/api/chat, /api/generate (NDJSON streams; ``stream`` defaults to true), /api/embed and the legacy /api/embeddings,
/api/tags, /api/show, /api/ps, /api/version, and ``GET /`` ("Ollama is running").

Any model name is served (the one model answers). ``format`` ("json" or a JSON schema) runs on the same JSON-schema
constraint as the OpenAI routes' ``response_format``. ``options`` maps temperature, top_p, top_k, min_p, seed,
num_predict (absent or negative: up to the context length, as Ollama), stop, presence/frequency_penalty and
repeat_penalty, and ignores the others (num_ctx, num_gpu, mirostat, ...) as Ollama does. Errors are Ollama's
{"error": "message"} with the status the other routes give the same failure (bad input: 4xx).

/api/chat's ``tools`` run through the chat-completions route's machinery (``openai_chat.prepare_chat``: the template
or the Hermes tool prompt, the call grammar of ``tool_calls``, its parsers): a reply's ``message.tool_calls`` is
Ollama's [{"function": {"name", "arguments": {...}}}], streamed as each call completes; assistant ``tool_calls`` and
``tool`` messages in the history are rendered as the model expects them. Ollama lets the model decide (OpenAI's
``auto``); this server's extension options ``tool_choice`` and ``parallel_tool_calls`` (Ollama ignores unknown
options) can force a call. ``format`` and ``tools`` together are refused. With ``--reasoning-parser`` the reasoning
comes in ``message.thinking``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
from datetime import datetime, timezone
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..managers.validation import MAX_PROMPT_CHARS_PER_TOKEN, check_text
from .app_context import AppContext, get_context
from .errors import APIError, ended_by_pipeline, response_for
from .execution import off_loop, prepare_all, render_chat_prompt, run_all, run_embeddings
from .ollama_protocol import (OllamaChatRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                              OllamaShowRequest)
from .openai_chat import ChatOutput, ChatTools, DeltaReader, prepare_chat
from .openai_common import without_stop_token
from .openai_protocol import ChatCompletionRequest
from .request_parsing import check_count, json_body, parse, read_model
from .streaming import ndjson_response

# The Ollama API version reported by /api/version: the one whose request and response shapes this module follows
# (clients gate features such as JSON-schema ``format`` on it).
OLLAMA_API_VERSION = "0.12.0"
# (Ollama option, our sampling parameter)
OPTION_FIELDS = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                 ("seed", "seed"), ("stop", "stop"), ("presence_penalty", "presence_penalty"),
                 ("frequency_penalty", "frequency_penalty"), ("repeat_penalty", "repetition_penalty"))
STARTED_AT = datetime.now(timezone.utc)


def ollama_errors(handler):
    """Ollama's error body, {"error": "message"}, with the status (and Retry-After) the app's handlers give."""

    @functools.wraps(handler)
    async def route(request: Request):
        try:
            return await handler(request)
        except Exception as exc:  # noqa: BLE001 - answered as the app's handlers answer it, reshaped
            reply = await response_for(exc)
            headers = {k: v for k, v in reply.headers.items() if k.lower() == "retry-after"}
            return JSONResponse({"error": json.loads(reply.body)["error"]["message"]}, reply.status_code, headers=headers)

    return route


def timestamp(when: datetime | None = None) -> str:
    """RFC 3339 in UTC with a Z, as Ollama's ``created_at``."""
    return (when or datetime.now(timezone.utc)).isoformat(timespec="microseconds").replace("+00:00", "Z")


def nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


# Requests -----------------------------------------------------------------------------------------------------------
def format_schema(fmt) -> str | None:
    """Ollama's ``format`` as the JSON schema the output is constrained to ("json": any JSON object)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json.dumps({"type": "object"})
    if isinstance(fmt, dict):
        return json.dumps(fmt)
    raise APIError(f'format must be "json" or a JSON schema object, got {fmt!r}'[:300], param="format")


def sampling_params(req, prompt_len: int, context_len: int, tool_params: dict | None = None) -> dict:
    """Our sampling parameters from the request's ``options`` (others ignored) and ``format``, or the tool-call
    grammar (``tool_params``: ``ChatTools.sampling_params``) when tools are offered."""
    options = req.options or {}
    sp = {ours: options[theirs] for theirs, ours in OPTION_FIELDS if options.get(theirs) is not None}
    num_predict = options.get("num_predict")
    if num_predict is not None and type(num_predict) is not int:
        raise APIError(f"options.num_predict must be an integer, got {num_predict!r}"[:300], param="options")
    room = max(context_len - prompt_len, 0)
    sp["max_new_tokens"] = room if num_predict is None or num_predict < 0 else min(num_predict, room)
    schema = format_schema(req.format)
    if schema is not None and tool_params:
        raise APIError("format and tools cannot be combined: the output is either tool calls or the format's JSON",
                       param="format")
    if schema is not None:
        sp["json_schema"] = schema
    return {**sp, **(tool_params or {})}


def check_generation_request(req, reasoning_parser: str = "none") -> None:
    """Features of Ollama's API this server does not offer: refused with a clear 400, never silently ignored."""
    if req.think not in (None, False) and (reasoning_parser == "none" or not isinstance(req, OllamaChatRequest)):
        raise APIError("thinking needs /api/chat on a server started with --reasoning-parser", param="think")
    if req.logprobs:
        raise APIError("logprobs are not supported on the Ollama API of this server", param="logprobs")


def chat_request(req: OllamaChatRequest) -> ChatCompletionRequest:
    """/api/chat's conversation and tools as a chat-completions request (what ``openai_chat.prepare_chat`` renders:
    the template, the tools, calls and tool results in the history)."""
    messages = []
    for m in req.messages:
        if m.images:
            raise APIError("images are not supported on the Ollama API of this server", param="messages")
        msg: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_name:
            msg["name"] = m.tool_name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    return parse(ChatCompletionRequest, {"messages": messages, **tool_fields(req)})


def tool_fields(req: OllamaChatRequest) -> dict:
    """``tools``, and this server's extension options ``tool_choice`` (auto, none, required, or a tool's name;
    Ollama itself has none: the model decides) and ``parallel_tool_calls``, as chat-completions fields."""
    if not req.tools:
        return {}
    options = req.options or {}
    choice = options.get("tool_choice")
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    fields = {"tools": req.tools, "tool_choice": choice, "parallel_tool_calls": options.get("parallel_tool_calls")}
    return {k: v for k, v in fields.items() if v is not None}


def chat_prompt(ctx: AppContext, req: ChatCompletionRequest) -> tuple[list[int], ChatTools, dict]:
    """A preparation job: (prompt ids, the request's tools, their sampling params)."""
    prompt, tools, tool_params = prepare_chat(ctx, req, [])
    return tokenize_prompt(ctx, prompt, False), tools, tool_params


def generate_prompt(ctx: AppContext, req: OllamaGenerateRequest) -> list[int]:
    """/api/generate's prompt as token ids (a preparation job): the conversation so far (``context``), then the
    prompt, in the chat template (system message first) unless ``raw``."""
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.template:
        raise APIError("template cannot be set: the server renders its own chat template", param="template")
    if req.images:
        raise APIError("images are not supported on the Ollama API of this server", param="images")
    if req.raw:
        return tokenize_prompt(ctx, req.prompt or "", True, req.context)
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
        [{"role": "user", "content": req.prompt or ""}]
    return tokenize_prompt(ctx, render_chat_prompt(ctx, messages, add_generation_prompt=True), False, req.context)


def tokenize_prompt(ctx: AppContext, text: str, add_special_tokens: bool, context: list[int] | None = None) -> list[int]:
    check_text(text, ctx.tm.limits)
    return list(context or []) + ctx.tm.tokenize(text, add_special_tokens)


# Replies ------------------------------------------------------------------------------------------------------------
def done_reason(out: dict) -> str:
    fr = out["meta_info"].get("finish_reason") or {}
    if fr.get("type") == "abort":  # ended by the pipeline (say, nothing left to sample): the client's error or ours
        raise ended_by_pipeline(fr, "the request was aborted")
    return "length" if fr.get("type") == "length" else "stop"


def done_fields(out: dict, started: float, first_token_at: float | None) -> dict:
    """The counts and timings of Ollama's last reply of a generation. The stop token is not counted (as the
    OpenAI routes). Not streamed, the time of the first token is not seen: all of it counts as evaluation."""
    total = time.monotonic() - started
    prompt_eval = first_token_at - started if first_token_at is not None else 0.0
    return {"done": True, "done_reason": done_reason(out), "total_duration": nanoseconds(total), "load_duration": 0,
            "prompt_eval_count": out["meta_info"].get("prompt_tokens", 0),
            "prompt_eval_duration": nanoseconds(prompt_eval),
            "eval_count": without_stop_token(out)["meta_info"].get("completion_tokens", 0),
            "eval_duration": nanoseconds(total - prompt_eval)}


async def streamed_replies(ctx: AppContext, gi, model: str, body: Callable[[str, bool], dict],
                           final: Callable[[dict], dict], started: float) -> AsyncIterator[dict]:
    """One reply per output: its new text in ``body`` (told whether it is the last); the last one with ``final``'s
    fields, counts and timings."""
    first_token_at = None
    async for out in ctx.tm.generate(gi):
        if first_token_at is None and out["output_ids"]:
            first_token_at = time.monotonic()
        last = out["meta_info"].get("finish_reason") is not None
        reply = {"model": model, "created_at": timestamp(), **body(out["text"], last)}
        if not last:
            yield {**reply, "done": False}
        else:
            yield {**reply, **final(out), **done_fields(out, started, first_token_at)}


async def generation_reply(ctx: AppContext, request: Request, req, prompt_ids: list[int], started: float,
                           body: Callable[[str, bool], dict], final: Callable[[dict], dict] = lambda out: {},
                           tool_params: dict | None = None):
    """Runs the generation: an NDJSON stream of replies, or one reply (``stream: false``)."""
    sp = sampling_params(req, len(prompt_ids), ctx.tm.limits.context_len, tool_params)
    gi = (await prepare_all(ctx, request, [dict(input_ids=prompt_ids, sampling_params=sp, stream=req.stream)]))[0]
    model = ctx.response_model(req.model)
    if req.stream:
        return ndjson_response(streamed_replies(ctx, gi, model, body, final, started))
    out = (await run_all(ctx, request, [gi]))[0]
    return {"model": model, "created_at": timestamp(), **body(out["text"], True), **final(out),
            **done_fields(out, started, None)}


def loaded_reply(ctx: AppContext, req, body: dict) -> dict:
    """Ollama's answer to a request with nothing to generate from (it "loads the model")."""
    return {"model": ctx.response_model(req.model), "created_at": timestamp(), **body, "done": True,
            "done_reason": "load"}


def assistant_message(text: str) -> dict:
    return {"message": {"role": "assistant", "content": text}}


def ollama_tool_call(call: dict, index: int) -> dict:
    """An OpenAI-shaped call as Ollama sends it: arguments as an object."""
    fn = call["function"]
    arguments = json.loads(fn["arguments"])
    return {"id": call["id"], "function": {"index": index, "name": fn["name"], "arguments": arguments}}


class ChatMessages:
    """/api/chat's message in each reply: the new text as the chat route's reader splits it (``DeltaReader``): the
    content, the reasoning (Ollama's ``thinking``, with ``--reasoning-parser``) and the tool calls completed by
    then (Ollama sends whole calls, not argument fragments)."""

    def __init__(self, output: ChatOutput):
        self.reader = DeltaReader(output)
        self.sent = 0  # calls already sent

    def __call__(self, text: str, last: bool) -> dict:
        delta = self.reader(text, last)
        msg: dict = {"role": "assistant", "content": delta.get("content", "")}
        if delta.get("reasoning_content"):
            msg["thinking"] = delta["reasoning_content"]
        calls = self.reader.tools.calls if self.reader.tools is not None else []
        if len(calls) > self.sent:
            msg["tool_calls"] = [ollama_tool_call(c, i) for i, c in enumerate(calls[self.sent:], self.sent)]
            self.sent = len(calls)
        return {"message": msg}


# Routes -------------------------------------------------------------------------------------------------------------
async def read_generation(request: Request, model_cls):
    """(when it arrived, the app's context, the request): /api/chat's or /api/generate's body, read and checked."""
    started, ctx = time.monotonic(), get_context(request)
    req = await read_model(request, model_cls)
    check_generation_request(req, getattr(ctx.server_args, "reasoning_parser", "none"))
    return started, ctx, req


@ollama_errors
async def chat(request: Request):
    started, ctx, req = await read_generation(request, OllamaChatRequest)
    if not req.messages:
        return loaded_reply(ctx, req, assistant_message(""))
    as_chat = chat_request(req)
    ids, tools, tool_params = await off_loop(ctx, request, lambda _cancel: chat_prompt(ctx, as_chat))
    body = ChatMessages(ChatOutput.of(ctx, as_chat, tools))
    return await generation_reply(ctx, request, req, ids, started, body, tool_params=tool_params)


@ollama_errors
async def generate(request: Request):
    started, ctx, req = await read_generation(request, OllamaGenerateRequest)
    if not req.prompt and not req.context:
        return loaded_reply(ctx, req, {"response": ""})
    ids = await off_loop(ctx, request, lambda _cancel: generate_prompt(ctx, req))
    return await generation_reply(ctx, request, req, ids, started, lambda text, _last: {"response": text},
                                  lambda out: {"context": ids + out["output_ids"]})


def embed_inputs(ctx: AppContext, texts: list[str], truncate: bool) -> list:
    """The inputs to embed (a preparation job): with ``truncate``, each cut to what the context holds, as token ids."""
    if not truncate:
        return texts
    limit = ctx.tm.limits.context_len - 1
    return [tokenize_prompt(ctx, text[: limit * MAX_PROMPT_CHARS_PER_TOKEN], True)[:limit] for text in texts]


@ollama_errors
async def embed(request: Request):
    started = time.monotonic()
    ctx = get_context(request)
    req = await read_model(request, OllamaEmbedRequest)
    texts = ([req.input] if req.input else []) if isinstance(req.input, str) else list(req.input)
    check_count(len(texts))
    results = []
    if texts:
        inputs = await off_loop(ctx, request, lambda _cancel: embed_inputs(ctx, texts, req.truncate), len(texts))
        results = await run_embeddings(ctx, request, inputs, req.dimensions)
    return {"model": ctx.response_model(req.model), "embeddings": [r["embedding"] for r in results],
            "total_duration": nanoseconds(time.monotonic() - started), "load_duration": 0,
            "prompt_eval_count": sum(r["meta_info"].get("prompt_tokens", 0) for r in results)}


@ollama_errors
async def embeddings(request: Request):
    """The legacy /api/embeddings: one prompt, one vector (none for an empty prompt, as Ollama)."""
    ctx = get_context(request)
    req = await read_model(request, OllamaEmbeddingsRequest)
    if not req.prompt:
        return {"embedding": []}
    return {"embedding": (await run_embeddings(ctx, request, [req.prompt]))[0]["embedding"]}


# The model ----------------------------------------------------------------------------------------------------------
def model_family(ctx: AppContext) -> str:
    """"llama" for LlamaForCausalLM, "qwen3" for Qwen3ForCausalLM, ..."""
    arch = ctx.tm.info.get("architecture") or "unknown"
    return re.sub(r"For(CausalLM|ConditionalGeneration)$", "", arch).lower()


def model_details(ctx: AppContext) -> dict:
    family = model_family(ctx)
    dtype = str(ctx.tm.info.get("dtype", ""))
    level = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(dtype, dtype.upper())
    return {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
            "parameter_size": "", "quantization_level": level}


def model_entry(ctx: AppContext, name: str) -> dict:
    return {"name": name, "model": name, "modified_at": timestamp(STARTED_AT), "size": 0,
            "digest": hashlib.sha256(name.encode()).hexdigest(), "details": model_details(ctx)}


@ollama_errors
async def tags(request: Request):
    ctx = get_context(request)
    return {"models": [model_entry(ctx, name) for name in ctx.model_names]}


@ollama_errors
async def ps(request: Request):
    ctx = get_context(request)
    loaded = {"expires_at": "2999-01-01T00:00:00Z", "size_vram": 0, "context_length": ctx.tm.info.get("context_len")}
    return {"models": [{**model_entry(ctx, name), **loaded} for name in ctx.model_names]}


@ollama_errors
async def show(request: Request):
    ctx = get_context(request)
    req = await read_model(request, OllamaShowRequest)
    family = model_family(ctx)
    template = getattr(ctx.tm.tokenizer, "chat_template", None)
    capabilities = ["completion", "tools", "embedding"] + (["vision"] if ctx.tm.mm_processor is not None else [])
    return {"modelfile": f"FROM {req.model or req.name or ctx.model_name}\n", "parameters": "",
            "template": template if isinstance(template, str) else "", "details": model_details(ctx),
            "model_info": {"general.architecture": family, f"{family}.context_length": ctx.tm.info.get("context_len"),
                           f"{family}.embedding_length": ctx.tm.info.get("hidden_size")},
            "capabilities": capabilities, "modified_at": timestamp(STARTED_AT)}


async def version(request: Request):
    return {"version": OLLAMA_API_VERSION}


async def running(request: Request):
    return PlainTextResponse("Ollama is running")


def register(app: FastAPI) -> None:
    app.post("/api/chat", openapi_extra=json_body(OllamaChatRequest))(chat)
    app.post("/api/generate", openapi_extra=json_body(OllamaGenerateRequest))(generate)
    app.post("/api/embed", openapi_extra=json_body(OllamaEmbedRequest))(embed)
    app.post("/api/embeddings", openapi_extra=json_body(OllamaEmbeddingsRequest))(embeddings)
    app.post("/api/show", openapi_extra=json_body(OllamaShowRequest))(show)
    app.get("/api/tags")(tags)
    app.get("/api/ps")(ps)
    app.get("/api/version")(version)
    app.api_route("/", methods=["GET", "HEAD"])(running)
