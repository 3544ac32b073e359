"""Request state (``Req``) and the per-step batch built from requests (``ScheduleBatch``).

KV bookkeeping of a request: ``req_to_token[req_pool_idx, :kv_len]`` holds the KV slots of
``all_ids[:kv_len]``. The first ``len(prefix_indices)`` of them belong to the radix tree (locked through
``last_node``); the rest are the request's own until it finishes and hands them to the tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model_executor.forward_batch import ForwardBatch, ForwardMode, cascade_worthwhile, upload_int64
from ..sampling_params import SamplingParams


def finish_stop(matched) -> dict:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_abort(message: str, status_code: int = 400) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code}


NOTHING_REWRITTEN = 1 << 62  # Req.output_ids_rewritten_from while jump-forward has re-tokenized nothing unsent


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        extra_key=None,
        stream: bool = False,
        mm_inputs=None,
        pooling=None,
        session_id: str | None = None,
    ):
        self.rid = rid
        self.session_id = session_id  # a program / session: its KV is pinned between its calls (SessionPins)
        self.origin_input_ids = list(input_ids)
        # Images: their placeholder spans in input_ids hold hash-derived, out-of-vocabulary pad ids.
        self.mm_inputs = mm_inputs or None
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.extra_key = extra_key
        self.stream = stream

        # Logprobs. logprob_start_len -1 means "output logprobs only".
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len if logprob_start_len >= 0 else len(input_ids)
        self.top_logprobs_num = top_logprobs_num
        self.input_token_logprobs: list = []  # (logprob | None, token_id) per prompt token from logprob_start_len
        self.input_top_logprobs: list = []
        self.output_token_logprobs: list = []
        self.output_top_logprobs: list = []
        self.input_logprobs_done = not return_logprob or self.logprob_start_len >= len(input_ids)

        # KV state.
        self.req_pool_idx: int | None = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.last_host_node = None  # where the match goes on in host memory (second tier), if it does
        self.kv_len = 0
        self.extend_input_len = 0  # tokens computed in the current extend step
        self.is_chunked = False  # prompt only partly computed; continues next step
        # In-batch prefix sharing: (the request of this prefill batch whose new KV slots this one reads as part of
        # its prefix, how much of the prefix is the tree's own); set at admission, cleared once both are cached.
        self.borrowed: tuple[Req, int] | None = None

        # Accounting.
        self.cached_tokens = 0
        self.prefix_len_at_match = 0  # set by the scheduling policy
        self.skipped_rounds = 0  # aging for the starvation bound
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(int(sampling_params.seed))
        self.finished_reason: dict | None = None
        self.text = ""  # final text (set when finished, stop strings trimmed)
        self.created_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_retractions = 0
        self.admitted_before = False
        self.grammar = None  # GrammarMatcher for regex / JSON-schema constrained requests
        self.output_ids_rewritten_from = NOTHING_REWRITTEN  # smallest output index changed by jump-forward since last emit

        # Embedding requests (io_struct.PoolingParams): the pooled final hidden states, summed over the prompt's
        # chunks as they are computed ("mean"), or the last token's ("last"); the result when finished.
        self.pooling = pooling
        self.pooled_sum: torch.Tensor | None = None
        self.embedding: list[float] | None = None

    def grammar_spec(self) -> tuple[str, str] | None:
        sp = self.sampling_params
        if sp.regex is not None:
            return ("regex", sp.regex)
        if sp.json_schema is not None:
            return ("json_schema", sp.json_schema)
        if sp.ebnf is not None:
            return ("ebnf", sp.ebnf)
        return None

    # Token views ---------------------------------------------------------------------------------------------
    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def text_input_ids(self) -> list[int]:
        """Prompt ids without image pad ids (for vocabulary-indexed uses such as penalties)."""
        if self.mm_inputs is None:
            return self.origin_input_ids
        return [t for t in self.origin_input_ids if t < self.mm_inputs.pad_id_floor]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def max_prefix_len(self) -> int:
        """How much of all_ids may come from the cache: at least one token must be computed (its logits are
        sampled), and prompt logprobs need the logits at every position from logprob_start_len - 1."""
        limit = self.seq_len - 1
        if self.pooling is not None and self.pooling.mode == "mean":
            return 0  # mean pooling needs every prompt token's hidden state, so every token is computed
        if not self.input_logprobs_done:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        if self.output_logprobs_missing():
            limit = min(limit, self.first_output_logprob_position())
        return max(limit, 0)

    def first_logprob_position(self, prefix_len: int) -> int:
        """The first position of a chunk starting at ``prefix_len`` whose logits score the next prompt token (prompt
        logprobs start at logprob_start_len, scored by the logits one position earlier)."""
        return max(prefix_len, self.logprob_start_len - 1)

    def output_logprobs_missing(self) -> int:
        """Output tokens without a logprob entry yet: those a jump-forward appended (or re-tokenized). The next
        extend recomputes the positions before them and scores them, so entries stay one per output token."""
        if not self.return_logprob:
            return 0
        return max(len(self.output_ids) - len(self.output_token_logprobs), 0)

    def first_output_logprob_position(self) -> int:
        """The position whose logits score the first output token without a logprob entry."""
        return len(self.origin_input_ids) + len(self.output_token_logprobs) - 1

    def output_logprob_positions(self, prefix_len: int, extend: int) -> range:
        """Positions of a chunk [prefix_len, prefix_len + extend) whose logits score an output token that has no
        logprob entry yet (empty unless a jump-forward appended tokens since the last sample)."""
        if not self.output_logprobs_missing():
            return range(0)
        return range(max(prefix_len, self.first_output_logprob_position()), min(prefix_len + extend, self.seq_len - 1))

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    def reset_kv_state(self) -> None:
        """After its KV went to the tree (retraction, jump-forward): it re-enters through the waiting queue."""
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.last_host_node = None
        self.kv_len = 0
        self.is_chunked = False
        self.borrowed = None

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, in={len(self.origin_input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"


@dataclass
class ScheduleBatch:
    """Requests run together in one forward pass."""

    reqs: list[Req]
    forward_mode: ForwardMode
    # Extend only: per request, its prefix length and the tokens it computes this step.
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    out_cache_loc: torch.Tensor | None = None
    # Rows of the flattened batch whose logits are computed, per request (empty for a mid-prompt chunk).
    logit_rows: list[list[int]] = field(default_factory=list)

    def pool_spans(self) -> list[tuple[int, int] | None] | None:
        """Extend batches with embedding requests: per request, the rows of the flattened batch whose final
        hidden states it pools this step (None: none, or not an embedding request); None if no request pools."""
        if not self.forward_mode.is_extend() or all(r.pooling is None for r in self.reqs):
            return None
        spans, offset = [], 0
        for r, e in zip(self.reqs, self.extend_lens):
            if r.pooling is None or (r.pooling.mode == "last" and r.is_chunked):
                spans.append(None)  # "last": only the final chunk holds the last token
            else:
                spans.append((offset, offset + e) if r.pooling.mode == "mean" else (offset + e - 1, offset + e))
            offset += e
        return spans

    def to_forward_batch(self, device: str, req_to_token_pool=None, cascade_min_saved_reads: int = 0) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        if self.forward_mode.is_decode():
            for r in self.reqs:
                ids.append(r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1])
                positions.append(r.kv_len)
            seq_lens = [r.kv_len + 1 for r in self.reqs]
            logits_indices = list(range(len(self.reqs)))
            shared = req_to_token_pool is None or cascade_worthwhile(
                req_to_token_pool, [r.req_pool_idx for r in self.reqs], [r.kv_len for r in self.reqs],
                cascade_min_saved_reads)
        else:
            shared = True
            logits_indices = []
            for r, p, e in zip(self.reqs, self.prefix_lens, self.extend_lens):
                all_ids = r.all_ids
                ids.extend(all_ids[p : p + e])
                positions.extend(range(p, p + e))
            seq_lens = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
            for rows in self.logit_rows:
                logits_indices.extend(rows)
        # One copy for all index vectors that does not wait for the GPU: a prefill planned while a decode step
        # is in flight is launched behind it instead of waiting for it once per vector.
        input_ids, d_positions, out_cache_loc, req_pool_indices, d_seq_lens, d_logits_indices = upload_int64(
            [ids, positions, self.out_cache_loc, [r.req_pool_idx for r in self.reqs], seq_lens, logits_indices],
            device)
        return ForwardBatch(
            forward_mode=self.forward_mode,
            input_ids=input_ids,
            positions=d_positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens=d_seq_lens,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(self.prefix_lens),
            extend_seq_lens_cpu=list(self.extend_lens),
            logits_indices=d_logits_indices,
            mm_inputs=[r.mm_inputs for r in self.reqs] if any(r.mm_inputs for r in self.reqs)
            and self.forward_mode.is_extend() else None,
            shares_prefix=shared,
            pool_spans=self.pool_spans(),
        )
