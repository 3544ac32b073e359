"""What leaves the scheduler after each step: one ``BatchTokenOut`` carrying, per request that advanced, only
what is new since its last message (new output ids, new logprob entries; token counts with the first
message and when finished). The front-end accumulates. Used by the server's scheduler process and the
offline Engine alike."""

from __future__ import annotations

from .io_struct import BatchTokenOut, TokenOut
from .schedule_batch import NOTHING_REWRITTEN, Req


class OutputCollector:
    def __init__(self):
        self.sent: dict[str, tuple[int, int, int]] = {}  # rid -> (ids, input logprobs, output logprobs) sent

    def collect(self, reqs: list[Req]) -> BatchTokenOut | None:
        outputs = [out for out in map(self.delta, reqs) if out is not None]
        return BatchTokenOut(outputs) if outputs else None

    def delta(self, req: Req) -> TokenOut | None:
        """The request's new output since its last message; None while it has nothing to say (a request that
        does not stream speaks once, when finished)."""
        finished = req.finished()
        if not (finished or req.stream):
            return None
        first = req.rid not in self.sent
        n_ids, n_in, n_out = self.sent.pop(req.rid, (0, 0, 0))
        meta = {}
        if first or finished:
            meta = {"prompt_tokens": len(req.origin_input_ids), "cached_tokens": req.cached_tokens}
        if req.embedding is not None:  # sent once, with the finish (embedding requests never stream)
            meta["embedding"] = req.embedding
        keep = min(n_ids, req.output_ids_rewritten_from)  # jump-forward may have re-tokenized a tail
        req.output_ids_rewritten_from = NOTHING_REWRITTEN
        # With logprobs, a stream sends an output id together with its logprob entry: the tokens a jump-forward
        # appended wait for the next extend to score them, so a message's text and entries stay the same tokens
        # (clients such as guidance read each chunk's tokens from its logprobs).
        visible = len(req.output_ids)
        if req.return_logprob and not finished:
            visible = max(keep, min(visible, len(req.output_token_logprobs)))
        if req.return_logprob:
            # Output logprob entries are one per output id: a re-tokenized tail's are re-sent from ``keep`` too.
            n_out = min(n_out, keep)
            meta["input_token_logprobs"] = req.input_token_logprobs[n_in:]
            meta["output_token_logprobs"] = req.output_token_logprobs[n_out:]
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = req.input_top_logprobs[n_in:]
                meta["output_top_logprobs"] = req.output_top_logprobs[n_out:]
        detok = None
        if first:
            sp = req.sampling_params
            detok = {"skip_special_tokens": sp.skip_special_tokens,
                     "spaces_between_special_tokens": sp.spaces_between_special_tokens,
                     "stop": sp.stop, "no_stop_trim": sp.no_stop_trim}
        if not finished:
            self.sent[req.rid] = (visible, len(req.input_token_logprobs), len(req.output_token_logprobs))
        return TokenOut(req.rid, req.output_ids[keep:visible], req.finished_reason, meta, req.stream, detok, keep)
