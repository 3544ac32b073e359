"""The request front-end shared by the offline ``Engine`` and the server's ``TokenizerManager``: validation and
tokenization of one prompt (``RequestFrontend.prepare``), parallel sampling (``expand_samples``), and each
request's state, which accumulates what the scheduler sends (only what is new per step) into the result dicts
both hand back (``RequestState``).

    Engine / TokenizerManager --prepare--> GenerateInput --tokenized()--> TokenizedGenerateReq --> Scheduler
    Scheduler --BatchTokenOut--> Detokenizer --BatchStrOut--> RequestState.merge --> RequestState.result
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..sampling_params import SamplingParams, parallel_samples, sample_count
from .detokenizer_manager import format_logprob_pairs
from .io_struct import PoolingParams, StrOut, TokenizedGenerateReq
from .validation import (
    MAX_PROMPTS_PER_REQUEST,
    ModelLimits,
    check_grammar,
    check_input_ids,
    check_logprob_args,
    check_session_id,
    check_text,
    check_total_length,
    parse_sampling_params,
)


@dataclass
class GenerateInput:
    """One prompt, tokenized and validated."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # parsed, verified and normalized: the scheduler uses it as is
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    extra_key: object = None
    mm_inputs: object = None  # multimodal.MultimodalInputs for requests with images
    # The id a client gave (shown back to it, usable in /abort_request) and who sent it. In the server ``rid``
    # itself is always generated, so no client can pick, guess or collide with another client's request id.
    client_rid: str | None = None
    owner: str = ""
    reservation: object = None  # its place in the server's bounded queue until generate() starts
    pooling: PoolingParams | None = None  # an embedding request (see io_struct.PoolingParams)
    session_id: str | None = None  # the program / session it belongs to (its KV is pinned between calls)

    def tokenized(self) -> TokenizedGenerateReq:
        start = self.logprob_start_len if self.logprob_start_len is not None else -1  # -1: output logprobs only
        return TokenizedGenerateReq(self.rid, self.input_ids, self.sampling_params, self.return_logprob, start,
                                    self.top_logprobs_num, self.stream, self.extra_key, self.mm_inputs,
                                    self.pooling, self.session_id)


class RequestFrontend:
    """Tokenizes and validates prompts against the model's limits. Thread-safe: one tokenizer call at a time
    (HF fast tokenizers may reconfigure their Rust state per call, which fails when another thread is inside)."""

    def __init__(self, tokenizer, limits: ModelLimits, mm_processor, grammar_cache: Callable[[], Any],
                 lock: threading.Lock | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.mm_processor = mm_processor
        self.grammar_cache = grammar_cache  # called when a request has a grammar (the cache is built lazily)
        self.lock = lock or threading.Lock()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.lock:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def prepare(self, rid: str, *, text: str | None = None, input_ids: list[int] | None = None,
                sampling_params: dict | None = None, stream: bool = False, return_logprob: bool = False,
                logprob_start_len: int | None = None, top_logprobs_num: int | None = 0, extra_key=None,
                image_data=None, add_special_tokens: bool = True,
                cancel: threading.Event | None = None, pooling: PoolingParams | None = None,
                session_id: str | None = None, parsed: dict | None = None) -> GenerateInput:
        """One prompt, as ``rid``; raises ValueError with the reason. Setting ``cancel`` stops a grammar
        compilation in progress. With ``pooling`` it is an embedding request: nothing is generated.
        ``session_id``: the program / session the request belongs to (its KV stays pinned between calls).
        ``parsed``: a dict the caller keeps for the prompts of one batch, which mostly share one sampling-params
        dict: each dict object is parsed once (they stay alive for the batch, so their ids are unique)."""
        check_session_id(session_id)
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if pooling is not None:
            return self.prepare_embedding(rid, text, input_ids, pooling, add_special_tokens)
        if text is not None:
            check_text(text, self.limits)
        ids = self.tokenize(text, add_special_tokens) if text is not None else list(input_ids)
        check_input_ids(ids, self.limits)
        mm_inputs = None
        if image_data is not None:
            if self.mm_processor is None:
                raise ValueError("image_data was given, but this model takes no images")
            ids, mm_inputs = self.mm_processor.expand(ids, image_data, self.limits.context_len,
                                                      self.limits.max_total_num_tokens, return_logprob, logprob_start_len)
        sp = parsed.get(id(sampling_params)) if parsed is not None else None
        if sp is None:
            with self.lock:  # stop strings are tokenized
                sp = parse_sampling_params(sampling_params, self.limits, self.tokenizer)
            if parsed is not None:
                parsed[id(sampling_params)] = sp
        check_total_length(len(ids), sampling_params, sp, self.limits)
        if sp.regex is not None or sp.json_schema is not None or sp.ebnf is not None:
            check_grammar(sp, self.grammar_cache(), cancel)
        check_logprob_args(len(ids), logprob_start_len, top_logprobs_num)
        return GenerateInput(rid, ids, sp, stream, bool(return_logprob), logprob_start_len,
                             int(top_logprobs_num or 0), extra_key, mm_inputs, session_id=session_id)

    def prepare_embedding(self, rid: str, text: str | None, input_ids: list[int] | None, pooling: PoolingParams,
                          add_special_tokens: bool = True) -> GenerateInput:
        """An embedding request: the prompt only, computed and pooled (``max_new_tokens`` 0, never streamed)."""
        if text is not None:
            check_text(text, self.limits)
        ids = self.tokenize(text, add_special_tokens) if text is not None else list(input_ids)
        check_input_ids(ids, self.limits)
        sp = parse_sampling_params({"max_new_tokens": 0}, self.limits, self.tokenizer)
        return GenerateInput(rid, ids, sp, pooling=pooling)


def embedding_result(out: dict) -> dict:
    """A finished embedding request's result as ``Engine.encode`` returns it (upstream SGLang's shape):
    {"embedding": [floats], "meta_info": {prompt_tokens, ...}}."""
    meta = dict(out["meta_info"])
    return {"embedding": meta.pop("embedding"), "meta_info": meta}


def samples_per_prompt(params: list) -> int:
    """``n`` of a batch's sampling params (upstream's parallel sampling): the same for every prompt, and prompts
    x n at most MAX_PROMPTS_PER_REQUEST, checked before a single copy is made. The Engine and /generate alike."""
    counts = {sample_count(p) if p is None or isinstance(p, dict) else 1 for p in params} or {1}
    if len(counts) > 1:
        raise ValueError("sampling_params.n must be the same for every prompt of a batch")
    n = counts.pop()
    if len(params) * n > MAX_PROMPTS_PER_REQUEST:
        raise ValueError(f"sampling_params.n = {n} for {len(params)} prompt(s) asks for {len(params) * n} samples; "
                         f"one request may carry at most {MAX_PROMPTS_PER_REQUEST} (prompts x n)")
    return n


def expand_samples(params: list, *per_prompt: list) -> tuple[int, list, list[list]]:
    """Parallel sampling: (n, each sample's params, each of ``per_prompt`` with its entries repeated n times,
    grouped per prompt)."""
    n = samples_per_prompt(params)
    # Params without "n" stay the caller's object: a batch that passes one dict for every prompt is parsed once.
    samples = [c for p in params for c in (parallel_samples(p) if isinstance(p, dict) and "n" in p else [p])]
    return n, samples, [[v for v in values for _ in range(n)] for values in per_prompt]


@dataclass
class RequestState:
    """One request in flight, on the front-end's side: what has come back so far, and the result dicts."""

    rid: str  # the id shown to the caller
    queue: Any  # where its outputs are put for the caller (an asyncio.Queue in the server, a queue.Queue offline)
    stream: bool
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    meta: dict = field(default_factory=dict)

    def merge(self, msg: StrOut) -> None:
        """Adds one message's new ids, text and logprob entries (lists extend, counts are replaced)."""
        if msg.keep_len is not None:
            del self.output_ids[msg.keep_len:]
            for key in ("output_token_logprobs", "output_top_logprobs"):  # one entry per output id
                del self.meta.get(key, [])[msg.keep_len:]
        self.output_ids.extend(msg.output_ids)
        self.text = msg.text if not self.stream else self.text + msg.text
        for key, value in msg.meta.items():
            if isinstance(value, list):
                self.meta.setdefault(key, []).extend(value)
            else:
                self.meta[key] = value
        self.meta["completion_tokens"] = len(self.output_ids)

    def result(self, text: str, finish_reason) -> dict:
        """The caller's dict: ``text`` (a stream's new piece, or the whole text), all output ids so far, meta."""
        meta = dict(self.meta)
        meta["id"] = self.rid
        meta["finish_reason"] = finish_reason
        meta["e2e_latency"] = time.monotonic() - self.created
        return {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}


LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
TOP_LOGPROB_KEYS = ("input_top_logprobs", "output_top_logprobs")


def format_logprobs(meta: dict, tokenizer, with_text: bool) -> dict:
    """(logprob, token_id) pairs in ``meta`` -> [logprob, token_id, token_text | None], as the native API
    returns them (in place; returns ``meta``)."""
    for key in LOGPROB_KEYS:
        if key in meta:
            meta[key] = format_logprob_pairs(meta[key], tokenizer, with_text)
    for key in TOP_LOGPROB_KEYS:
        if key in meta:
            meta[key] = [None if t is None else format_logprob_pairs(t, tokenizer, with_text) for t in meta[key]]
    return meta
