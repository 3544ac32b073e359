"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses request is turned into a chat-completions request (``openai_chat``: the same chat template, sampling
parameters, JSON-schema constraint and tool handling), so there is one generation pipeline. What this module adds:

* ``input`` as a string or as items: messages (``input_text`` / ``output_text`` / ``input_image`` parts),
  ``function_call`` and ``function_call_output`` items (the history of a tool loop); ``instructions`` as the system
  message; function ``tools``, ``tool_choice``; ``text.format`` (``json_schema`` / ``json_object``).
* The output as items: a ``message`` with ``output_text``, ``function_call`` items for the calls the model made, and
  (with ``--reasoning-parser``) a ``reasoning`` item first; ``status`` ``incomplete`` (``max_output_tokens``) when
  the length limit cut it.
* Streaming as OpenAI's typed events: response.created, response.in_progress, response.output_item.added,
  response.content_part.added, response.output_text.delta ..., response.output_text.done, response.content_part.done,
  response.output_item.done (response.function_call_arguments.delta / .done for calls, response.reasoning_text.*
  for reasoning), response.completed; a failure mid-stream is an ``error`` event and response.failed.
* Conversation state kept on the server: a stored response (``store``, default true) can be fetched with GET and
  continued with ``previous_response_id``. The follow-up's prompt starts with the earlier turn's exact tokens
  (its prompt's and its output's ids), so the radix cache reuses that turn's KV: ``usage.input_tokens_details.
  cached_tokens`` covers it. The store keeps ``--responses-store-size`` responses, least recently used out first,
  each visible only to the credential (Authorization header) that created it.
"""

from __future__ import annotations

import json
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..managers.validation import check_text
from .app_context import AppContext
from .errors import APIError, ended_by_pipeline, error_body, validation_error_fields
from .execution import off_loop, prepare_all, run_all
from .openai_chat import ChatOutput, ChatTools, DeltaReader, chat_sampling_params, prepare_chat
from .openai_common import read_openai_request, without_stop_token
from .openai_protocol import ChatCompletionRequest
from .request_parsing import json_body, request_owner
from .streaming import sse_response

MAX_INPUT_ITEMS = 4096
TEXT_PART_TYPES = ("input_text", "output_text", "text")
# Replayed by clients with the earlier output; chat templates drop an earlier turn's reasoning anyway.
IGNORED_ITEM_TYPES = ("reasoning",)


class _Base(BaseModel):
    # strict: "8", true or "yes" are not numbers or booleans (no coercion; an int is still a valid float)
    model_config = ConfigDict(extra="ignore", strict=True)


class ResponsesRequest(_Base):
    """The fields of ``responses.create`` this server honours (others, e.g. ``include`` or ``truncation``, are
    ignored, as unknown fields are on the other OpenAI routes)."""

    model: str | None = None
    input: Union[str, list[Any]]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: dict | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Extra body (SGLang-compatible), as on /v1/chat/completions.
    seed: int | None = None
    top_k: int | None = None


# Storage ------------------------------------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    """A finished, stored response: what GET returns, and what a follow-up (``previous_response_id``) continues."""

    owner: str  # the credential that created it (request_parsing.request_owner); only it can see it
    response: dict
    conversation: list[dict]  # the chat messages so far, its output included; not the instructions
    prompt_text: str  # its rendered prompt ...
    prompt_ids: Sequence[int]  # ... as the token ids it ran with (an array("i"): 4 bytes a token)
    output_text: str = ""  # its output as the model wrote it (special tokens included) ...
    output_ids: Sequence[int] = ()  # ... and its token ids (the stop token included)


class ResponseStore:
    """The stored responses, at most ``capacity``; the least recently created or used go first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self.items[rid] = entry
        self.items.move_to_end(rid)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        entry = self.items.get(rid)
        if entry is None or entry.owner != owner:  # another credential's response is "not found", as a missing one
            return None
        self.items.move_to_end(rid)
        return entry

    def pop(self, rid: str, owner: str) -> bool:
        if self.get(rid, owner) is None:
            return False
        del self.items[rid]
        return True


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use (sized by ``--responses-store-size``)."""
    state = request.app.state
    store = getattr(state, "responses", None)
    if store is None:
        store = state.responses = ResponseStore(state.ctx.server_args.responses_store_size)
    return store


def not_found(rid: str, param: str | None = None) -> APIError:
    what = "previous_response_id: previous response" if param else "Response"
    return APIError(f"{what} with id {rid!r} not found (never stored, stored with store: false, deleted, or "
                    f"evicted: the server keeps the last --responses-store-size responses)"[:500], 404,
                    "invalid_request_error", param)


# Input items -> chat messages ---------------------------------------------------------------------------------------
def required_str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(f"{where}.{key} must be a non-empty string, got {value!r}"[:300], param="input")
    return value


def content_part(part, where: str) -> dict:
    """A Responses content part as a chat content part."""
    if not isinstance(part, dict):
        raise APIError(f"{where} must be a content part object, got {part!r}"[:300], param="input")
    kind = part.get("type")
    if kind in TEXT_PART_TYPES:
        if not isinstance(part.get("text"), str):
            raise APIError(f"{where}.text must be a string", param="input")
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise APIError(f"{where}: unsupported content part {kind!r} (input_text, output_text, refusal and input_image "
                   f"with an image_url are)"[:300], param="input")


def message_content(content, where: str):
    """A message's content (or a tool's output), found at ``where``: a string, or its parts (one string when they
    are all text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of content parts", param="input")
    parts = [content_part(p, f"{where}[{j}]") for j, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def message_item(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(f"{where}.role must be user, assistant, system or developer, got {role!r}"[:300],
                       param="input")
    content = message_content(item.get("content"), f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def function_call_item(item: dict, where: str, messages: list[dict], calls: dict[str, str]) -> None:
    """A call the model made (replayed history): a tool call of the assistant message before it, or of a new one."""
    name, call_id = required_str(item, "name", where), required_str(item, "call_id", where)
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise APIError(f"{where}.arguments must be a string of JSON", param="input")
    try:
        json.loads(arguments)
    except ValueError:
        raise APIError(f"{where}.arguments is not valid JSON: {arguments!r}"[:300], param="input") from None
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    calls[call_id] = name


def function_output_item(item: dict, where: str, calls: dict[str, str]) -> dict:
    """A tool's result: it answers a call made earlier in the conversation."""
    call_id = required_str(item, "call_id", where)
    if call_id not in calls:
        raise APIError(f"{where}: no function_call with call_id {call_id!r} precedes this function_call_output"[:300],
                       param="input")
    output = message_content(item.get("output"), f"{where}.output")
    if not isinstance(output, str):
        raise APIError(f"{where}.output must be text (a string or input_text parts)", param="input")
    return {"role": "tool", "tool_call_id": call_id, "name": calls[call_id], "content": output}


def known_calls(conversation: list[dict]) -> dict[str, str]:
    """call_id -> function name of every tool call in ``conversation``."""
    return {c["id"]: c["function"]["name"] for m in conversation for c in m.get("tool_calls") or []}


def input_messages(value, calls: dict[str, str]) -> list[dict]:
    """``input`` as chat messages; ``calls`` (call_id -> name, of the conversation so far) grows with its calls."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if len(value) > MAX_INPUT_ITEMS:
        raise APIError(f"input has {len(value)} items; at most {MAX_INPUT_ITEMS}", param="input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an item object (a message, function_call or function_call_output), "
                           f"got {item!r}"[:300], param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(message_item(item, where))
        elif kind == "function_call":
            function_call_item(item, where, messages, calls)
        elif kind == "function_call_output":
            messages.append(function_output_item(item, where, calls))
        elif kind not in IGNORED_ITEM_TYPES:
            raise APIError(f"{where}: unsupported item type {kind!r} (message, function_call and "
                           f"function_call_output are)"[:300], param="input")
    return messages


# The chat request ---------------------------------------------------------------------------------------------------
def tools_as_chat(tools: list | None) -> list[dict] | None:
    """Responses function tools (flat: {type, name, parameters, ...}) as chat-completions tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(f"{where}: only function tools are supported, got {kind!r}"[:300], param="tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(f"{where}.name must be a non-empty string (Responses tools are flat: "
                           f'{{"type": "function", "name": ..., "parameters": {{...}}}})', param="tools")
        function = {"name": name, "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    """Responses ``tool_choice`` as chat-completions' (a named function: {"type": "function", "name": ...})."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(f"unsupported tool_choice {choice!r}: use auto, none, required or "
                   f'{{"type": "function", "name": ...}}'[:300], param="tool_choice")


def text_format(text: dict | None) -> dict:
    """``text.format``, checked: {"type": "text"} (the default), "json_object", or "json_schema" with a schema."""
    fmt = (text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(f"text.format must be an object whose type is text, json_object or json_schema, "
                       f"got {fmt!r}"[:300], param="text.format")
    if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise APIError("text.format.schema must be a JSON schema object", param="text.format")
    return fmt


def chat_response_format(fmt: dict) -> dict | None:
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
    if fmt.get("strict") is not None:
        spec["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": spec}


@dataclass
class Turn:
    """One Responses request, resolved: the conversation (earlier turn + this input), the chat request that runs
    it, and the earlier turn it continues."""

    req: ResponsesRequest
    conversation: list[dict]
    chat: ChatCompletionRequest
    previous: StoredResponse | None
    tools: list[dict] | None

    @classmethod
    def build(cls, req: ResponsesRequest, previous: StoredResponse | None) -> Turn:
        history = list(previous.conversation) if previous is not None else []
        conversation = history + input_messages(req.input, known_calls(history))
        if not conversation:
            raise APIError("input is empty: give a string or at least one item", param="input")
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        tools = tools_as_chat(req.tools)
        payload = {"model": req.model, "messages": system + conversation, "max_tokens": req.max_output_tokens,
                   "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream, "tools": tools,
                   "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
                   "response_format": chat_response_format(text_format(req.text)), "seed": req.seed,
                   "top_k": req.top_k, "user": req.user}
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in payload.items() if v is not None})
        except ValidationError as e:
            message, param = validation_error_fields(e.errors())
            raise APIError(f"input does not make a valid conversation: {message}"[:500], param="input") from None
        return cls(req, conversation, chat, previous, tools)


def prompt_ids(ctx: AppContext, text: str, previous: StoredResponse | None) -> list[int]:
    """The prompt's token ids. When it starts with the earlier turn (its prompt and output, as text), the earlier
    turn's own token ids are reused for that part, so its KV is found in the radix cache whatever a fresh
    tokenization of the text would give."""
    check_text(text, ctx.tm.limits)
    tokenize = ctx.tm.tokenize
    if previous is not None:
        whole = previous.prompt_text + previous.output_text
        if text.startswith(whole):
            return [*previous.prompt_ids, *previous.output_ids, *tokenize(text[len(whole):], False)]
        if text.startswith(previous.prompt_text):
            return [*previous.prompt_ids, *tokenize(text[len(previous.prompt_text):], False)]
    return tokenize(text, False)


@dataclass
class Prepared:
    """A turn made ready to run: its prompt (text and token ids), images, tools and their sampling params."""

    text: str
    ids: list[int]
    images: list
    tools: ChatTools
    tool_params: dict


def prepare_turn(ctx: AppContext, turn: Turn) -> Prepared:
    """A preparation job: the chat route's rendering (template, tools, images), then the prompt's token ids."""
    images: list = []
    text, tools, tool_params = prepare_chat(ctx, turn.chat, images)
    return Prepared(text, prompt_ids(ctx, text, turn.previous), images, tools, tool_params)


# Output -------------------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_output(kind: str, item_id: str, text: str, status: str = "completed") -> dict:
    """A message (``output_text``) or reasoning (``reasoning_text``) output item."""
    if kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                "content": [text_part(kind, text)] if status != "in_progress" else []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(kind, text)] if status != "in_progress" else []}


def text_part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_output(item_id: str, call: dict, status: str = "completed") -> dict:
    """A ``function_call`` output item from an OpenAI-shaped call ({"id", "function": {"name", "arguments"}})."""
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def output_items(message: dict) -> list[dict]:
    """The output items of a whole generation, from its chat message: reasoning, text, calls."""
    items = []
    if message.get("reasoning_content") is not None:
        items.append(text_output("reasoning", new_id("rs"), message["reasoning_content"]))
    if message.get("content") or not message.get("tool_calls"):
        items.append(text_output("message", new_id("msg"), message.get("content") or ""))
    items += [call_output(new_id("fc"), call) for call in message.get("tool_calls") or []]
    return items


def finish_status(out: dict) -> str:
    """completed, or incomplete when the length limit cut the output; an abort is the client's error or ours."""
    fr = out["meta_info"].get("finish_reason") or {}
    if fr.get("type") == "abort":
        raise ended_by_pipeline(fr, "the request was aborted")
    return "incomplete" if fr.get("type") == "length" else "completed"


def responses_usage(out: dict) -> dict:
    """Usage as the Responses API counts it (the stop token is not an output token)."""
    meta = without_stop_token(out)["meta_info"]
    prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(ctx: AppContext, turn: Turn, rid: str, created: float, status: str, output: list[dict],
                    out: dict | None = None) -> dict:
    """The Response object (``openai.types.responses.Response``)."""
    req = turn.req
    done = status in ("completed", "incomplete")
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "completed_at": time.time() if done else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": ctx.response_model(req.model), "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format(req.text)}, "tool_choice": req.tool_choice or "auto",
            "tools": [{"type": "function", **t["function"]} for t in turn.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": responses_usage(out) if out is not None and done else None, "user": req.user,
            "metadata": req.metadata or {}}


def assistant_message(output: list[dict]) -> dict:
    """The output items as the assistant's chat message (the conversation a follow-up continues)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call" and item["status"] == "completed"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def store_response(ctx: AppContext, request: Request, turn: Turn, prepared: Prepared, out: dict,
                   response: dict) -> None:
    """Keeps a finished response for GET and follow-ups (unless ``store: false``)."""
    if not turn.req.store:
        return
    output_ids = list(out["output_ids"])
    conversation = turn.conversation + [assistant_message(response["output"])]
    entry = StoredResponse(request_owner(request), response, conversation, prepared.text, array("i", prepared.ids),
                           ctx.tm.tokenizer.decode(output_ids, skip_special_tokens=False), array("i", output_ids))
    response_store(request).put(response["id"], entry)


# Streaming ----------------------------------------------------------------------------------------------------------
class EventStream:
    """Numbers and formats a response's server-sent events (``sequence_number`` counts from 0)."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


class StreamedText:
    """A streamed message (``output_text``) or reasoning (``reasoning_text``) item: added with its content part,
    deltas, done."""

    def __init__(self, events: EventStream, index: int, kind: str):
        self.events, self.index, self.kind, self.text = events, index, kind, ""
        self.id = new_id("msg" if kind == "message" else "rs")
        self.where = {"item_id": self.id, "output_index": index, "content_index": 0}
        self.prefix = "response.output_text" if kind == "message" else "response.reasoning_text"
        self.extra = {"logprobs": []} if kind == "message" else {}

    def item(self, status: str = "completed") -> dict:
        return text_output(self.kind, self.id, self.text, status)

    def open(self) -> list[str]:
        return [self.events("response.output_item.added", output_index=self.index, item=self.item("in_progress")),
                self.events("response.content_part.added", **self.where, part=text_part(self.kind, ""))]

    def add(self, piece: str) -> list[str]:
        self.text += piece
        return [self.events(f"{self.prefix}.delta", **self.where, delta=piece, **self.extra)] if piece else []

    def close(self) -> list[str]:
        return [self.events(f"{self.prefix}.done", **self.where, text=self.text, **self.extra),
                self.events("response.content_part.done", **self.where, part=text_part(self.kind, self.text)),
                self.events("response.output_item.done", output_index=self.index, item=self.item())]


class StreamedCall:
    """A streamed function_call item: added with its name, argument deltas, done. ``calls`` is the parser's list
    of complete calls: a call found there closes with its arguments as parsed, else (cut off) as incomplete."""

    def __init__(self, events: EventStream, index: int, header: dict, calls: list[dict]):
        self.events, self.index, self.calls = events, index, calls
        self.call_index, self.id = header["index"], new_id("fc")
        self.call = {"id": header["id"], "function": {"name": header["function"]["name"], "arguments": ""}}
        self.where = {"item_id": self.id, "output_index": index}

    def item(self, status: str = "completed") -> dict:
        return call_output(self.id, self.call, status)

    def open(self) -> list[str]:
        return [self.events("response.output_item.added", output_index=self.index, item=self.item("in_progress"))]

    def add(self, piece: str) -> list[str]:
        self.call["function"]["arguments"] += piece
        return [self.events("response.function_call_arguments.delta", **self.where, delta=piece)] if piece else []

    def close(self) -> list[str]:
        complete = self.call_index < len(self.calls)
        if complete:
            self.call["function"]["arguments"] = self.calls[self.call_index]["function"]["arguments"]
        self.status = "completed" if complete else "incomplete"
        return [self.events("response.function_call_arguments.done", **self.where,
                            arguments=self.call["function"]["arguments"]),
                self.events("response.output_item.done", output_index=self.index, item=self.item(self.status))]


class StreamedOutput:
    """A streamed generation's output items: the chat route's delta reader splits the text into reasoning,
    content and tool calls; each run of one kind is an item, opened on its first piece and closed when another
    begins or the generation ends. Whitespace alone opens no message (it waits for text)."""

    def __init__(self, events: EventStream, reader: DeltaReader):
        self.events, self.reader = events, reader
        self.items: list = []
        self.pending = ""  # whitespace waiting for a message's text

    @property
    def current(self):
        return self.items[-1] if self.items else None

    def start(self, item) -> list[str]:
        events = self.current.close() if self.current is not None else []
        self.items.append(item)
        return events + item.open()

    def text(self, kind: str, piece: str) -> list[str]:
        current = self.current
        if isinstance(current, StreamedText) and current.kind == kind:
            return current.add(piece)
        if kind == "message" and not piece.strip():
            self.pending += piece
            return []
        piece, self.pending = (self.pending + piece, "") if kind == "message" else (piece, self.pending)
        return self.start(StreamedText(self.events, len(self.items), kind)) + self.current.add(piece)

    def feed(self, text: str, final: bool) -> list[str]:
        delta = self.reader(text, final)
        events = self.text("reasoning", delta["reasoning_content"]) if delta.get("reasoning_content") else []
        if delta.get("content"):
            events += self.text("message", delta["content"])
        calls = self.reader.tools.calls if self.reader.tools is not None else []
        for header in delta.get("tool_calls") or []:
            if "id" in header:
                events += self.start(StreamedCall(self.events, len(self.items), header, calls))
            events += self.current.add(header["function"].get("arguments") or "")
        return events

    def finish(self) -> list[str]:
        if not any(isinstance(i, StreamedText) and i.kind == "message" for i in self.items) and \
                not any(isinstance(i, StreamedCall) for i in self.items):
            events = self.start(StreamedText(self.events, len(self.items), "message")) + self.current.add(self.pending)
        else:
            events = []
        return events + self.current.close()

    def output(self) -> list[dict]:
        return [i.item(getattr(i, "status", "completed")) for i in self.items]


async def response_events(ctx: AppContext, request: Request, turn: Turn, gi, prepared: Prepared,
                          rid: str, created: float) -> AsyncIterator[str]:
    """The streamed response's events; a failure mid-stream is an ``error`` event, then ``response.failed``."""
    events = EventStream()
    started = response_object(ctx, turn, rid, created, "in_progress", [])
    yield events("response.created", response=started)
    yield events("response.in_progress", response=started)
    output = StreamedOutput(events, DeltaReader(ChatOutput.of(ctx, turn.chat, prepared.tools)))
    try:
        last = None
        async for out in ctx.tm.generate(gi):
            last = out
            final = out["meta_info"].get("finish_reason") is not None
            for event in output.feed(out["text"], final):
                yield event
        status = finish_status(last)
    except Exception as exc:  # noqa: BLE001 - told to the client as events; the log has internal errors
        err = {"message": exc.message, "code": exc.status} if isinstance(exc, APIError) else error_body(exc)
        yield events("error", code=str(err["code"]), message=err["message"], param=None)
        failed = {**started, "status": "failed", "error": {"code": "server_error", "message": err["message"]}}
        yield events("response.failed", response=failed)
        return
    for event in output.finish():
        yield event
    response = response_object(ctx, turn, rid, created, status, output.output(), last)
    store_response(ctx, request, turn, prepared, last, response)
    yield events(f"response.{status}", response=response)


# Routes -------------------------------------------------------------------------------------------------------------
async def create_response(request: Request):
    ctx, req = await read_openai_request(request, ResponsesRequest)
    previous = None
    if req.previous_response_id is not None:
        previous = response_store(request).get(req.previous_response_id, request_owner(request))
        if previous is None:
            raise not_found(req.previous_response_id, "previous_response_id")
    turn = Turn.build(req, previous)
    prepared = await off_loop(ctx, request, lambda _cancel: prepare_turn(ctx, turn))
    item = dict(input_ids=prepared.ids, image_data=prepared.images or None, stream=req.stream,
                sampling_params=chat_sampling_params(turn.chat, prepared.tool_params))
    gi = (await prepare_all(ctx, request, [item]))[0]
    rid, created = new_id("resp"), time.time()
    if req.stream:
        return sse_response(response_events(ctx, request, turn, gi, prepared, rid, created))
    out = (await run_all(ctx, request, [gi]))[0]
    status = finish_status(out)
    message = ChatOutput.of(ctx, turn.chat, prepared.tools).message(out["text"])
    response = response_object(ctx, turn, rid, created, status, output_items(message), out)
    store_response(ctx, request, turn, prepared, out, response)
    return response


async def retrieve_response(request: Request, response_id: str):
    entry = response_store(request).get(response_id, request_owner(request))
    if entry is None:
        raise not_found(response_id)
    return entry.response


async def delete_response(request: Request, response_id: str):
    if not response_store(request).pop(response_id, request_owner(request)):
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def register(app: FastAPI) -> None:
    app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))(create_response)
    app.get("/v1/responses/{response_id}")(retrieve_response)
    app.delete("/v1/responses/{response_id}")(delete_response)
