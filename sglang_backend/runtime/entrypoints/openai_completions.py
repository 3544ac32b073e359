"""OpenAI-compatible /v1/completions."""

from __future__ import annotations

from fastapi import FastAPI, Request

from ..sampling_params import parallel_samples
from .errors import APIError
from .execution import output_streams, prepare_all, run_all
from .openai_common import (StreamedChoices, finish_reason, include_usage, openai_sse, read_openai_request,
                            response_header, sample_rid, sampling_from_openai, usage, without_stop_token)
from .openai_protocol import CompletionRequest
from .request_parsing import check_count, json_body
from .streaming import sse_response


def completion_prompts(req: CompletionRequest) -> list:
    """The request's prompts: each a string or a list of token ids."""
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
    return prompts


def completion_inputs(req: CompletionRequest, prompts: list, sp: dict) -> list[dict]:
    """The tokenizer manager's inputs: ``n`` samples of each prompt, grouped per prompt."""
    kwargs: list[dict] = []
    many = len(prompts) * req.n > 1
    for p in prompts:
        for s in parallel_samples({**sp, "n": req.n}):
            text, ids = (p, None) if isinstance(p, str) else (None, p)
            kwargs.append(dict(text=text, input_ids=ids, sampling_params=s, stream=req.stream,
                               return_logprob=req.logprobs is not None, top_logprobs_num=req.logprobs or 0,
                               logprob_start_len=0 if echo_logprobs(req) else None,
                               rid=sample_rid(req.rid, len(kwargs), many), session_id=req.session_id))
    return kwargs


def echo_logprobs(req: CompletionRequest) -> bool:
    """``echo`` with ``logprobs``: the logprobs cover the prompt's tokens too (the first has none), as OpenAI's
    API and vLLM return them; with ``max_tokens`` 0 that scores a text (lm-evaluation-harness loglikelihoods)."""
    return req.echo and req.logprobs is not None


def echo_texts(req: CompletionRequest, prompts: list, decode) -> list[str]:
    """What each choice's text starts with: its prompt with ``echo``, else nothing."""
    return [(p if isinstance(p, str) else decode(p)) if req.echo else "" for p in prompts for _ in range(req.n)]


def completion_logprobs(out: dict, tokenizer, start: int = 0) -> dict:
    """OpenAI's logprobs of a choice from entry ``start`` on (``sent_logprobs`` counts them); with echo logprobs
    (``input_token_logprobs`` in the output) the prompt's tokens come first, the first of them with no logprob,
    as in OpenAI's API."""
    meta = out["meta_info"]
    inputs = list(meta.get("input_token_logprobs") or [])
    input_tops = list(meta.get("input_top_logprobs") or [])
    entries = inputs + list(meta.get("output_token_logprobs") or [])
    # Aligned with entries: the prompt's top lists (padded with None if absent), then the outputs'.
    top_list = input_tops + [None] * (len(inputs) - len(input_tops)) + list(meta.get("output_top_logprobs") or [])
    has_tops = bool(input_tops or meta.get("output_top_logprobs"))
    tokens, lps, tops = [], [], []
    for i, (lp, tid) in enumerate(entries):
        if i < start:
            continue
        tokens.append(tokenizer.decode([tid]))
        lps.append(lp)
        top = top_list[i] if i < len(top_list) else None
        tops.append(None if top is None else {tokenizer.decode([t]): v for v, t in top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if has_tops else None, "text_offset": []}


def completion_choice(out: dict, index: int, req: CompletionRequest, echo: str, tokenizer) -> dict:
    return {"index": index, "text": echo + out["text"],
            "logprobs": completion_logprobs(out, tokenizer) if req.logprobs is not None else None,
            "finish_reason": finish_reason(out)}


def completion_usage(outs: list[dict], n: int) -> dict:
    """Usage of a request's outputs; each prompt counted once, not once per sample."""
    return usage(outs, outs[::n])


class CompletionDeltas(StreamedChoices):
    """The streamed choices of one completion request: the echo goes before a sample's first text, each output's
    logprobs only for the tokens not sent yet."""

    def __init__(self, req: CompletionRequest, tokenizer, echoes: list[str]):
        super().__init__(len(echoes))
        self.req, self.tokenizer, self.echoes = req, tokenizer, echoes
        self.echoed: set[int] = set()

    def __call__(self, i: int, out: dict) -> dict:
        text = out["text"]
        if self.req.echo and i not in self.echoed:
            text = self.echoes[i] + text
            self.echoed.add(i)
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason(out)}
        if self.req.logprobs is not None:
            choice["logprobs"] = completion_logprobs(out, self.tokenizer, self.advance_logprobs(i, out))
        return choice


async def completions(request: Request):
    ctx, req = await read_openai_request(request, CompletionRequest)
    prompts = completion_prompts(req)
    check_count(len(prompts) * req.n)
    gis = await prepare_all(ctx, request, completion_inputs(req, prompts, sampling_from_openai(req, req.max_tokens)))
    tokenizer = ctx.tm.tokenizer
    header = response_header("cmpl", "text_completion", ctx.response_model(req.model))
    echoes = echo_texts(req, prompts, tokenizer.decode)
    if req.stream:
        return sse_response(openai_sse(output_streams(ctx, gis), header, CompletionDeltas(req, tokenizer, echoes),
                                       include_usage(req), lambda outs: completion_usage(outs, req.n),
                                       req.no_stop_trim))
    outs = [without_stop_token(o, req.no_stop_trim) for o in await run_all(ctx, request, gis)]
    choices = [completion_choice(out, i, req, echoes[i], tokenizer) for i, out in enumerate(outs)]
    return {**header, "choices": choices, "usage": completion_usage(outs, req.n)}


def register(app: FastAPI) -> None:
    app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))(completions)
