"""SGLang's native /generate (single prompts, batches, parallel samples, streams)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request

from ..managers.detokenizer_manager import format_logprob_pairs
from ..managers import request_frontend
from .app_context import AppContext, get_context
from .errors import APIError
from .execution import output_streams, prepare_all, run_all
from .openai_protocol import GenerateRequest
from .request_parsing import check_count, json_body, read_model
from .streaming import merge_streams, sse_event, sse_response

# Fields sglang-router sends with their defaults; the features behind them are not implemented.
UNSUPPORTED_FLAGS = ("background", "return_hidden_states", "return_bytes", "return_entropy")
PER_PROMPT_FIELDS = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num")


@dataclass
class GeneratePlan:
    """A /generate request taken apart: one entry of ``inputs`` per generation (prompt x sample)."""

    inputs: list[dict]
    is_batch: bool
    n_samples: int

    @property
    def returns_list(self) -> bool:
        return self.is_batch or self.n_samples > 1


def check_supported(obj: GenerateRequest) -> None:
    for flag in UNSUPPORTED_FLAGS:
        if getattr(obj, flag):
            raise APIError(f"{flag} is not supported by this server", param=flag)
    if (obj.text is None) == (obj.input_ids is None):
        raise APIError("give exactly one of text or input_ids")


def prompt_items(obj: GenerateRequest) -> tuple[bool, list]:
    """(is_batch, the prompts): texts or token id lists."""
    is_batch = isinstance(obj.text, list) or (obj.input_ids is not None and bool(obj.input_ids)
                                              and isinstance(obj.input_ids[0], list))
    source = obj.text if obj.text is not None else obj.input_ids
    items = source if is_batch else [source]
    if is_batch and not items:
        raise APIError("empty batch")
    check_count(len(items))
    return is_batch, items


def per_prompt(value, name: str, is_batch: bool, n: int) -> list:
    """A field's value for each of ``n`` prompts: a list gives one per prompt (batches only), else one for all."""
    if isinstance(value, list):
        if not is_batch:
            raise APIError(f"{name} is a list but the request has one prompt", param=name)
        if len(value) != n:
            raise APIError(f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value
    return [value] * n


def per_prompt_columns(obj: GenerateRequest, is_batch: bool, n: int) -> dict[str, list]:
    """Every per-prompt field as one list of ``n`` values (the checks in the order clients have always seen)."""
    cols = {name: per_prompt(getattr(obj, name), name, is_batch, n) for name in PER_PROMPT_FIELDS}
    cols["rid"] = per_prompt(obj.rid, "rid", is_batch, n) if obj.rid is not None else [None] * n
    if obj.rid is not None and len(set(cols["rid"])) != len(cols["rid"]):
        raise APIError("rid values must be unique within a batch", param="rid")
    if obj.stream and is_batch:
        raise APIError("stream=true takes a single prompt")
    # image_data: one prompt takes an image or a list of them; a batch takes one such entry per prompt.
    cols["image_data"] = [obj.image_data] if not is_batch else per_prompt(obj.image_data, "image_data", is_batch, n)
    return cols


def expand_samples(cols: dict[str, list]) -> tuple[int, dict[str, list]]:
    """(n, each prompt's columns repeated for its n samples, grouped per prompt (request_frontend.expand_samples, as
    the Engine does); each sample its own sampling params and its own request id ``rid-i`` (still unique))."""
    names = [name for name in cols if name != "sampling_params"]
    try:
        n, sps, columns = request_frontend.expand_samples(cols["sampling_params"], *(cols[k] for k in names))
    except ValueError as e:
        raise APIError(str(e), param="n") from None
    out = dict(zip(names, columns), sampling_params=sps)
    if n > 1:
        out["rid"] = [None if rid is None else f"{rid}-{i}" for rid in cols["rid"] for i in range(n)]
    return n, out


def generate_plan(obj: GenerateRequest) -> GeneratePlan:
    check_supported(obj)
    is_batch, items = prompt_items(obj)
    cols = per_prompt_columns(obj, is_batch, len(items))
    n_samples, cols = expand_samples({"item": items, **cols})
    inputs = []
    for item, sp, lp, st, top, rid, im in zip(*(cols[k] for k in ("item", *PER_PROMPT_FIELDS, "rid", "image_data"))):
        text, ids = (item, None) if isinstance(item, str) else (None, item)
        inputs.append(dict(text=text, input_ids=ids, sampling_params=sp, rid=rid, stream=obj.stream,
                           return_logprob=bool(lp), logprob_start_len=st, top_logprobs_num=top, image_data=im,
                           session_id=obj.session_id))
    return GeneratePlan(inputs, is_batch, n_samples)


def format_logprobs(out: dict, tokenizer, with_text: bool) -> dict:
    """An output's logprobs as (logprob, token id[, text]) entries, in place."""
    meta = out["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = format_logprob_pairs(meta[key], tokenizer, with_text)
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = [None if t is None else format_logprob_pairs(t, tokenizer, with_text) for t in meta[key]]
    return out


async def generate_events(ctx: AppContext, gis: list, with_text: bool):
    tokenizer = ctx.tm.tokenizer
    if len(gis) == 1:
        async for out in ctx.tm.generate(gis[0]):
            yield sse_event(format_logprobs(out, tokenizer, with_text))
        return
    # n > 1: the samples' chunks interleave; each carries its sample's "index" (as upstream's).
    async for i, out in merge_streams(output_streams(ctx, gis)):
        yield sse_event({**format_logprobs(out, tokenizer, with_text), "index": i})


async def generate(request: Request):
    ctx = get_context(request)
    obj = await read_model(request, GenerateRequest)
    plan = generate_plan(obj)
    gis = await prepare_all(ctx, request, plan.inputs)
    with_text = obj.return_text_in_logprobs
    if obj.stream:
        return sse_response(generate_events(ctx, gis, with_text))
    outs = [format_logprobs(o, ctx.tm.tokenizer, with_text) for o in await run_all(ctx, request, gis)]
    return outs if plan.returns_list else outs[0]


def register(app: FastAPI) -> None:
    app.post("/generate", openapi_extra=json_body(GenerateRequest))(generate)
