"""Messages between the server's processes (pickled over ZMQ).

TokenizerManager --TokenizedGenerateReq/AbortReq/ControlReq--> Scheduler
Scheduler --TokenOut (per request, new token ids + meta)--> Detokenizer
Detokenizer --StrOut (new text piece + meta)--> TokenizerManager
Scheduler --ControlOut (replies to ControlReq)--> TokenizerManager (through the detokenizer, in order)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: dict
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    extra_key: Any = None
    mm_inputs: Any = None  # multimodal.MultimodalInputs: image hashes, spans, pixel values


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """flush_cache, get_load, get_stats, check_pool: answered with a ControlOut carrying the same id."""

    kind: str
    req_id: str


@dataclass
class ControlOut:
    req_id: str
    result: Any


@dataclass
class TokenOut:
    rid: str
    new_ids: list[int]  # output ids produced since the last TokenOut for this request
    finished_reason: dict | None
    meta: dict = field(default_factory=dict)  # prompt/completion/cached tokens, logprobs added since last
    stream: bool = False
    # Detokenization options, sent once with the first TokenOut of a request.
    detok_options: dict | None = None
    keep_len: int | None = None  # output ids already sent that stay (None: all); jump-forward rewrites tails


@dataclass
class StrOut:
    rid: str
    text: str  # new text since the last StrOut (streaming) or the full text (when finished)
    output_ids: list[int]  # new output ids, to append after the first keep_len already received
    keep_len: int | None
    finished_reason: dict | None
    meta: dict = field(default_factory=dict)


@dataclass
class SchedulerReady:
    info: dict  # context_len, max_total_num_tokens, vocab_size, model_dir, ...


@dataclass
class SchedulerFailed:
    error: str
