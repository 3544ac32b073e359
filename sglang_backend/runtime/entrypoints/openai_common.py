"""What /v1/chat/completions and /v1/completions share: sampling parameters from OpenAI fields, usage, finish
reasons, logprob accounting and the chunked SSE stream."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from .app_context import AppContext, get_context
from .errors import APIError
from .openai_protocol import MAX_STOP
from .request_parsing import read_model
from .streaming import merge_streams, sse_event

# (our sampling parameter, the OpenAI request field it comes from)
SAMPLING_FIELDS = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                   ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                   ("repetition_penalty", "repetition_penalty"), ("min_new_tokens", "min_tokens"),
                   ("stop_token_ids", "stop_token_ids"), ("seed", "seed"))
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")


async def read_openai_request(request: Request, model_cls) -> tuple[AppContext, Any]:
    """The app's context and the request's body as ``model_cls`` (any ``model`` name: the one model answers)."""
    return get_context(request), await read_model(request, model_cls)


def sampling_from_openai(req, max_tokens: int | None) -> dict:
    sp: dict[str, Any] = {}
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    for ours, theirs in SAMPLING_FIELDS:
        value = getattr(req, theirs)
        if value is not None:
            sp[ours] = value
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        if len(stops) > MAX_STOP:
            raise APIError(f"at most {MAX_STOP} stop sequences", param="stop")
        sp["stop"] = stops
    if req.logit_bias:
        try:
            sp["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError("logit_bias keys must be token ids", param="logit_bias")
    sp["ignore_eos"] = req.ignore_eos
    sp["skip_special_tokens"] = req.skip_special_tokens
    sp["no_stop_trim"] = req.no_stop_trim
    for name in GRAMMAR_FIELDS:
        value = getattr(req, name)
        if value is not None:
            sp[name] = value if isinstance(value, str) else json.dumps(value)
    return sp


def sample_rid(rid: str | None, index: int, many: bool) -> str | None:
    """The request id of one of a request's several generations: ``rid-index`` (still unique), else ``rid``."""
    return f"{rid}-{index}" if rid and many else rid


def usage(outs: list[dict], prompt_outs: list[dict] | None = None) -> dict:
    prompt_outs = prompt_outs or outs[:1]
    prompt = sum(o["meta_info"].get("prompt_tokens", 0) for o in prompt_outs)
    completion = sum(o["meta_info"].get("completion_tokens", 0) for o in outs)
    cached = sum(o["meta_info"].get("cached_tokens", 0) for o in prompt_outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def ended_on_stop_token(out: dict) -> bool:
    """Whether the output's last token is the stop token that ended it (EOS or a ``stop_token_ids`` entry)."""
    fr = out["meta_info"].get("finish_reason") or {}
    matched = fr.get("matched")
    ids = out.get("output_ids") or []
    return fr.get("type") == "stop" and type(matched) is int and bool(ids) and ids[-1] == matched


def token_entry(tokenizer, tid: int, logprob: float) -> dict:
    """One OpenAI chat logprob entry: the token's text and the token's own bytes. A token that holds part of a
    UTF-8 character decodes to U+FFFD alone, so its bytes come from the vocabulary: the entries' bytes then join
    into the output's bytes, as OpenAI's do."""
    # Deferred: the vocabulary (constrained decoding's) is loaded only for a token that needs it.
    from ..constrained.token_index import get_vocabulary

    tok = tokenizer.decode([tid])
    raw = None
    if "\ufffd" in tok:  # only then did decoding lose bytes (the vocabulary is built on the first such token)
        vocab = get_vocabulary(tokenizer)
        raw = vocab.token_bytes[tid] if 0 <= tid < vocab.size else None
    return {"token": tok, "logprob": logprob, "bytes": list(raw if raw is not None else tok.encode("utf-8"))}


def without_stop_token(out: dict, keep_stop_token: bool = False) -> dict:
    """The output as OpenAI reports it: the stop token that ended it is neither counted in ``completion_tokens``
    nor listed in the logprobs (the native /generate keeps both, as upstream SGLang does). ``keep_stop_token``
    (the request's ``no_stop_trim``) keeps it, as it keeps it in the text. A copy; ``out`` is not changed."""
    if keep_stop_token or not ended_on_stop_token(out):
        return out
    meta = dict(out["meta_info"])
    meta["completion_tokens"] = max(meta.get("completion_tokens", 0) - 1, 0)
    pairs = meta.get("output_token_logprobs")
    if pairs and pairs[-1][1] == out["output_ids"][-1]:
        meta["output_token_logprobs"] = pairs[:-1]
        tops = meta.get("output_top_logprobs")
        if tops and len(tops) == len(pairs):
            meta["output_top_logprobs"] = tops[:-1]
    return {**out, "output_ids": out["output_ids"][:-1], "meta_info": meta}


def finish_reason(out: dict) -> str | None:
    fr = out["meta_info"].get("finish_reason")
    if fr is None:
        return None
    return {"stop": "stop", "length": "length"}.get(fr["type"], "abort")


def sent_logprobs(out: dict) -> int:
    """Logprob entries of an output so far: the prompt's (completions with echo) and the output tokens'."""
    meta = out["meta_info"]
    return len(meta.get("input_token_logprobs") or []) + len(meta.get("output_token_logprobs") or [])


def include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def response_header(prefix: str, obj: str, model: str) -> dict:
    """The fields every OpenAI response and chunk starts with."""
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


class StreamedChoices:
    """Base of a stream's choice builder: remembers how many logprobs each sample has sent."""

    def __init__(self, samples: int):
        self.lp_sent = [0] * samples

    def advance_logprobs(self, i: int, out: dict) -> int:
        """Where sample ``i``'s unsent logprobs start; from now on, all of ``out``'s count as sent."""
        start, self.lp_sent[i] = self.lp_sent[i], sent_logprobs(out)
        return start


async def openai_sse(streams: list[AsyncIterator[dict]], header: dict, choice: Callable[[int, dict], dict],
                     with_usage: bool, final_usage: Callable[[list[dict]], dict],
                     keep_stop_token: bool = False) -> AsyncIterator[str]:
    """One chunk per output of any of the streams (``choice(index, output)`` shapes its choice), then, if asked
    for, a chunk with no choices and the usage of the outputs that finished (``final_usage``). Outputs are seen
    as OpenAI counts them (``without_stop_token``)."""
    finals: dict[int, dict] = {}
    async for i, out in merge_streams(streams):
        out = without_stop_token(out, keep_stop_token)
        one = choice(i, out)
        if one["finish_reason"] is not None:
            finals[i] = out
        yield sse_event({**header, "choices": [one]})
    if with_usage:
        yield sse_event({**header, "choices": [], "usage": final_usage(list(finals.values()))})
