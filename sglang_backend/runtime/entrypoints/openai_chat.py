"""OpenAI-compatible /v1/chat/completions."""

from __future__ import annotations

import inspect
import json

from fastapi import FastAPI, Request

from ..sampling_params import parallel_samples
from .app_context import AppContext
from .errors import APIError
from .execution import off_loop, output_streams, prepare_all, render_chat_prompt, run_all
from .openai_common import (StreamedChoices, finish_reason, include_usage, openai_sse, read_openai_request,
                            response_header, sample_rid, sampling_from_openai, sent_logprobs, usage,
                            without_stop_token)
from .openai_protocol import ChatCompletionRequest
from .request_parsing import json_body
from .streaming import sse_response

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


def render_chat(ctx: AppContext, req: ChatCompletionRequest, images: list | None = None) -> str:
    """The chat prompt; image parts become the model's image placeholder, their URLs go to ``images``."""
    tm = ctx.tm
    image_token = None if tm.mm_processor is None else tm.mm_processor.image_token
    messages = chat_messages(req, image_token, images)
    if req.tools:
        raise APIError("tool calling is not supported by this server yet", param="tools")
    template_vars = template_variables(req, reserved_template_args(tm.tokenizer.apply_chat_template))
    return render_chat_prompt(ctx, messages, add_generation_prompt=not req.continue_final_message,
                              continue_final_message=req.continue_final_message, **template_vars)


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


def chat_sampling_params(req: ChatCompletionRequest) -> dict:
    sp = sampling_from_openai(req, req.max_completion_tokens or req.max_tokens)
    if req.response_format is not None and req.response_format.type != "text":
        sp.pop("regex", None)
        sp["json_schema"] = json.dumps(response_format_schema(req.response_format))
    return sp


def chat_inputs(req: ChatCompletionRequest, prompt: str, images: list, sp: dict) -> list[dict]:
    """The tokenizer manager's inputs, one per sample (``n``). With images, the tokenizer manager tokenizes the
    prompt and expands its image placeholders."""
    src = dict(text=prompt, image_data=images or None, add_special_tokens=False)
    return [dict(**src, sampling_params=s, stream=req.stream, return_logprob=req.logprobs,
                 top_logprobs_num=req.top_logprobs or 0, rid=sample_rid(req.rid, i, req.n > 1))
            for i, s in enumerate(parallel_samples({**sp, "n": req.n}))]


# Response -----------------------------------------------------------------------------------------------------------
def token_entry(tokenizer, tid: int, logprob: float) -> dict:
    tok = tokenizer.decode([tid])
    return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}


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


def chat_choice(out: dict, index: int, req: ChatCompletionRequest, tokenizer) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": out["text"]},
            "logprobs": chat_logprobs(out, tokenizer, req.top_logprobs or 0) if req.logprobs else None,
            "finish_reason": finish_reason(out)}


class ChatDeltas(StreamedChoices):
    """The streamed choices of one chat request: each sample's first delta carries the role, and each output's
    logprobs only for the tokens not sent yet."""

    def __init__(self, req: ChatCompletionRequest, tokenizer, samples: int):
        super().__init__(samples)
        self.req, self.tokenizer = req, tokenizer
        self.first = {i: True for i in range(samples)}

    def __call__(self, i: int, out: dict) -> dict:
        delta = {"content": out["text"]}
        if self.first[i]:
            delta["role"] = "assistant"
            self.first[i] = False
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason(out)}
        if self.req.logprobs and sent_logprobs(out) > self.lp_sent[i]:
            choice["logprobs"] = chat_logprobs(out, self.tokenizer, self.req.top_logprobs or 0,
                                               self.advance_logprobs(i, out))
        return choice


async def chat_completions(request: Request):
    ctx, req = await read_openai_request(request, ChatCompletionRequest)
    images: list = []
    prompt = await off_loop(ctx, request, lambda _cancel: render_chat(ctx, req, images))
    gis = await prepare_all(ctx, request, chat_inputs(req, prompt, images, chat_sampling_params(req)))
    tokenizer = ctx.tm.tokenizer
    if req.stream:
        header = response_header("chatcmpl", "chat.completion.chunk", ctx.response_model(req.model))
        return sse_response(openai_sse(output_streams(ctx, gis), header, ChatDeltas(req, tokenizer, len(gis)),
                                       include_usage(req), usage, req.no_stop_trim))
    header = response_header("chatcmpl", "chat.completion", ctx.response_model(req.model))
    outs = [without_stop_token(o, req.no_stop_trim) for o in await run_all(ctx, request, gis)]
    return {**header, "choices": [chat_choice(out, i, req, tokenizer) for i, out in enumerate(outs)], "usage": usage(outs)}


def register(app: FastAPI) -> None:
    app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))(chat_completions)
