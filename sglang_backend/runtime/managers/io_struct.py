"""Messages between the server's processes (pickled over ZMQ).

TokenizerManager --TokenizedGenerateReq/AbortReq/ControlReq--> Scheduler
Scheduler --BatchTokenOut (one per step: a TokenOut per request with output, only what is new)--> Detokenizer
Detokenizer --BatchStrOut (a StrOut per request: new text piece + what is new)--> TokenizerManager
Scheduler --ControlOut (replies to ControlReq)--> TokenizerManager (through the detokenizer, in order)

The offline Engine passes the same objects in-process (no pickling): a TokenizedGenerateReq to the scheduler,
each step's BatchTokenOut through the same ``Detokenizer`` and into the same ``RequestState``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplingParams
from ..server_args import EMBEDDING_POOLINGS


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: the prompt is computed (extend only, nothing sampled) and its final hidden states
    pooled into one vector, which comes back in the finished output's ``meta["embedding"]``."""

    mode: str = "last"  # "last": the last prompt token's state; "mean": the mean over every prompt token
    normalize: bool = True  # to unit L2 norm (cosine similarity becomes a dot product)

    def __post_init__(self):
        if self.mode not in EMBEDDING_POOLINGS:
            raise ValueError(f"pooling must be one of {EMBEDDING_POOLINGS}, got {self.mode!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # validated and normalized by the front-end: the scheduler uses it as is
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    extra_key: Any = None
    mm_inputs: Any = None  # multimodal.MultimodalInputs: image hashes, spans, pixel values
    pooling: PoolingParams | None = None  # set: an embedding request (no tokens are generated)
    session_id: str | None = None  # the program / session the request belongs to (its KV is pinned between calls)


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """flush_cache, get_load, get_stats, check_pool, end_session: answered with a ControlOut carrying the same id."""

    kind: str
    req_id: str
    payload: Any = None  # end_session: the session id


@dataclass
class ControlOut:
    req_id: str
    result: Any


@dataclass
class TokenOut:
    rid: str
    new_ids: list[int]  # output ids produced since the last TokenOut for this request
    finished_reason: dict | None
    # prompt/cached token counts (first message and when finished), logprob entries added since the last one
    meta: dict = field(default_factory=dict)
    stream: bool = False
    # Detokenization options, sent once with the first TokenOut of a request.
    detok_options: dict | None = None
    keep_len: int | None = None  # output ids already sent that stay (None: all); jump-forward rewrites tails


@dataclass
class BatchTokenOut:
    """One scheduler step's output: one message (one pickle) for every request that advanced."""

    outputs: list[TokenOut]


@dataclass
class StrOut:
    rid: str
    text: str  # new text since the last StrOut (streaming) or the full text (when finished)
    output_ids: list[int]  # new output ids, to append after the first keep_len already received
    keep_len: int | None
    finished_reason: dict | None
    meta: dict = field(default_factory=dict)


@dataclass
class BatchStrOut:
    outputs: list[StrOut]


@dataclass
class SchedulerReady:
    info: dict  # context_len, max_total_num_tokens, vocab_size, model_dir, ...


@dataclass
class SchedulerFailed:
    error: str
