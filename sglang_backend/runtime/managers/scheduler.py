"""The continuous-batching loop: owns the model, the KV pool and the radix tree.

Each ``step()`` either runs one prefill (extend) batch formed from the waiting queue, or one decode step of
the running batch. Finished requests hand their KV to the radix tree so later requests reuse it. The class
is driven in-process by the offline ``Engine`` and, in the server, by the scheduler process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import time
from dataclasses import dataclass, field

import torch
import zmq

from ...utils import die_with_parent
from ..constrained import GrammarCache, GrammarTooComplex, cache_options, retokenize_jump_forward
from ..constrained.packed_masks import apply_packed_masks
from ..layers.logits_processor import token_logprobs, top_logprobs
from ..layers.sampler import Sampler, SamplingBatchInfo, finite_rows
from ..mem_cache.chunk_cache import ChunkCache
from ..mem_cache.host_pool import HostKVPool
from ..mem_cache.radix_cache import RadixCache
from ..mem_cache.session_pins import SessionPins
from ..mem_cache.table_cache import TableCache
from ..model_executor.forward_batch import ForwardMode
from ..model_executor.model_runner import ModelRunner
from ..model_loader.loader import load_model_assets
from ..sampling_params import SamplingParams
from .fault_injection import FaultInjector
from .io_struct import AbortReq, ControlOut, ControlReq, SchedulerFailed, SchedulerReady, TokenizedGenerateReq
from .overlap import OverlapDecoder
from .program_service import ProgramService
from .schedule_batch import Req, ScheduleBatch, finish_abort, finish_length, finish_stop
from .schedule_policy import InBatchPrefixIndex, SchedulePolicy, common_len, ids_through
from .scheduler_output import OutputCollector
from .validation import ModelLimits

logger = logging.getLogger(__name__)

# Reserved decode growth per running request is min(remaining tokens, this) * new_token_ratio.
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class PoolNotWholeError(AssertionError):
    pass


def split_batch(batch: ScheduleBatch) -> list[ScheduleBatch]:
    """One single-request batch per request (same KV slots, logit rows re-based to the request's tokens)."""
    if batch.forward_mode.is_decode():
        return [ScheduleBatch([r], batch.forward_mode, out_cache_loc=batch.out_cache_loc[i : i + 1])
                for i, r in enumerate(batch.reqs)]
    out, offset = [], 0
    for req, p, e, rows in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.logit_rows):
        out.append(ScheduleBatch([req], batch.forward_mode, [p], [e], batch.out_cache_loc[offset : offset + e],
                                 [[r - offset for r in rows]]))
        offset += e
    return out


def merge_batches(parts: list[ScheduleBatch], mode: ForwardMode) -> ScheduleBatch:
    """The inverse of split_batch for the parts that survived."""
    merged = ScheduleBatch([], mode, out_cache_loc=torch.cat([b.out_cache_loc for b in parts]) if parts else None)
    offset = 0
    for b in parts:
        merged.reqs += b.reqs
        if not mode.is_decode():
            merged.prefix_lens += b.prefix_lens
            merged.extend_lens += b.extend_lens
            merged.logit_rows += [[r + offset for r in rows] for rows in b.logit_rows]
            offset += sum(b.extend_lens)
    return merged


@dataclass
class PrefillPlan:
    """The prefill batch being formed: what is admitted so far and the token budgets left."""

    chunk_budget: float  # chunked_prefill_size (inf: off)
    input_budget: float  # max_prefill_tokens
    decode_reserve: int  # output tokens the running and the admitted requests may still ask for (unscaled)
    logprob_budget: int  # prompt positions whose full-vocabulary logits this batch may still compute
    reqs: list[Req] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    admitted_prefixes: InBatchPrefixIndex = field(default_factory=InBatchPrefixIndex)
    # Requests the policy matched against the tree while ordering this round, and the tree's eviction count
    # then: their matches stay valid until an admission's allocation evicts (nothing inserts during planning).
    matched_when_ordered: set[int] = field(default_factory=set)
    evictions_when_ordered: int = 0


@dataclass
class SchedulerStats:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_prefill_batches: int = 0
    num_chunked_prefill_batches: int = 0  # prefill batches computing part of a prompt split by chunked prefill
    max_prefill_batch_tokens: int = 0  # the most prompt tokens one prefill batch computed
    num_decode_batches: int = 0
    num_mixed_batches: int = 0  # prefill batches that also decoded the running requests (enable_mixed_chunk)
    num_forward_tokens: int = 0
    num_borrowed_prefix_tokens: int = 0  # cached tokens read from another request of the same prefill batch
    num_retractions: int = 0
    num_jump_forward: int = 0
    num_jump_forward_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    tree_op_seconds: float = 0.0
    forward_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


class Scheduler:
    def __init__(self, server_args, config, model_dir: str | None, tokenizer):
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.model_runner = ModelRunner(server_args, config, model_dir)
        self.device = self.model_runner.device
        self.context_len = self.model_runner.context_len
        self.max_total_num_tokens = self.model_runner.max_total_num_tokens
        self.req_to_token_pool = self.model_runner.req_to_token_pool
        self.allocator = self.model_runner.token_to_kv_pool_allocator
        self.page_size = server_args.page_size
        # Auto: 1 GiB of fp32 logits; at least a page, so a chunk always makes progress.
        self.max_prefill_logprob_tokens = max(self.page_size, server_args.max_prefill_logprob_tokens
                                              or 2**30 // (4 * self.model_runner.vocab_size))
        self.eos_token_ids = self._eos_ids(config, tokenizer)

        if server_args.disable_radix_cache:
            self.tree_cache = ChunkCache(self.req_to_token_pool, self.allocator, self.page_size)
        elif server_args.table_cache:
            self.tree_cache = TableCache(self.req_to_token_pool, self.allocator)
        else:
            host = HostKVPool(self.model_runner.token_to_kv_pool, server_args.kv_host_size) \
                if server_args.kv_host_size else None
            self.tree_cache = RadixCache(self.req_to_token_pool, self.allocator, self.page_size, host)
        self.host_tier = getattr(self.tree_cache, "host", None) is not None
        # A request whose KV comes back from host memory waits for the copy outside the forwards, which go on
        # beside it (GPU); on a CPU the copy is a memcpy on the compute threads, so it is made inside the batch.
        load = server_args.kv_host_load
        self.async_host_loads = self.host_tier and (load == "async" or load == "auto" and self.tree_cache.host.on_gpu)
        if self.host_tier:
            host = self.tree_cache.host
            logger.info("KV host tier: %d tokens (%.1f GiB%s)", host.size, host.buffer.nbytes / 2**30,
                        ", pinned" if host.on_gpu else "")
        self.programs = ProgramService(server_args.program_service_quantum) \
            if server_args.program_scheduling == "attained" else None
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, server_args.starvation_limit,
                                     server_args.random_seed, self.programs)
        # Pins need a tree to lock paths in; session_ttl 0 switches them off.
        self.session_pins = None
        if isinstance(self.tree_cache, RadixCache) and server_args.session_ttl != 0:
            self.session_pins = SessionPins(self.tree_cache,
                                            int(server_args.session_pin_max_fraction * self.max_total_num_tokens),
                                            server_args.session_ttl, server_args.session_ttl_max)
        self.sampler = Sampler()

        self.waiting_queue: list[Req] = []
        self.grammar_queue: list[tuple[Req, object]] = []  # requests whose grammar is still compiling
        self._grammar_cache = None
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        # Requests with output produced outside a step (aborted, rejected, a decode step drained by a cache flush):
        # reported with the next step.
        self.pending_outputs: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self.fault_injector = FaultInjector.from_env()  # tests only; None in normal runs
        self.request_log: list[Req] | None = None  # benchmarks set a list to record every request added
        self.overlap = OverlapDecoder(self) if OverlapDecoder.supported(server_args, self.device) else None

    @staticmethod
    def _eos_ids(config, tokenizer) -> set[int]:
        ids = set()
        for src in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return ids

    # Requests in / out ----------------------------------------------------------------------------------------
    @property
    def limits(self):
        return ModelLimits(self.context_len, self.max_total_num_tokens, self.model_runner.vocab_size)

    @property
    def grammar_cache(self):
        """Compiled regex/JSON-schema grammars (token masks), shared by all requests; built on first use."""
        if self._grammar_cache is None:
            self._grammar_cache = GrammarCache(self.tokenizer, self.model_runner.vocab_size, self.eos_token_ids,
                                               **cache_options(self.server_args))
        return self._grammar_cache

    def add_request(self, req: Req) -> None:
        if self.request_log is not None:
            self.request_log.append(req)
        if req.session_id is not None and self.session_pins is not None:
            self.session_pins.on_arrival(req.session_id)
        spec = req.grammar_spec()
        if spec is None:
            self.waiting_queue.append(req)
        else:
            # Compile off the loop: a new grammar never stalls the running batch.
            self.grammar_queue.append((req, self.grammar_cache.submit(*spec)))

    def _poll_grammars(self) -> list[Req]:
        """Moves requests whose grammar is ready to the waiting queue; fails those whose grammar is invalid."""
        failed, pending = [], []
        for req, fut in self.grammar_queue:
            if not fut.done():
                pending.append((req, fut))
                continue
            try:
                req.grammar = fut.result().matcher()
                self.waiting_queue.append(req)
            except Exception as e:  # noqa: BLE001 - the grammar is the request's problem, not the loop's
                req.finished_reason = finish_abort(f"invalid grammar: {e}")
                failed.append(req)
        self.grammar_queue = pending
        if pending and not self.waiting_queue and not self.running and self.chunked_req is None:
            # Nothing else to do: wait a little for a grammar instead of spinning.
            concurrent.futures.wait([f for _, f in pending], timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        return failed

    def abort_request(self, rid: str) -> Req | None:
        """Abort by id; frees the request's KV now. Returns the aborted request (finished) or None."""
        for item in self.grammar_queue:
            if item[0].rid == rid:
                self.grammar_queue.remove(item)
                item[0].finished_reason = finish_abort("aborted by client")
                self.stats.num_aborted += 1
                return item[0]
        for req in self.waiting_queue:
            if req.rid == rid:
                self.waiting_queue.remove(req)
                req.finished_reason = finish_abort("aborted by client")
                self.stats.num_aborted += 1
                return req
        candidates = self.running + ([self.chunked_req] if self.chunked_req else [])
        for req in candidates:
            if req.rid == rid:
                req.finished_reason = finish_abort("aborted by client")
                if req is self.chunked_req:
                    self.chunked_req = None
                else:
                    self.running.remove(req)
                self.release(req)
                self.stats.num_aborted += 1
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running or self.chunked_req or self.grammar_queue or self._host_loads())

    def _host_loads(self) -> int:
        """Asynchronous loads back from the host tier still copying (their paths stay locked until done)."""
        return self.host_tier and len(self.tree_cache.loads)

    # The front-end's interface (the Engine's loop thread and the server's scheduler process alike) ----------------
    def add_tokenized(self, msg: TokenizedGenerateReq) -> None:
        """Adds a request the front-end validated (its sampling params parsed and normalized there). One that
        still cannot be built fails alone, reported with the next ``run_iteration``."""
        try:
            req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.return_logprob, msg.logprob_start_len,
                      msg.top_logprobs_num, msg.extra_key, msg.stream, msg.mm_inputs, msg.pooling, msg.session_id)
        except Exception as e:  # noqa: BLE001 - one bad request fails alone; the loop keeps serving
            logger.warning("rejected request %s: %s", msg.rid, e)
            req = Req(msg.rid, msg.input_ids or [0], SamplingParams(max_new_tokens=0))
            req.finished_reason = finish_abort(f"invalid request: {e}")
            self.pending_outputs.append(req)
            return
        self.add_request(req)

    def handle_control(self, kind: str, payload=None):
        """The control commands: ``abort`` (payload: the rid; True if found: the request is reported with the next
        ``run_iteration``), ``flush_cache``, ``get_stats``, ``check_pool`` (None, or what is wrong)."""
        if kind == "abort":
            req = self.abort_request(payload)
            if req is not None:
                self.pending_outputs.append(req)
            return req is not None
        if kind == "flush_cache":
            return self.flush_cache()
        if kind == "end_session":  # True if the session held a pin
            if self.programs is not None:
                self.programs.end(payload)
            return self.session_pins is not None and self.session_pins.end(payload)
        if kind == "get_stats":
            return self.get_stats()
        if kind == "check_pool":
            try:
                self.check_pool_whole()
            except PoolNotWholeError as e:
                return str(e)
            return None
        return {"error": f"unknown control {kind!r}"}

    def run_iteration(self) -> list[Req]:
        """One turn of a driving loop: a step if there is work, plus the requests ended outside a step (aborted,
        rejected). Returns the requests with new output. With ``check_pool_on_idle``, raises
        ``PoolNotWholeError`` when this turn left the scheduler idle with the KV pool not whole."""
        worked = self.has_work() or bool(self.pending_outputs)
        out = self.step() if self.has_work() else []
        if self.pending_outputs:
            out, self.pending_outputs = out + self.pending_outputs, []
        if worked and not self.has_work() and self.server_args.check_pool_on_idle:
            self.check_pool_whole()
        return out

    # The loop ---------------------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Runs one batch. Returns the requests that got new output (tokens or a finish) in this step."""
        out = self._poll_grammars() if self.grammar_queue else []
        if self._host_loads():
            self.tree_cache.poll_loads()
        if self.session_pins:
            self.session_pins.expire()
        if self.overlap is not None:
            if self.overlap.can_run():
                out += self.overlap.step()  # plain decode: host work overlaps the GPU step
                if self.pending_outputs:
                    out, self.pending_outputs = out + self.pending_outputs, []
                return out
            if self.server_args.enable_mixed_chunk:
                out += self.overlap.drain()  # mixed chunk decodes the running requests: their tokens must be here
        # A step in flight may stay in flight while the next prefill batch is planned and launched (planning reads
        # the running requests' lengths only); _run_extend finishes it after the launch.
        batch = self._get_new_batch_prefill()
        while batch is None and self.waiting_queue and not self.running and self._reclaim_held_memory():
            batch = self._get_new_batch_prefill()  # nothing else would ever free that memory or finish the loads
        if batch is not None:
            out += self._run_extend(batch)
        elif self.overlap is not None and self.overlap.can_run(waiting_planned=True):
            out += self.overlap.step()  # none of the waiting requests fits yet: the decode stays overlapped
        else:
            if self.overlap is not None:
                out += self.overlap.drain()  # a synchronous decode sees the running batch up to date
            if self.running:
                out += self.run_decode()
            elif self._wait_for_host_load():
                pass  # the load of a request that left (aborted) while its KV was copying
            elif self.server_args.check_pool_on_idle and not self.has_work():
                self.check_pool_whole()
        if self.pending_outputs:
            out, self.pending_outputs = out + self.pending_outputs, []
        return out

    # Prefill ------------------------------------------------------------------------------------------------
    @staticmethod
    def _tokens_to_reserve(req: Req) -> int:
        """The output tokens a request may still ask for, as its decoding reserves them (clipped)."""
        return min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)

    def available_tokens(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        sa = self.server_args
        plan = PrefillPlan(sa.chunked_prefill_size if sa.chunked_prefill_size > 0 else float("inf"),
                           max(sa.max_prefill_tokens, 1), sum(map(self._tokens_to_reserve, self.running)),
                           self.max_prefill_logprob_tokens)
        # A partly computed prompt continues first.
        if self.chunked_req is not None:
            req = self.chunked_req
            self.chunked_req = None
            remaining = req.seq_len - req.kv_len
            extend = min(remaining, self._page_floor(plan.chunk_budget, remaining))
            extend = self._logprob_cap(plan, req, req.kv_len, extend)
            req.is_chunked = extend < remaining
            while not self._admit(plan, req, extend):
                if not self._reclaim_held_memory():
                    self._retract_chunked(req)  # its computed chunks wait in the tree; it resumes from there
                    break

        t0 = time.perf_counter()
        ordered = self.policy.order(self.waiting_queue)
        self.stats.tree_op_seconds += time.perf_counter() - t0
        if self.policy.matches_when_ordering():
            plan.matched_when_ordered = {id(r) for r in ordered}
            plan.evictions_when_ordered = self.tree_cache.num_evicted_tokens
        for req in ordered:
            if not self._try_admit(plan, req):
                break
        admitted = plan.reqs
        if not admitted:
            return None
        admitted_ids = {id(r) for r in admitted}
        for req in self.waiting_queue:
            if id(req) not in admitted_ids:
                req.skipped_rounds += 1
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted_ids]
        decoding = self._mix_running(plan) if sa.enable_mixed_chunk else []
        return self._build_extend_batch(admitted + decoding, plan.prefix_lens + [r.kv_len - 1 for r in decoding],
                                        plan.extend_lens + [1] * len(decoding))

    def _mix_running(self, plan: PrefillPlan) -> list[Req]:
        """The running requests, each given the KV slot of its next token, to decode in the prefill batch as
        one-token extends over their cached KV (mixed chunk); none if their slots do not fit now (the next decode
        step retracts as usual), or if they would take the room a chunked prompt of this batch still needs for
        its remaining chunks (running requests grow with every mixed chunk; admission reserved less for them)."""
        chunk_rest = sum(r.seq_len - r.kv_len for r in plan.reqs if r.is_chunked)
        if not self.running or self._decode_need() + chunk_rest > self.available_tokens():
            return []
        self._alloc_decode_slots(self.running)
        for req in self.running:
            req.kv_len += 1  # as an extend: the slot of the token this step computes is counted before the forward
        self.stats.num_mixed_batches += 1
        return list(self.running)

    def _admit(self, plan: PrefillPlan, req: Req, extend_len: int) -> bool:
        if not self._alloc_extend(req, extend_len):
            return False
        plan.reqs.append(req)
        plan.admitted_prefixes.add(req)
        plan.decode_reserve += self._tokens_to_reserve(req)
        plan.prefix_lens.append(req.kv_len - extend_len)
        plan.extend_lens.append(extend_len)
        plan.logprob_budget -= self._logprob_rows(req, req.kv_len - extend_len, extend_len)
        plan.chunk_budget -= extend_len
        plan.input_budget -= extend_len
        return True

    def _try_admit(self, plan: PrefillPlan, req: Req) -> bool:
        """Adds the next waiting request (in policy order) to the prefill batch if it fits. False: admit no more
        this round (a request skipped by in-batch prefix dedup returns True: the next one may still come)."""
        sa = self.server_args
        admitted = plan.reqs
        if len(self.running) + len(admitted) >= sa.max_running_requests or self.req_to_token_pool.available_size() == 0:
            return False
        if plan.chunk_budget <= 0 or plan.input_budget <= 0 or admitted and admitted[-1].is_chunked:
            return False
        evicted_since = self.tree_cache.num_evicted_tokens != plan.evictions_when_ordered
        if id(req) not in plan.matched_when_ordered or evicted_since:
            t0 = time.perf_counter()
            self.policy.match(req)  # fresh: an admission's allocation may have evicted part of an older match
            self.stats.tree_op_seconds += time.perf_counter() - t0
        if self._host_loads() and self.tree_cache.loading_on_path(req.last_node):
            return True  # its prefix is still copying back from the host: a later round takes it
        # A prefix an admitted request computes in this batch is computed once: the request reads that request's
        # new KV as part of its prefix (in-batch sharing), else it is held back a round to hit it in the tree. Not
        # a request that reuses no cached prefix (mean-pooled embeddings compute every token).
        borrowed = None
        if sa.enable_in_batch_prefix_dedup and not self.tree_cache.disable and admitted and req.max_prefix_len() > 0:
            lender = plan.admitted_prefixes.sharer(req)
            if lender is not None:
                borrowed = self._borrow_prefix(req, lender)
                if borrowed is None:
                    return True
        if self.host_tier:
            # A session pin gives way to a waiting request that does not fit: its KV survives in host memory.
            while self._memory_short(plan, req) and self._release_pin_for_memory():
                pass
        if req.last_host_node is not None:
            if not self._load_back(plan, req):
                return False
            if self._host_loads() and self.tree_cache.loading_on_path(req.last_node):
                return True  # its KV copies back beside this batch; a later round takes it
        self.tree_cache.inc_lock_ref(req.last_node)
        prefix_len = len(req.prefix_indices)
        extend = self._fit_extend(plan, req, prefix_len)
        if extend is None:
            self.tree_cache.dec_lock_ref(req.last_node)
            return False
        if not self._start_request(req) or not self._admit(plan, req, extend):
            self.tree_cache.dec_lock_ref(req.last_node)
            if req.req_pool_idx is not None:
                self.req_to_token_pool.free(req.req_pool_idx)
                req.req_pool_idx = None
            req.is_chunked = False
            return False
        req.borrowed = borrowed
        if borrowed is not None:
            self.stats.num_borrowed_prefix_tokens += prefix_len - borrowed[1]
        if not req.admitted_before:  # retracted / jump-forwarded requests come back; count them once
            req.admitted_before = True
            req.cached_tokens = prefix_len
            self.stats.num_prompt_tokens += len(req.origin_input_ids)
            self.stats.num_cached_tokens += prefix_len
            if req.session_id is not None and self.session_pins is not None:
                # what the tree held for it (a borrowed part was computed in this batch, not kept by a pin)
                self.session_pins.on_admitted(req.session_id, borrowed[1] if borrowed else prefix_len)
        return True

    def _borrow_prefix(self, req: Req, lender: Req) -> tuple[Req, int] | None:
        """In-batch prefix sharing: ``req``'s prefix becomes ``lender``'s slots (its cached prefix and the slots
        this batch computes) as far as their ids agree; ``(lender, tree prefix length)``, or None to hold ``req``
        back a round instead. Each layer stores the whole batch's K/V before attending, so ``req`` reads the
        lender's new KV in the same forward. Until both are cached in the tree right after the forward
        (``_cache_borrowed``), those slots are the lender's own: ``req`` locks only its tree prefix."""
        if (self.server_args.disable_in_batch_prefix_sharing or not isinstance(self.tree_cache, RadixCache)
                or lender.is_chunked or req.last_host_node is not None):
            return None  # a chunk stops short of the shared part; a host hit is loaded back first
        tree_len = len(req.prefix_indices)
        n = min(req.max_prefix_len(), lender.kv_len)
        shared = tree_len + common_len(ids_through(req, n), ids_through(lender, n), tree_len, n)
        shared -= shared % self.page_size  # the request's own tokens start on a page boundary
        row = self.req_to_token_pool.req_to_token[lender.req_pool_idx]
        # Both tree prefixes are the same path's slots; its last one agreeing says so (a tree slot is one node's).
        if shared <= tree_len or tree_len and int(row[tree_len - 1]) != int(req.prefix_indices[tree_len - 1]):
            return None
        req.prefix_indices = row[:shared].clone()
        return lender, tree_len

    def _cache_borrowed(self, batch: ScheduleBatch) -> None:
        """After the forward of a batch with in-batch prefix sharing: the lenders' and borrowers' prompts go to the
        tree in batch order (a lender was admitted before its borrowers), so the borrowed slots become the tree's,
        locked by each borrower, before any of them can finish or be evicted."""
        borrowers = [r for r in batch.reqs if r.borrowed is not None]
        if not borrowers:
            return
        lenders = {id(r.borrowed[0]) for r in borrowers}
        for req in batch.reqs:
            if (req.borrowed is not None or id(req) in lenders) and not req.finished():
                self._cache_unfinished(req)
        for req in borrowers:
            req.borrowed = None

    def _memory_short(self, plan: PrefillPlan, req: Req) -> bool:
        """Whether the request's uncached tokens plus the batch's decode reservation exceed the device memory that
        can be had (``_fit_extend``'s memory test; a host hit counts as uncached: loading it takes as much room)."""
        need = req.seq_len - len(req.prefix_indices)
        reserve = int((plan.decode_reserve + self._tokens_to_reserve(req)) * self.new_token_ratio)
        return need + reserve > self.available_tokens() and bool(self.running or plan.reqs)

    def _load_back(self, plan: PrefillPlan, req: Req) -> bool:
        """The request's match goes on in host memory: copy that part back to the device (evicting as a prefill
        would) and match again. False, with nothing copied, when the request would not fit this batch anyway: the
        copy plus its extend need as much device memory as the extend alone would without the host tier."""
        if self._memory_short(plan, req):
            return False
        t0 = time.perf_counter()
        if self.tree_cache.load_back(req.last_host_node, lambda n: self.alloc_slots(n, -1),
                                     wait=not self.async_host_loads):
            self.policy.match(req)
        req.last_host_node = None
        self.stats.tree_op_seconds += time.perf_counter() - t0
        return True

    def _fit_extend(self, plan: PrefillPlan, req: Req, prefix_len: int) -> int | None:
        """How many of the request's tokens this batch computes (fewer when chunked), or None if it does not fit:
        its decode reservation exceeds the free KV, or the prompt exceeds the budgets and cannot be chunked."""
        sa = self.server_args
        if self._memory_short(plan, req):
            return None
        extend = req.seq_len - prefix_len
        budget = min(plan.chunk_budget, plan.input_budget)
        chunked = False  # set on the request only once it is admitted (a request left waiting stays unchunked)
        if extend > budget:
            if sa.chunked_prefill_size > 0:
                extend = self._page_floor(budget, extend)
                if extend <= 0:
                    return None
                chunked = True
            elif plan.reqs:
                return None
        capped = self._logprob_cap(plan, req, prefix_len, extend)
        if capped < extend:
            if sa.chunked_prefill_size > 0 and capped > 0:
                extend, chunked = capped, True
            elif plan.reqs:
                return None  # the next batch has the budget; alone, it runs this extend whole
        req.is_chunked = chunked
        return extend

    @staticmethod
    def _prompt_logprob_rows(req: Req, prefix_len: int, extend: int) -> int:
        """Prompt positions of this chunk whose logits score the next prompt token (prompt logprobs)."""
        if req.input_logprobs_done:
            return 0
        first = req.first_logprob_position(prefix_len)
        return max(0, min(prefix_len + extend, len(req.origin_input_ids) - 1) - first)

    @classmethod
    def _logprob_rows(cls, req: Req, prefix_len: int, extend: int) -> int:
        """Rows of this chunk whose logits score a token: the next prompt token (prompt logprobs), or an output
        token a jump-forward appended (``Req.output_logprob_positions``)."""
        return cls._prompt_logprob_rows(req, prefix_len, extend) + len(req.output_logprob_positions(prefix_len, extend))

    def _logprob_cap(self, plan: PrefillPlan, req: Req, prefix_len: int, extend: int) -> int:
        """``extend`` shortened (to a page boundary) so the chunk's logprob rows fit the batch's budget: a long
        prompt asking for logprobs is chunked rather than holding [tokens, vocab] fp32 logits at once."""
        if self._logprob_rows(req, prefix_len, extend) <= plan.logprob_budget:
            return extend
        if req.input_logprobs_done:  # the rows are output tokens a jump-forward appended
            first = max(prefix_len, req.first_output_logprob_position())
        else:
            first = req.first_logprob_position(prefix_len)
        return self._page_floor(max(0, first - prefix_len + plan.logprob_budget), extend)

    def _page_floor(self, budget, need: int) -> int:
        """Largest chunk <= budget that ends on a page boundary (so the tree can take the chunk's KV)."""
        n = int(min(budget, need))
        if n < need and self.page_size > 1:
            n -= n % self.page_size
        return n

    def _start_request(self, req: Req) -> bool:
        """Gives the request a slot row and writes its cached prefix into it."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        req.kv_len = len(req.prefix_indices)
        if req.kv_len:
            self.req_to_token_pool.write(idx, 0, req.prefix_indices)
        return True

    def alloc_slots(self, need: int, last_loc: int) -> torch.Tensor | None:
        if need <= 0:
            return torch.empty(0, dtype=torch.int64)
        # With pages, the tail may need one page more than need/page_size: ask for that much room.
        room = need if self.page_size == 1 else need + self.page_size
        shortfall = room - self.allocator.available_size()
        if shortfall > 0:
            t0 = time.perf_counter()
            self.tree_cache.evict(shortfall)
            self.stats.tree_op_seconds += time.perf_counter() - t0
        return self.allocator.alloc_extend(last_loc, need)

    def _last_loc(self, req: Req) -> int:
        if req.kv_len == 0 or self.page_size == 1:
            return -1  # one-token pages: the allocator does not continue the last one (alloc_extend)
        return int(self.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len - 1])

    def _alloc_extend(self, req: Req, extend_len: int) -> bool:
        locs = self.alloc_slots(extend_len, self._last_loc(req))
        if locs is None:
            return False
        self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, locs)
        req.kv_len += extend_len
        req.extend_input_len = extend_len
        return True

    def _build_extend_batch(self, reqs, prefix_lens, extend_lens) -> ScheduleBatch:
        locs = []
        logit_rows = []
        offset = 0
        for req, p, e in zip(reqs, prefix_lens, extend_lens):
            locs.append(self.req_to_token_pool.req_to_token[req.req_pool_idx, p : p + e])
            rows = []
            if not req.input_logprobs_done:
                first = req.first_logprob_position(p)
                last = min(p + e, len(req.origin_input_ids) - 1)
                rows = [offset + (pos - p) for pos in range(first, last)]
            rows += [offset + (pos - p) for pos in req.output_logprob_positions(p, e)]
            if not req.is_chunked and req.pooling is None:
                rows.append(offset + e - 1)  # the last token's logits are sampled (embeddings sample nothing)
            logit_rows.append(rows)
            offset += e
        return ScheduleBatch(reqs, ForwardMode.EXTEND, prefix_lens, extend_lens,
                             torch.cat(locs) if locs else torch.empty(0, dtype=torch.int64), logit_rows)

    def _run_extend(self, batch: ScheduleBatch) -> list[Req]:
        self.stats.num_prefill_batches += 1
        self.stats.num_chunked_prefill_batches += any(r.is_chunked for r in batch.reqs)
        running = {id(r) for r in self.running}  # mixed chunk: these decode one token in this batch
        prompt_tokens = sum(e for r, e in zip(batch.reqs, batch.extend_lens) if id(r) not in running)
        self.stats.max_prefill_batch_tokens = max(self.stats.max_prefill_batch_tokens, prompt_tokens)
        batch, logits = self._forward_contained(batch)
        self._cache_borrowed(batch)
        if self.overlap is not None:
            if batch.reqs and self.overlap.takes_prefill(batch.reqs, batch.logit_rows, running):
                sampled = []
                for req in batch.reqs:
                    self._cache_unfinished(req)  # share the prompt's KV with the batches planned meanwhile
                    if req.is_chunked:
                        self.chunked_req = req  # its next chunk comes first in the next batch
                    else:
                        self.running.append(req)
                        sampled.append(req)
                return self.overlap.start_prefill(sampled, logits)
            pending = self.overlap.drain()  # the sampling below reads the host: finish the step in flight first
        else:
            pending = []
        outputs: list[Req] = pending
        sample_reqs, sample_rows = [], []
        decode_reqs, decode_rows = [], []
        row = 0
        for req, p, e, rows in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.logit_rows):
            req_logits = logits[row : row + len(rows)]
            row += len(rows)
            if id(req) in running:
                decode_reqs.append(req)
                decode_rows.append(req_logits[-1])
                continue
            if not self._add_extend_logprobs(req, p, e, req_logits):
                continue
            if req.is_chunked:
                self._cache_unfinished(req)
                self.chunked_req = req
                continue
            if req.pooling is not None:
                self._finish_embedding(req)
                outputs.append(req)
                continue
            if req.sampling_params.max_new_tokens == 0 or req.remaining_new_tokens() == 0:
                # Prefill only: the frontend's fork hint caches the prefix and returns.
                if req.sampling_params.max_new_tokens == 0 and req.return_logprob and req.top_logprobs_num:
                    # Nothing is sampled, but the next token's top-k is asked for (upstream's cot_decoding
                    # reads output_top_logprobs[0] of a max_tokens=0 gen). Not for a request whose budget ran
                    # out (a jump-forward filled it): its top-k entries stay one per output token.
                    vals, ids = top_logprobs(req_logits[-1:], req.top_logprobs_num)
                    req.output_top_logprobs.append(list(zip(vals[0].tolist(), ids[0].tolist())))
                req.finished_reason = finish_length(len(req.output_ids))
                self.release(req)
                outputs.append(req)
                continue
            sample_reqs.append(req)
            sample_rows.append(req_logits[-1])
        if decode_reqs:  # first: the requests that finish leave the running batch before the new ones join it
            self.decay_new_token_ratio()
            outputs += self._sample_and_advance(decode_reqs, torch.stack(decode_rows), new_running=False)
        if sample_reqs:
            outputs += self._sample_and_advance(sample_reqs, torch.stack(sample_rows), new_running=True)
        return outputs

    def _finish_embedding(self, req: Req) -> None:
        """An embedding request's prompt is computed: its pooled vector is its result; its KV goes to the tree
        like any finished request's."""
        vec = req.pooled_sum
        if req.pooling.mode == "mean":
            vec = vec / len(req.origin_input_ids)
        if req.pooling.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        req.embedding = vec.cpu().tolist()
        req.pooled_sum = None
        req.finished_reason = finish_stop(None)
        self.release(req)

    def _add_extend_logprobs(self, req: Req, prefix_len: int, extend: int, logits: torch.Tensor) -> bool:
        """The prompt and forced-output logprobs this extend scored for ``req`` (its rows of ``logits``). False if
        that failed: the request is failed alone (the batch and the loop go on)."""
        try:
            n_prompt = self._prompt_logprob_rows(req, prefix_len, extend)
            output_positions = req.output_logprob_positions(prefix_len, extend)
            if not req.input_logprobs_done:
                self._add_input_logprobs(req, prefix_len, logits[:n_prompt])
                if not req.is_chunked:
                    req.input_logprobs_done = True
            if output_positions:
                self._add_output_logprobs(req, output_positions, logits[n_prompt : n_prompt + len(output_positions)])
        except Exception as e:  # noqa: BLE001 - one request's logprobs fail that request only
            logger.exception("logprobs of request %s failed", req.rid)
            self.fail_request(req, f"the logprob step failed for this request ({type(e).__name__}: {e})")
            return False
        return True

    def _add_input_logprobs(self, req: Req, prefix_len: int, logits: torch.Tensor) -> None:
        first = req.first_logprob_position(prefix_len)
        if req.logprob_start_len == 0 and prefix_len == 0:
            req.input_token_logprobs.append((None, req.origin_input_ids[0]))
            if req.top_logprobs_num:
                req.input_top_logprobs.append(None)
        if len(logits) == 0:
            return
        targets = torch.tensor(req.origin_input_ids[first + 1 : first + 1 + len(logits)], dtype=torch.int64,
                               device=logits.device)
        lps = token_logprobs(logits, targets).tolist()
        req.input_token_logprobs.extend(zip(lps, targets.tolist()))
        if req.top_logprobs_num:
            vals, ids = top_logprobs(logits, req.top_logprobs_num)
            req.input_top_logprobs.extend(list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist()))

    def _add_output_logprobs(self, req: Req, positions: range, logits: torch.Tensor) -> None:
        """Logprobs (and top-k) of the output tokens a jump-forward appended, from the logits of the positions
        before them that this extend recomputed: the model's distribution, as for sampled tokens."""
        start = positions.start + 1 - len(req.origin_input_ids)  # the output index the first row scores
        # Req.max_prefix_len keeps the first unscored token's position in the extend: entries stay in order.
        if start != len(req.output_token_logprobs):
            raise RuntimeError(f"output logprobs out of order: row for output {start}, "
                               f"{len(req.output_token_logprobs)} entries")
        targets = torch.tensor(req.output_ids[start : start + len(logits)], dtype=torch.int64, device=logits.device)
        req.output_token_logprobs.extend(zip(token_logprobs(logits, targets).tolist(), targets.tolist()))
        if req.top_logprobs_num:
            vals, ids = top_logprobs(logits, req.top_logprobs_num)
            req.output_top_logprobs.extend(list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist()))

    # Decode ------------------------------------------------------------------------------------------------
    def run_decode(self) -> list[Req]:
        self._retract_if_needed()
        reqs = self.running
        if not reqs:
            return []
        batch = ScheduleBatch(reqs, ForwardMode.DECODE, out_cache_loc=self._alloc_decode_slots(reqs))
        batch, logits = self._forward_contained(batch)
        reqs = batch.reqs
        for req in reqs:
            req.kv_len += 1
        self.stats.num_decode_batches += 1
        self.decay_new_token_ratio()
        return self._sample_and_advance(list(reqs), logits, new_running=False)

    def _alloc_decode_slots(self, reqs: list[Req]) -> torch.Tensor:
        """Each request's slot for the token at position kv_len, written into its table row (the caller has
        checked that they fit: ``_decode_need() <= available_tokens()``)."""
        if self.page_size == 1:
            # The whole step's slots in one allocation and one table write.
            locs = self.alloc_slots(len(reqs), -1)
            assert locs is not None, "decode allocation failed after the memory check"
            self.req_to_token_pool.write_tokens(torch.tensor([r.req_pool_idx for r in reqs]),
                                                torch.tensor([r.kv_len for r in reqs]), locs)
            return locs
        per_req = []
        for req in reqs:
            loc = self.alloc_slots(1, self._last_loc(req))
            assert loc is not None, "decode allocation failed after the memory check"
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, loc)
            per_req.append(loc)
        return torch.cat(per_req)

    def decay_new_token_ratio(self) -> None:
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def _decode_need(self) -> int:
        if self.page_size == 1:
            return len(self.running)
        # Only requests whose last page is full need a fresh page.
        return sum(self.page_size for r in self.running if r.kv_len % self.page_size == 0)

    def _wait_for_host_load(self) -> bool:
        return bool(self._host_loads()) and self.tree_cache.wait_for_load()

    def _reclaim_held_memory(self) -> bool:
        """Gives up device memory held for later: the oldest load back from the host waited for (done, its KV is
        evictable again: it stays in host memory), else the oldest session pin. False: nothing held."""
        return self._wait_for_host_load() or self._release_pin_for_memory()

    def _release_pin_for_memory(self) -> bool:
        if self.session_pins is None or not self.session_pins.release_oldest():
            return False
        logger.info("released a session pin under KV memory pressure")
        return True

    def _retract_chunked(self, req: Req) -> None:
        """A chunked prompt whose next chunk no longer fits (the running requests grew meanwhile) goes back to
        the front of the waiting queue; the chunks it computed stay in the tree, so it resumes from them."""
        self.release(req)
        req.reset_kv_state()
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting_queue.insert(0, req)
        self.new_token_ratio = 1.0
        logger.info("a chunked prompt's next chunk did not fit; it waits for memory")

    def _retract_if_needed(self) -> None:
        while self._decode_need() > self.available_tokens() and self._reclaim_held_memory():
            pass  # loads back and live sessions' pinned KV go before any running request is retracted
        if self._decode_need() <= self.available_tokens():
            return
        # Retract the requests that have decoded least (cheapest to redo), longest prompts first among them.
        self.running.sort(key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted = []
        while len(self.running) > 1 and self._decode_need() > self.available_tokens():
            req = self.running.pop()
            self.release(req)  # its KV goes into the tree: resuming it is mostly a cache hit
            req.reset_kv_state()
            req.num_retractions += 1
            retracted.append(req)
        if self._decode_need() > self.available_tokens():
            # One request alone has outgrown the pool: end it rather than stall the loop.
            req = self.running.pop()
            req.finished_reason = finish_abort("the sequence outgrew the KV cache; raise max_total_tokens", 507)
            self.release(req)
            self.pending_outputs.append(req)
        self.stats.num_retractions += len(retracted)
        self.waiting_queue = retracted[::-1] + self.waiting_queue
        self.new_token_ratio = 1.0  # be conservative again after running out of memory
        logger.info("retracted %d requests under KV memory pressure", len(retracted))

    # Shared by prefill and decode -------------------------------------------------------------------------
    def _forward(self, batch: ScheduleBatch) -> torch.Tensor:
        if self.fault_injector is not None:
            self.fault_injector.before_forward(batch.reqs)
        fb = batch.to_forward_batch(self.device, self.req_to_token_pool, self.server_args.cascade_min_saved_reads)
        t0 = time.perf_counter()
        logits = self.model_runner.forward(fb)
        if fb.pooled_sums is not None:  # embedding requests: this step's share of their pooled states
            for req, part in zip(batch.reqs, fb.pooled_sums):
                if part is not None:
                    req.pooled_sum = part if req.pooled_sum is None else req.pooled_sum + part
        self.stats.forward_seconds += time.perf_counter() - t0
        self.stats.num_forward_tokens += len(fb.input_ids)
        return logits

    # Fault containment: a failure that belongs to one request fails that request only ----------------------
    def _forward_contained(self, batch: ScheduleBatch) -> tuple[ScheduleBatch, torch.Tensor]:
        """Runs the batch. If the forward raises, each request is re-run alone (a forward writes only its own
        tokens' KV slots, so re-running is harmless); those that fail again are failed with a 500, the others
        go on as if nothing happened. Returns the surviving batch and its logits."""
        try:
            return batch, self._forward(batch)
        except Exception as e:  # noqa: BLE001 - contained below; unrelated bugs still surface in the log
            logger.exception("forward of a batch of %d failed; isolating the failing request(s)", len(batch.reqs))
            first_error = e
        kept, parts, dropped = [], [], set()
        for sub in split_batch(batch) if len(batch.reqs) > 1 else []:
            req = sub.reqs[0]
            if req.borrowed is not None and id(req.borrowed[0]) in dropped:
                dropped.add(id(req))  # its prefix was that request's new KV, freed with it: planned again
                self._requeue_borrower(req)
                continue
            try:
                parts.append(self._forward(sub))
                kept.append(sub)
            except Exception as e:  # noqa: BLE001
                dropped.add(id(req))
                self.fail_request(req, f"the model failed on this request ({type(e).__name__})",
                                   decode_slot=batch.forward_mode.is_decode())
        if len(batch.reqs) == 1:
            self.fail_request(batch.reqs[0], f"the model failed on this request ({type(first_error).__name__})",
                               decode_slot=batch.forward_mode.is_decode())
        logits = torch.cat(parts) if parts else torch.empty(0, self.model_runner.vocab_size, device=self.device)
        return merge_batches(kept, batch.forward_mode), logits

    def _requeue_borrower(self, req: Req) -> None:
        """A request whose lender (in-batch prefix sharing) failed: its own new slots are freed, its tree prefix
        unlocked, and it waits to be planned again, as if never admitted (nothing of it was sent yet)."""
        n_prefix = len(req.prefix_indices)
        self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, n_prefix : req.kv_len].clone())
        req.prefix_indices, req.borrowed = req.prefix_indices[: req.borrowed[1]], None
        self.tree_cache.cache_finished_req(req, req.all_ids[: len(req.prefix_indices)])  # unlocks, frees the row
        req.reset_kv_state()
        self.waiting_queue.append(req)

    def fail_request(self, req: Req, message: str, decode_slot: bool = False) -> None:
        """Ends one request with an internal error. Its own KV may be garbage, so it is freed, never shared
        through the tree; ``decode_slot``: the slot allocated for this decode step is freed too."""
        logger.error("request %s failed: %s", req.rid, message)
        req.finished_reason = finish_abort(message, 500)
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is not None:
            n_prefix = len(req.prefix_indices)
            end = req.kv_len + (1 if decode_slot else 0)
            self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, n_prefix:end].clone())
            if req.borrowed is not None:  # the borrowed part of its prefix is the lender's to free or cache
                req.prefix_indices, req.borrowed = req.prefix_indices[: req.borrowed[1]], None
                n_prefix = len(req.prefix_indices)
            self.tree_cache.cache_finished_req(req, req.all_ids[:n_prefix])  # unlocks the prefix, frees the row
        self.stats.num_aborted += 1
        self.pending_outputs.append(req)

    def _drop_non_finite(self, reqs: list[Req], logits: torch.Tensor) -> tuple[list[Req], torch.Tensor]:
        """NaN/inf logits (a numerically broken forward for some rows) fail those requests only."""
        if self.fault_injector is not None:
            logits = self.fault_injector.corrupt_logits(reqs, logits)
        finite = finite_rows(logits)
        if all(finite):
            return reqs, logits
        for req, ok in zip(reqs, finite):
            if not ok:
                self.fail_request(req, "the model produced non-finite logits (NaN or inf) for this request")
        keep = [i for i, ok in enumerate(finite) if ok]
        return [reqs[i] for i in keep], logits[keep]

    def _sample_and_advance(self, reqs: list[Req], logits: torch.Tensor, new_running: bool) -> list[Req]:
        reqs, logits = self._drop_non_finite(reqs, logits)
        reqs, logits, sample_logits = self._apply_grammar_masks(reqs, logits)
        if not reqs:
            return []
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs], [r.text_input_ids for r in reqs], [r.output_ids for r in reqs],
            [r.generator for r in reqs], self.eos_token_ids, self.model_runner.vocab_size, self.device)
        # The model's logits are finite here; only a grammar mask, a bias, a penalty or min_new_tokens can leave a
        # row with nothing to sample (or NaN), so only then is it checked (one [B, V] reduction).
        check = (sample_logits is not logits or info.bias_rows is not None or info.repetition_penalties is not None
                 or info.frequency_penalties is not None or info.blocked_rows is not None)
        if check:
            ids, ok = self.sampler(sample_logits, info, return_ok=True)
            ok = ok.tolist()
        else:
            ids, ok = self.sampler(sample_logits, info), None
        next_ids = ids.tolist()
        out_lps = None
        if any(r.return_logprob for r in reqs):
            out_lps = token_logprobs(logits, torch.tensor(next_ids, device=logits.device)).tolist()
        now = time.monotonic()
        advanced, n_sampled = [], 0
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            if ok is not None and not ok[i]:
                # Nothing legal to sample: end this request (its KV is sound and goes to the tree as usual).
                req.finished_reason = finish_abort(self._nothing_to_sample_message(req), 400)
                self.stats.num_aborted += 1
                logger.info("request %s ended: %s", req.rid, req.finished_reason["message"])
                advanced.append(req)
            elif self._append_token(req, tok, out_lps[i] if out_lps is not None else None, logits[i : i + 1], now):
                advanced.append(req)
                n_sampled += 1
        self.stats.num_generated_tokens += n_sampled
        self._after_sampling(advanced, new_running)
        return advanced

    def _apply_grammar_masks(self, reqs: list[Req], logits: torch.Tensor):
        """(requests, logits, logits to sample from): grammar requests' rows masked in a copy (logprobs stay those
        of the model, not of the mask); a request whose mask fails is failed and left out."""
        if not any(r.grammar is not None for r in reqs):
            return reqs, logits, logits
        sample_logits = logits.clone()
        failed = set()
        # On an accelerator, masks that come as packed bits (llguidance's) are applied to all their rows at once.
        batched = not sample_logits.is_cpu
        packed_rows, packed, vocab_size = [], [], 0
        for i, req in enumerate(reqs):
            if req.grammar is not None:
                try:
                    if batched and hasattr(req.grammar, "packed_mask"):
                        packed.append(req.grammar.packed_mask())
                        packed_rows.append(i)
                        vocab_size = req.grammar.grammar.vocab_size
                    else:
                        req.grammar.fill_mask(sample_logits[i])
                except GrammarTooComplex as e:  # the client's grammar past its budget mid-decode: a 400
                    self._end_over_budget(req, e)
                    failed.add(i)
                except Exception as e:  # noqa: BLE001 - one request's grammar fails that request only
                    logger.exception("grammar mask failed for request %s", req.rid)
                    self.fail_request(req, f"the grammar step failed for this request ({type(e).__name__}: {e})")
                    failed.add(i)
        apply_packed_masks(sample_logits, packed_rows, packed, vocab_size)
        if not failed:
            return reqs, logits, sample_logits
        keep = [i for i in range(len(reqs)) if i not in failed]
        return [reqs[i] for i in keep], logits[keep], sample_logits[keep]

    def _end_over_budget(self, req: Req, error: Exception) -> None:
        """Ends one request whose grammar went past its budget while decoding (llguidance's step fuel or lexer
        limits) with a 400: the grammar is the client's; its KV is sound and goes to the tree."""
        logger.info("request %s ended: %s", req.rid, error)
        req.finished_reason = finish_abort(str(error), 400)
        if req in self.running:
            self.running.remove(req)
        self.release(req)
        self.stats.num_aborted += 1
        self.pending_outputs.append(req)

    def _append_token(self, req: Req, tok: int, logprob: float | None, logits_row: torch.Tensor, now: float) -> bool:
        """Adds the sampled token (and its logprobs), advances the grammar, checks for the end. False if this
        request's post-processing failed (the request is failed alone)."""
        try:
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.return_logprob:
                req.output_token_logprobs.append((logprob, tok))
                if req.top_logprobs_num:
                    vals, top_ids = top_logprobs(logits_row, req.top_logprobs_num)
                    req.output_top_logprobs.append(list(zip(vals[0].tolist(), top_ids[0].tolist())))
            if req.grammar is not None:
                req.grammar.advance(tok)
            self.check_finished(req)
        except GrammarTooComplex as e:  # the client's grammar past its budget mid-decode: a 400
            self._end_over_budget(req, e)
            return False
        except Exception as e:  # noqa: BLE001 - one request's post-processing fails that request only
            logger.exception("post-processing of request %s failed", req.rid)
            self.fail_request(req, f"the step failed for this request ({type(e).__name__}: {e})")
            return False
        return True

    def _after_sampling(self, reqs: list[Req], new_running: bool) -> None:
        """Finished requests leave (their KV to the tree); new ones join the running batch; grammars jump ahead."""
        for req in reqs:
            if req.finished():
                if not new_running:
                    self.running.remove(req)
                self.release(req)
                continue
            if new_running:
                self._cache_unfinished(req)  # share the prompt's KV with requests arriving meanwhile
                self.running.append(req)
            if req.grammar is not None and self._may_jump_forward():
                try:
                    self._jump_forward(req)
                except Exception as e:  # noqa: BLE001 - contained like the grammar step above
                    logger.exception("jump-forward of request %s failed", req.rid)
                    if req in self.waiting_queue:
                        self.waiting_queue.remove(req)
                    self.fail_request(req, f"the grammar step failed for this request ({type(e).__name__}: {e})")

    @staticmethod
    def _nothing_to_sample_message(req: Req) -> str:
        what = "no token allowed by the grammar" if req.grammar is not None else "no token"
        return (f"{what} is left to sample after logit_bias, penalties and min_new_tokens (which bans "
                f"stop_token_ids and EOS until min_new_tokens tokens are generated) are applied, or the "
                f"sampling logits became NaN")

    def _may_jump_forward(self) -> bool:
        """Jump-forward trades the forced tokens' decode steps for one extend pass. On a GPU a decode step costs
        about the same for 1 or 64 requests, so in a batch the steps go on for the others anyway, and the extend
        pass (launched without a CUDA graph) costs more than it saves: JSON decoding on an H200 took 0.40 s vs 0.30 s
        at 8 requests with it, a tie at 1. Hence ``jump_forward_max_batch`` (auto: 1 on a GPU, no limit on the
        CPU, where every decoded token costs its share of the step)."""
        sa = self.server_args
        if sa.disable_jump_forward:
            return False
        limit = sa.jump_forward_max_batch
        if limit is None:
            limit = 0 if self.device == "cpu" else 1
        return limit == 0 or len(self.running) <= limit

    def _jump_forward(self, req: Req) -> None:
        """Appends the grammar's forced continuation in one step (compressed FSM): the text is re-tokenized
        with the real tokenizer at the boundary, the request leaves the running batch, and its next extend
        prefills only the new tail against its cached prefix (paper §4)."""
        forced = req.grammar.forced_string()
        if not forced:
            return
        n_drop, new_ids = retokenize_jump_forward(self.tokenizer, req.output_ids, forced)
        room = self.context_len - 1 - (req.seq_len - n_drop)
        if not new_ids or len(new_ids) > room:
            return  # no room: decode it token by token instead
        req.grammar.advance_text(forced)
        # The KV of the current tokens is valid: hand it to the tree as is. Re-admission matches the new
        # token sequence up to where re-tokenization changed it, and the old tail is left for eviction.
        self.running.remove(req)
        self.release(req)
        req.reset_kv_state()
        if n_drop:
            del req.output_ids[-n_drop:]
            req.output_ids_rewritten_from = min(req.output_ids_rewritten_from, len(req.output_ids))
            # The dropped tokens' logprob entries go too; the next extend scores the re-tokenized tail.
            del req.output_token_logprobs[len(req.output_ids):]
            del req.output_top_logprobs[len(req.output_ids):]
        req.output_ids.extend(new_ids)
        self.waiting_queue.insert(0, req)
        self.stats.num_jump_forward += 1
        self.stats.num_jump_forward_tokens += len(new_ids)

    def check_finished(self, req: Req) -> None:
        sp = req.sampling_params
        tok = req.output_ids[-1]
        if req.grammar is not None and req.grammar.is_finished():
            # The grammar is complete and allows nothing more (or ended with EOS).
            req.finished_reason = finish_stop(tok if tok in self.eos_token_ids else None)
            return
        if len(req.output_ids) < sp.min_new_tokens:
            pass
        elif not sp.ignore_eos and tok in self.eos_token_ids:
            req.finished_reason = finish_stop(tok)
            return
        elif sp.stop_token_ids and tok in sp.stop_token_ids:
            req.finished_reason = finish_stop(tok)
            return
        elif sp.stop:
            tail = self.tokenizer.decode(req.output_ids[-(sp.stop_str_max_len + 1):])
            for s in sp.stop:
                if s in tail:
                    req.finished_reason = finish_stop(s)
                    return
        if len(req.output_ids) >= sp.max_new_tokens:
            req.finished_reason = finish_length(len(req.output_ids))
        elif req.seq_len >= self.context_len:
            req.finished_reason = finish_length(len(req.output_ids))

    # KV hand-off to the tree ------------------------------------------------------------------------------
    def _cache_unfinished(self, req: Req) -> None:
        if len(req.prefix_indices) >= req.kv_len - req.kv_len % self.page_size:
            return  # already the tree's, up to its last whole page (in-batch sharing caches a batch's early)
        t0 = time.perf_counter()
        self.tree_cache.cache_unfinished_req(req, req.all_ids[: req.kv_len])
        self.stats.tree_op_seconds += time.perf_counter() - t0

    def release(self, req: Req) -> None:
        """Request done (or retracted/aborted): its KV goes to the tree, its slot row is freed."""
        if req.req_pool_idx is None:
            return
        t0 = time.perf_counter()
        node = self.tree_cache.cache_finished_req(req, req.all_ids[: req.kv_len])
        self.stats.tree_op_seconds += time.perf_counter() - t0
        if req.finished():
            self.stats.num_finished += 1
            if self.programs is not None:  # the program's attained service: the tokens computed for this call
                self.programs.charge(req.session_id,
                                     len(req.origin_input_ids) - req.cached_tokens + len(req.output_ids))
            if req.session_id is not None and self.session_pins is not None and req.finished_reason["type"] != "abort":
                self.session_pins.pin(req.session_id, node, req.kv_len - req.kv_len % self.page_size)

    # Maintenance ------------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        if self.overlap is not None:
            # Reported with the next step: a request the drained step ended would otherwise never be answered.
            self.pending_outputs += self.overlap.drain()
        if self.has_work():
            return False
        if self.session_pins is not None:
            self.session_pins.release_all()
        self.tree_cache.reset()
        feature_cache = getattr(self.model_runner.model, "feature_cache", None)  # multimodal models
        if feature_cache is not None:
            feature_cache.clear()
        return True

    def check_pool_whole(self) -> None:
        """Idle invariant: every KV slot is free or evictable in the tree; nothing locked; all rows free. Raises
        ``PoolNotWholeError`` naming what is wrong (also when the scheduler still has work: not idle)."""
        if self.has_work():
            raise PoolNotWholeError("the scheduler is not idle")
        free = self.allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        # Session pins are the one lock allowed at idle (released by time to live, session end or memory need).
        pinned = self.session_pins.pinned_tokens() if self.session_pins is not None else 0
        problems = []
        if free + evictable + pinned != self.max_total_num_tokens:
            problems.append(f"free {free} + evictable {evictable} + session-pinned {pinned} != total "
                            f"{self.max_total_num_tokens}")
        if self.tree_cache.protected_size() != pinned:
            problems.append(f"{self.tree_cache.protected_size() - pinned} tokens still locked in the tree")
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            problems.append("request slots still held")
        if self.host_tier:
            host, held = self.tree_cache.host, self.tree_cache.host_held_tokens()
            if held + host.available_size() != host.size:
                problems.append(f"host tier: {held} held + {host.available_size()} free != {host.size}")
        if problems:
            raise PoolNotWholeError("KV pool not whole at idle: " + "; ".join(problems))

    def get_stats(self) -> dict:
        if self.session_pins:
            self.session_pins.expire()  # an idle loop does not step: stats show the pins that are still live
        s = self.stats
        return {
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_cached_tokens": s.num_cached_tokens,
            "cache_hit_rate": s.cache_hit_rate,
            "num_generated_tokens": s.num_generated_tokens,
            "num_prefill_batches": s.num_prefill_batches,
            "num_chunked_prefill_batches": s.num_chunked_prefill_batches,
            "max_prefill_batch_tokens": s.max_prefill_batch_tokens,
            "num_decode_batches": s.num_decode_batches,
            "num_mixed_batches": s.num_mixed_batches,
            "num_forward_tokens": s.num_forward_tokens,
            "num_borrowed_prefix_tokens": s.num_borrowed_prefix_tokens,
            "num_retractions": s.num_retractions,
            "num_jump_forward": s.num_jump_forward,
            "num_jump_forward_tokens": s.num_jump_forward_tokens,
            "num_evicted_tokens": getattr(self.tree_cache, "num_evicted_tokens", 0),
            "num_finished": s.num_finished,
            "num_aborted": s.num_aborted,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting_queue) + (1 if self.chunked_req else 0),
            "tree_op_seconds": s.tree_op_seconds,
            "forward_seconds": s.forward_seconds,
            "free_tokens": self.allocator.available_size(),
            "evictable_tokens": self.tree_cache.evictable_size(),
            "max_total_num_tokens": self.max_total_num_tokens,
            "new_token_ratio": self.new_token_ratio,
            **(self.session_pins.report() if self.session_pins is not None else {}),
            **(self.programs.report() if self.programs is not None else {}),
            **(self.tree_cache.host_report() if isinstance(self.tree_cache, RadixCache) else {}),
            **(self.model_runner.model.mm_stats() if hasattr(self.model_runner.model, "mm_stats") else {}),
        }


# The scheduler process (server mode) ------------------------------------------------------------------------------
def run_scheduler_process(server_args, ipc: dict, ready_conn) -> None:
    """Loads the model, then loops: drain requests from the tokenizer manager, step, send outputs on."""
    die_with_parent()  # SIGKILL with the server process; SIGINT ignored (see utils.die_with_parent)
    logging.basicConfig(level=server_args.log_level.upper(), format="[scheduler] %(levelname)s %(message)s")
    try:
        model_dir, config, tokenizer = load_model_assets(server_args)
        sched = Scheduler(server_args, config, model_dir, tokenizer)
    except BaseException as e:  # noqa: BLE001 - report start-up failure to the parent, then exit
        ready_conn.send(SchedulerFailed(f"{type(e).__name__}: {e}"))
        raise SystemExit(1)
    SchedulerProcess(sched, ipc).serve(ready_conn, model_dir)


class SchedulerProcess:
    """The server's driving loop around a ``Scheduler``: ZMQ in (requests, aborts, controls), one
    ``BatchTokenOut`` per step out to the detokenizer."""

    def __init__(self, sched: Scheduler, ipc: dict):
        self.sched = sched
        self.ctx = zmq.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(ipc["scheduler_input"])
        self.send = self.ctx.socket(zmq.PUSH)
        self.send.connect(ipc["detokenizer_input"])
        self.outputs = OutputCollector()

    def ready_info(self, model_dir: str) -> dict:
        sched = self.sched
        config = sched.model_runner.config
        return {
            "model_dir": model_dir,
            "architecture": (getattr(config, "architectures", None) or [config.model_type])[0],
            "context_len": sched.context_len,
            "max_total_num_tokens": sched.max_total_num_tokens,
            "vocab_size": sched.model_runner.vocab_size,
            "hidden_size": sched.model_runner.text_config.hidden_size,  # an embedding's dimensions
            "max_running_requests": sched.server_args.max_running_requests,
            "device": sched.device,
            "dtype": str(sched.model_runner.dtype).replace("torch.", ""),
            "pid": os.getpid(),
            "eos_token_ids": sorted(sched.eos_token_ids),
        }

    def serve(self, ready_conn, model_dir: str) -> None:
        ready_conn.send(SchedulerReady(self.ready_info(model_dir)))
        parent = os.getppid()
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        while True:
            if poller.poll(0 if self.sched.has_work() else 1000):
                self.drain_inbox()
            elif os.getppid() != parent:
                return  # the server process is gone: do not linger as an orphan
            batch = self.outputs.collect(self.sched.run_iteration())
            if batch is not None:
                self.send.send_pyobj(batch)

    def drain_inbox(self) -> None:
        while True:
            try:
                msg = self.recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            except pickle.UnpicklingError:
                logger.exception("dropping an unreadable message")
                continue
            self.handle(msg)

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.sched.add_tokenized(msg)
        elif isinstance(msg, AbortReq):
            self.sched.handle_control("abort", msg.rid)
        elif isinstance(msg, ControlReq):
            self.send.send_pyobj(ControlOut(msg.req_id, self.sched.handle_control(msg.kind, msg.payload)))
