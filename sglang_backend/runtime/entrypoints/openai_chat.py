"""OpenAI-compatible /v1/chat/completions."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

from fastapi import FastAPI, Request

from ..sampling_params import parallel_samples
from .app_context import AppContext
from .errors import APIError
from .execution import off_loop, output_streams, prepare_all, render_chat_prompt, run_all
from .openai_common import (StreamedChoices, finish_reason, include_usage, openai_sse, read_openai_request,
                            response_header, sample_rid, sampling_from_openai, sent_logprobs, token_entry, usage,
                            without_stop_token)
from .openai_protocol import ChatCompletionRequest
from .reasoning import ReasoningStreamParser, split_reasoning
from .request_parsing import json_body
from .streaming import sse_response
from .tool_calls import (DEFAULT_MAX_REGEX_CHARS, TOOLS_REGEX_CHARS_FACTOR, ToolCallStreamParser, ToolSpec,
                         detect_format, parse_tool_calls, prompt_messages, special_trigger_ids, template_renders_tools,
                         template_text, tool_constraint, validate_tools)

IMAGE_PART_TYPES = ("image_url", "input_image", "image")


# Prompt -------------------------------------------------------------------------------------------------------------
def message_content(content, image_token: str | None, images: list | None) -> str | None:
    """A message's text; image parts become ``image_token``, their URLs go to ``images``."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(str(part.get("text", "")))
        elif kind in IMAGE_PART_TYPES:
            if image_token is None or images is None:
                raise APIError("this model takes no images", param="messages")
            url = part.get("image_url", part.get("image"))
            images.append(url.get("url") if isinstance(url, dict) else url)
            parts.append(image_token)
        else:
            raise APIError(f"unsupported content part type {kind!r}", param="messages")
    return "".join(parts)


def chat_messages(req: ChatCompletionRequest, image_token: str | None, images: list | None) -> list[dict]:
    """The conversation as the chat template takes it ("developer" is a system message)."""
    messages = []
    for m in req.messages:
        msg = {"role": "system" if m.role == "developer" else m.role,
               "content": message_content(m.content, image_token, images) or ""}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    return messages


def reserved_template_args(apply_chat_template) -> set[str]:
    """apply_chat_template's own parameters (chat_template, tokenize, tools, ...) and the conversation itself:
    not template variables, so never taken from a request's chat_template_kwargs."""
    return {name for name, p in inspect.signature(apply_chat_template).parameters.items()
            if p.kind is not inspect.Parameter.VAR_KEYWORD} | {"messages", "conversation"}


def template_variables(req: ChatCompletionRequest, reserved: set[str]) -> dict:
    template_vars = req.chat_template_kwargs or {}
    refused = sorted(set(template_vars) & reserved)
    if refused:
        # Only the server's template runs (a client's template is code: chat_templates.py); clients set
        # template variables, as upstream's chat_template_kwargs does.
        raise APIError(f"chat_template_kwargs sets template variables only; {refused} cannot be set "
                       f"(the server renders its own chat template)", param="chat_template_kwargs")
    return template_vars


@dataclass
class ChatTools:
    """A chat request's tools, resolved for this server's model: the validated tools and choice, the call format,
    whether the chat template renders ``tools`` itself, and the format's opener as a special token (if it is one).
    The Responses route uses it too: ``chat_tools`` -> ``render_chat(..., tools=)`` -> ``chat_sampling_params(req,
    tools.sampling_params(ctx))`` -> ``tool_calls.parse_tool_calls(text, tools.fmt)``."""

    spec: ToolSpec
    fmt: str
    renders_tools: bool
    special: dict

    def sampling_params(self, ctx: AppContext | None = None) -> dict:
        """The tool-call grammar (``{}`` without active tools) and, where the call opener is a special token,
        ``skip_special_tokens`` off (the parser must see it). Builds regexes: call it off the event loop."""
        if not self.spec.active:
            return {}
        limit = DEFAULT_MAX_REGEX_CHARS if ctx is None else \
            TOOLS_REGEX_CHARS_FACTOR * ctx.server_args.grammar_max_regex_chars
        sp = tool_constraint(self.spec, self.fmt, self.special, limit)
        return {**sp, "skip_special_tokens": False} if self.special else sp


def chat_tools(ctx: AppContext, req: ChatCompletionRequest) -> ChatTools:
    """``req``'s tools checked (400 when malformed) and the call format of the server's model."""
    spec = validate_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    template = template_text(ctx.tm.tokenizer)
    fmt = detect_format(template, ctx.server_args.tool_call_parser)
    renders = template_renders_tools(template)
    return ChatTools(spec, fmt, renders, special_trigger_ids(ctx.tm.tokenizer, fmt) if spec.active else {})


def render_chat(ctx: AppContext, req: ChatCompletionRequest, images: list | None = None,
                tools: ChatTools | None = None) -> str:
    """The chat prompt; image parts become the model's image placeholder, their URLs go to ``images``. Tools,
    assistant tool calls and tool results go through the template (or the Hermes fallback: ``tool_calls``)."""
    tm = ctx.tm
    image_token = None if tm.mm_processor is None else tm.mm_processor.image_token
    tools = tools or chat_tools(ctx, req)
    messages, tool_args = prompt_messages(chat_messages(req, image_token, images), tools.spec, tools.renders_tools)
    template_vars = template_variables(req, reserved_template_args(tm.tokenizer.apply_chat_template))
    return render_chat_prompt(ctx, messages, add_generation_prompt=not req.continue_final_message,
                              continue_final_message=req.continue_final_message, **tool_args, **template_vars)


def prepare_chat(ctx: AppContext, req: ChatCompletionRequest, images: list) -> tuple[str, ChatTools, dict]:
    """A preparation job: (prompt, tools, their sampling params)."""
    tools = chat_tools(ctx, req)
    return render_chat(ctx, req, images, tools), tools, tools.sampling_params(ctx)


# Request ------------------------------------------------------------------------------------------------------------
def response_format_schema(rf) -> dict:
    """OpenAI response_format -> the JSON schema the output is constrained to."""
    if rf.type == "json_object":
        return {"type": "object"}
    spec = rf.json_schema or {}
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError("response_format.json_schema.schema must be a JSON schema object", param="response_format")
    return schema


def chat_sampling_params(req: ChatCompletionRequest, tool_params: dict | None = None) -> dict:
    """Sampling params of a chat request; ``tool_params`` (``ChatTools.sampling_params``), when tools are
    active, replace any other grammar (the calls' grammar decides the output)."""
    sp = sampling_from_openai(req, req.max_completion_tokens or req.max_tokens)
    if req.response_format is not None and req.response_format.type != "text":
        sp.pop("regex", None)
        sp["json_schema"] = json.dumps(response_format_schema(req.response_format))
    if tool_params:
        for name in ("regex", "json_schema", "ebnf"):
            sp.pop(name, None)
        sp.update(tool_params)
    return sp


def chat_inputs(req: ChatCompletionRequest, prompt: str, images: list, sp: dict) -> list[dict]:
    """The tokenizer manager's inputs, one per sample (``n``). With images, the tokenizer manager tokenizes the
    prompt and expands its image placeholders."""
    src = dict(text=prompt, image_data=images or None, add_special_tokens=False)
    return [dict(**src, sampling_params=s, stream=req.stream, return_logprob=req.logprobs,
                 top_logprobs_num=req.top_logprobs or 0, rid=sample_rid(req.rid, i, req.n > 1),
                 session_id=req.session_id)
            for i, s in enumerate(parallel_samples({**sp, "n": req.n}))]


# Response -----------------------------------------------------------------------------------------------------------
def chat_logprobs(out: dict, tokenizer, top: int, start: int = 0) -> dict:
    """OpenAI chat logprobs for output tokens from ``start`` (streams send each token once)."""
    items = []
    tops = out["meta_info"].get("output_top_logprobs") or []
    for i, (lp, tid) in enumerate(out["meta_info"].get("output_token_logprobs", [])):
        if i < start:
            continue
        entry = {**token_entry(tokenizer, tid, lp), "top_logprobs": []}
        if top and i < len(tops):
            entry["top_logprobs"] = [token_entry(tokenizer, t, v) for v, t in tops[i]]
        items.append(entry)
    return {"content": items}


@dataclass
class ChatOutput:
    """How a chat request's outputs are read: reasoning split off (``--reasoning-parser``), then tool calls
    parsed (when tools are active)."""

    reasoning_parser: str
    tool_format: str | None

    @classmethod
    def of(cls, ctx: AppContext, req: ChatCompletionRequest, tools: ChatTools) -> ChatOutput:
        parser = ctx.server_args.reasoning_parser if req.separate_reasoning else "none"
        return cls(parser, tools.fmt if tools.spec.active else None)

    def message(self, text: str) -> dict:
        """The assistant message of a whole output: content (None when only calls), reasoning, tool_calls."""
        reasoning = None
        if self.reasoning_parser != "none":
            reasoning, text = split_reasoning(text, self.reasoning_parser)
        msg: dict = {"role": "assistant", "content": text}
        if self.tool_format is not None:
            content, calls = parse_tool_calls(text, self.tool_format)
            if calls:
                msg.update(content=content, tool_calls=calls)
        if reasoning is not None:
            msg.update(reasoning_content=reasoning, reasoning=reasoning)  # both names: clients differ
        return msg


def chat_finish_reason(out: dict, has_calls: bool) -> str | None:
    reason = finish_reason(out)
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_choice(out: dict, index: int, req: ChatCompletionRequest, tokenizer, reader: ChatOutput | None = None) -> dict:
    message = (reader or ChatOutput("none", None)).message(out["text"])
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(out, tokenizer, req.top_logprobs or 0) if req.logprobs else None,
            "finish_reason": chat_finish_reason(out, bool(message.get("tool_calls")))}


class DeltaReader:
    """One streamed sample's text deltas -> delta fields: ``reasoning_content`` (and ``reasoning``), ``content``,
    ``tool_calls`` (one entry per call index in a chunk: a call's header and first argument fragment merged)."""

    def __init__(self, reader: ChatOutput):
        self.reasoning = ReasoningStreamParser(reader.reasoning_parser)
        self.tools = ToolCallStreamParser(reader.tool_format) if reader.tool_format else None

    def __call__(self, text: str, final: bool) -> dict:
        reasoning, content = self.reasoning.feed(text)
        if final:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        delta: dict = {}
        if reasoning:
            delta.update(reasoning_content=reasoning, reasoning=reasoning)
        if self.tools is None:
            return {**delta, "content": content} if content or not delta else delta
        events = self.tools.feed(content) + (self.tools.finish() if final else [])
        text_out = "".join(e["content"] for e in events if "content" in e)
        calls: list[dict] = []
        for e in (e["tool_call"] for e in events if "tool_call" in e):
            if calls and calls[-1]["index"] == e["index"]:
                calls[-1]["function"]["arguments"] += e["function"]["arguments"]
            else:
                calls.append({**e, "function": dict(e["function"])})
        if calls:
            delta["tool_calls"] = calls
        if text_out or not delta:
            delta["content"] = text_out
        return delta


class ChatDeltas(StreamedChoices):
    """The streamed choices of one chat request: each sample's first delta carries the role, and each output's
    logprobs only for the tokens not sent yet."""

    def __init__(self, req: ChatCompletionRequest, tokenizer, samples: int, reader: ChatOutput | None = None):
        super().__init__(samples)
        self.req, self.tokenizer = req, tokenizer
        self.first = {i: True for i in range(samples)}
        reader = reader or ChatOutput("none", None)
        self.readers = [DeltaReader(reader) for _ in range(samples)]

    def __call__(self, i: int, out: dict) -> dict:
        reason = finish_reason(out)
        delta = self.readers[i](out["text"], reason is not None)
        if self.first[i]:
            delta = {"role": "assistant", **delta}
            self.first[i] = False
        tools = self.readers[i].tools
        choice = {"index": i, "delta": delta, "logprobs": None,
                  "finish_reason": chat_finish_reason(out, bool(tools and tools.calls))}
        if self.req.logprobs and sent_logprobs(out) > self.lp_sent[i]:
            choice["logprobs"] = chat_logprobs(out, self.tokenizer, self.req.top_logprobs or 0,
                                               self.advance_logprobs(i, out))
        return choice


async def chat_completions(request: Request):
    ctx, req = await read_openai_request(request, ChatCompletionRequest)
    images: list = []
    prompt, tools, tool_params = await off_loop(ctx, request, lambda _cancel: prepare_chat(ctx, req, images))
    gis = await prepare_all(ctx, request, chat_inputs(req, prompt, images, chat_sampling_params(req, tool_params)))
    tokenizer, reader = ctx.tm.tokenizer, ChatOutput.of(ctx, req, tools)
    if req.stream:
        header = response_header("chatcmpl", "chat.completion.chunk", ctx.response_model(req.model))
        return sse_response(openai_sse(output_streams(ctx, gis), header,
                                       ChatDeltas(req, tokenizer, len(gis), reader),
                                       include_usage(req), usage, req.no_stop_trim))
    header = response_header("chatcmpl", "chat.completion", ctx.response_model(req.model))
    outs = [without_stop_token(o, req.no_stop_trim) for o in await run_all(ctx, request, gis)]
    return {**header, "choices": [chat_choice(out, i, req, tokenizer, reader) for i, out in enumerate(outs)],
            "usage": usage(outs)}


def register(app: FastAPI) -> None:
    app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))(chat_completions)
