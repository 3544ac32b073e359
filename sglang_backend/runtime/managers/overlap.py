"""Overlapped decode (GPU): the host work of decode step N (reading its tokens, stop checks, finishing requests,
radix bookkeeping, delivering outputs) runs while the GPU computes step N+1.

Step N+1 is launched before step N's tokens reach the host: its input ids are step N's sampled ids, still on
the device, and every host-to-device copy of the launch goes through pinned memory, so nothing in it waits for
the GPU. Consequences, all handled here:

* a request whose step-N token ends it (eos, stop token or string) had one more token computed in step N+1;
  that token is dropped (its KV slot is the one of the step-N token, which is valid and goes to the tree);
* a request that step N takes to its length limit is known to end without its token, so it is left out of
  step N+1;
* non-finite logits are detected on the device and read back with the tokens (the request fails alone).

Only batches whose sampling needs nothing from the host per step qualify (no grammar, logprobs, penalties,
logit bias or pending ``min_new_tokens``), with page size 1; the scheduler drains the step in flight before
anything else touches the running batch (retraction, a synchronous decode, mixed chunk, grammar or
tensor-parallel work).

A prefill batch of such requests is pipelined the same way (``start_prefill``): its first tokens are sampled on
the device and the batch becomes the step in flight, its requests joining the running batch with their prompts
already in the radix tree. The next step (the first decode, or the next prefill batch, planned meanwhile
against those prompts) is launched before those tokens reach the host, so the GPU does not wait for the host
between a prefill and what follows it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ...utils import to_device_async
from ..layers.sampler import SamplingBatchInfo
from ..model_executor.forward_batch import ForwardBatch, ForwardMode, cascade_worthwhile, upload_int64
from .schedule_batch import Req

logger = logging.getLogger(__name__)


@dataclass
class InflightDecode:
    reqs: list[Req]
    next_ids: torch.Tensor  # [bs] on the device: the next step's input
    host: torch.Tensor  # [2, bs] pinned: next ids and "logits were finite", copied without blocking
    ready: torch.cuda.Event | None  # None on the CPU (tests), where nothing runs ahead


class OverlapDecoder:
    """Drives the scheduler's decode through its public interface: ``available_tokens``, ``alloc_slots``,
    ``run_decode`` (the synchronous fallback), ``check_finished``, ``fail_request`` and ``release``."""

    def __init__(self, scheduler):
        self.sched = scheduler
        self.inflight: InflightDecode | None = None
        self._info_key: tuple | None = None
        self._info: SamplingBatchInfo | None = None

    @staticmethod
    def supported(server_args, device) -> bool:
        """On by default on CUDA, at every tensor-parallel size: rank 0 hands each step to the followers without a
        host sync, so they too prepare step N+1 under step N (2xH200, Llama-2-7B fp16: TP=2 decode 1.34x TP=1
        at batch 1 with it, 0.98x without). (It also runs on the CPU, where it gains nothing: tests switch it
        on there.)"""
        return (str(device).startswith("cuda") and not server_args.disable_overlap_schedule
                and server_args.page_size == 1)

    @staticmethod
    def eligible(req: Req) -> bool:
        sp = req.sampling_params
        return (req.grammar is None and not req.return_logprob and not sp.logit_bias
                and sp.repetition_penalty == 1.0 and sp.frequency_penalty == 0.0 and sp.presence_penalty == 0.0
                and len(req.output_ids) >= sp.min_new_tokens)

    def can_run(self, waiting_planned: bool = False) -> bool:
        """Whether the next decode step may be overlapped. Waiting requests stop it unless ``waiting_planned``: the
        scheduler has just planned a prefill for them and admitted none (no memory yet), so decoding goes on."""
        s = self.sched
        return (bool(s.running) and (waiting_planned or not s.waiting_queue) and s.chunked_req is None
                and not s.grammar_queue
                and s.fault_injector is None and all(self.eligible(r) for r in s.running)
                and len(s.running) <= s.available_tokens())

    # The step ---------------------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Launches the next decode step, then finishes the one in flight. Returns requests with new output."""
        s = self.sched
        prev = self.inflight
        lagging = {id(r): i for i, r in enumerate(prev.reqs)} if prev is not None else {}
        launch, src = [], []
        for r in s.running:
            i = lagging.get(id(r))
            if i is not None and (len(r.output_ids) + 1 >= r.sampling_params.max_new_tokens
                                  or r.seq_len + 1 >= s.context_len):
                continue  # its token in flight ends it by length: nothing to compute after it
            launch.append(r)
            src.append(i)
        try:
            self.inflight = self._launch(launch, src, prev) if launch else None
        except Exception:  # noqa: BLE001 - the synchronous path contains the fault to the failing request
            logger.exception("overlapped decode launch failed; running this step synchronously")
            self.inflight = None
            out = self._finish(prev) if prev is not None else []
            return out + (self.sched.run_decode() if self.sched.running else [])
        out = self._finish(prev) if prev is not None else []
        if self.inflight is not None and all(r.finished() for r in self.inflight.reqs):
            self.inflight = None  # every row of it is dropped anyway
        return out

    def drain(self) -> list[Req]:
        """Finishes the step in flight (before the scheduler does anything else)."""
        prev, self.inflight = self.inflight, None
        return self._finish(prev) if prev is not None else []

    def _launch(self, reqs: list[Req], src: list[int | None], prev: InflightDecode | None) -> InflightDecode:
        s = self.sched
        dev = s.device
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        positions = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        locs = s.alloc_slots(len(reqs), -1)
        assert locs is not None, "decode allocation failed after the memory check"
        s.req_to_token_pool.write_tokens(rows, positions, locs)
        if prev is not None and None not in src:
            same = len(src) == prev.next_ids.shape[0] and src == list(range(len(src)))
            input_ids = prev.next_ids if same else prev.next_ids[to_device_async(torch.tensor(src), dev)]
        else:  # some requests' last token is already on the host (none in flight for them)
            host_ids = [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in reqs]
            input_ids = to_device_async(torch.tensor(host_ids, dtype=torch.int64), dev)
            lag = [k for k, i in enumerate(src) if i is not None]
            if lag:
                input_ids[to_device_async(torch.tensor(lag), dev)] = \
                    prev.next_ids[to_device_async(torch.tensor([src[k] for k in lag]), dev)]
        seq_lens = positions + 1
        # One pinned copy for the batch's index tensors, each a 16-byte-aligned view (upload_int64).
        d_positions, d_locs, d_rows, d_seq_lens, d_rows_idx = upload_int64(
            [positions, locs, rows, seq_lens, torch.arange(len(reqs))], dev)
        fb = ForwardBatch(ForwardMode.DECODE, input_ids, d_positions, d_locs, d_rows, d_seq_lens, seq_lens.tolist(),
                          logits_indices=d_rows_idx,
                          shares_prefix=cascade_worthwhile(s.req_to_token_pool, rows.tolist(), positions.tolist(),
                                                           s.server_args.cascade_min_saved_reads))
        t0 = time.perf_counter()
        try:
            logits = s.model_runner.forward(fb)
        except Exception:
            s.allocator.free(locs)  # nothing of this step happened
            raise
        s.stats.forward_seconds += time.perf_counter() - t0
        s.stats.num_forward_tokens += len(reqs)
        for r in reqs:
            r.kv_len += 1
        s.stats.num_decode_batches += 1
        s.decay_new_token_ratio()
        return self._in_flight(reqs, logits)

    def _in_flight(self, reqs: list[Req], logits: torch.Tensor) -> InflightDecode:
        """Samples each request's next token from its logits row on the device and starts the copy of the ids
        (and "logits were finite") to the host, without waiting for the GPU."""
        next_ids = self._sample(reqs, logits)
        result = torch.stack([next_ids, torch.isfinite(logits).all(dim=-1).to(torch.int64)])
        if torch.device(self.sched.device).type != "cuda":  # CPU (tests): nothing runs ahead, the copy is the result
            return InflightDecode(reqs, next_ids, result, None)
        host = torch.empty((2, len(reqs)), dtype=torch.int64, pin_memory=True)
        host.copy_(result, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return InflightDecode(reqs, next_ids, host, ready)

    # Prefill ----------------------------------------------------------------------------------------------
    def takes_prefill(self, reqs: list[Req], logit_rows: list[list[int]], running: set[int]) -> bool:
        """Whether a prefill batch's first tokens can be sampled in flight like a decode step's: every request
        samples one row and nothing else (no prompt logprobs, no embedding) or is a chunk with no row at all,
        qualifies for overlapped decode, has tokens left to generate and is new (no running request decoding in
        the batch: mixed chunk)."""
        return (self.sched.fault_injector is None
                and all(len(rows) == (0 if r.is_chunked else 1) and self.eligible(r) and r.remaining_new_tokens() > 0
                        and r.pooling is None and id(r) not in running for r, rows in zip(reqs, logit_rows)))

    def start_prefill(self, reqs: list[Req], logits: torch.Tensor) -> list[Req]:
        """The prefill just launched becomes the step in flight (``reqs``, its requests that sample, join the
        running batch lagging by their first token; none when the batch is one chunk of a long prompt); the step
        in flight before it is finished now, under the prefill's GPU time. Returns the requests with new output."""
        prev, self.inflight = self.inflight, (self._in_flight(reqs, logits) if reqs else None)
        return self._finish(prev) if prev is not None else []

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> torch.Tensor:
        if all(r.sampling_params.is_greedy for r in reqs):
            return torch.argmax(logits, dim=-1)
        key = tuple(map(id, reqs))
        if key != self._info_key:  # nothing in it depends on the tokens: rebuilt only when the batch changes
            s = self.sched
            self._info = SamplingBatchInfo.from_requests(
                [r.sampling_params for r in reqs], [r.text_input_ids for r in reqs], [r.output_ids for r in reqs],
                [r.generator for r in reqs], s.eos_token_ids, s.model_runner.vocab_size, s.device)
            self._info_key = key
        return self.sched.sampler(logits, self._info)

    def _finish(self, step: InflightDecode) -> list[Req]:
        s = self.sched
        if step.ready is not None:
            step.ready.synchronize()
        ids, finite = step.host.tolist()
        now = time.monotonic()
        out = []
        for req, tok, ok in zip(step.reqs, ids, finite):
            if req.finished():
                continue  # aborted meanwhile, or ended by its previous token: this one is dropped
            if not ok:
                s.fail_request(req, "the model produced non-finite logits (NaN or inf) for this request")
                continue
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            s.check_finished(req)
            out.append(req)
        s.stats.num_generated_tokens += len(out)
        for req in out:
            if req.finished():
                s.running.remove(req)
                s.release(req)
        return out
