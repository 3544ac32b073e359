"""The HTTP process's side of the pipeline: tokenizes and validates requests, sends them to the scheduler
process, and routes text coming back from the detokenizer process to each waiting request.

Process layout (all on this host, ZMQ over IPC sockets):
    HTTP + TokenizerManager --> Scheduler (model, KV pool, radix tree) --> Detokenizer --> TokenizerManager
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time
import uuid
import weakref
from typing import AsyncIterator

import zmq
import zmq.asyncio

from ... import environ
from .io_struct import AbortReq, BatchStrOut, ControlOut, ControlReq, SchedulerFailed
from .request_frontend import GenerateInput, RequestFrontend, RequestState
from .validation import ModelLimits, check_rid, scoped_session_id

__all__ = ["GenerateInput", "Overloaded", "RequestFailed", "RequestState", "ServerUnavailable", "TokenizerManager"]

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600


class ServerUnavailable(RuntimeError):
    """A pipeline process died, or the server is shutting down: requests fail fast instead of hanging (503)."""


class Overloaded(RuntimeError):
    """More requests in flight than the server queues: the client should retry later (503 + Retry-After)."""


class RequestFailed(RuntimeError):
    """The request itself failed inside the pipeline (model fault, NaN logits, detokenizer error, timeout);
    other requests are unaffected."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class TokenizerManager:
    def __init__(self, server_args):
        self.server_args = server_args
        self.rid_to_state: dict[str, RequestState] = {}
        self.rid_owner: dict[str, str] = {}  # internal rid -> owner (the principal that sent it)
        self.client_rids: dict[tuple[str, str], str] = {}  # (owner, client rid) -> internal rid
        self.reserved = 0  # admitted requests whose generate() has not started yet
        self.control_waiters: dict[str, asyncio.Future] = {}
        self.procs: list[mp.Process] = []
        self.dead_reason: str | None = None
        self.died = asyncio.Event()  # set with dead_reason (an Event binds to the loop that first waits on it)
        self.info: dict = {}
        self.metrics = None  # set by the HTTP server
        self.tokenizer_lock = threading.Lock()

    # Start-up / shutdown ------------------------------------------------------------------------------------------
    def launch(self) -> None:
        """Starts the scheduler and detokenizer processes and waits until the model is loaded. If that fails or
        is interrupted (Ctrl-C: the children ignore SIGINT), the processes started so far are stopped.

        Call it from the thread that runs the server to its end (``launch_server``: the main thread): the
        children die with that thread (PR_SET_PDEATHSIG, see ``utils.die_with_parent``)."""
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise

    def _launch(self) -> None:
        # Deferred: torch and the model code load only when a server starts, not wherever this module is imported.
        from ..model_loader.loader import load_model_assets
        from ..multimodal.processor import MultimodalProcessor
        from .detokenizer_manager import run_detokenizer_process
        from .scheduler import run_scheduler_process

        sa = self.server_args
        model_dir, config, self.tokenizer = load_model_assets(sa)  # fails fast (ValueError) on unknown models
        self.mm_processor = MultimodalProcessor.for_model(config, model_dir, self.tokenizer, sa.allow_local_media)
        self.ipc_dir = tempfile.mkdtemp(prefix="sglang-backend-")
        ipc = {name: f"ipc://{self.ipc_dir}/{name}" for name in ("scheduler_input", "detokenizer_input", "tokenizer_input")}
        # Idle OpenMP threads of the scheduler's torch must sleep, not spin: between the many small parallel
        # regions of a CPU decode step, GNU OpenMP's default busy-wait kept a second core 100% busy for no
        # work, and with other processes on the cores that spinning made each step several times slower
        # (benchmarks/bench_server_vs_engine.py). Read by libgomp when the child imports torch, so set here.
        environ.set_default("OMP_WAIT_POLICY", "PASSIVE")
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        sched = ctx.Process(target=run_scheduler_process, args=(sa, ipc, child_conn), name="sglang-backend-scheduler", daemon=True)
        detok = ctx.Process(target=run_detokenizer_process, args=(sa, ipc, sa.tokenizer_path or model_dir),
                            name="sglang-backend-detokenizer", daemon=True)
        self.zmq_ctx = zmq.asyncio.Context()
        self.recv = self.zmq_ctx.socket(zmq.PULL)
        self.recv.bind(ipc["tokenizer_input"])
        sched.start()
        self.procs = [sched]
        detok.start()
        self.procs = [sched, detok]
        if not parent_conn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError("the scheduler process did not become ready in time")
        msg = parent_conn.recv()
        if isinstance(msg, SchedulerFailed):
            raise RuntimeError(f"the scheduler process failed to start: {msg.error}")
        self.info = msg.info
        self.limits = ModelLimits(self.info["context_len"], self.info["max_total_num_tokens"], self.info["vocab_size"])
        self.send = self.zmq_ctx.socket(zmq.PUSH)
        self.send.connect(ipc["scheduler_input"])
        self._grammar_cache = None
        self.frontend = RequestFrontend(self.tokenizer, self.limits, self.mm_processor, lambda: self.grammar_cache,
                                        self.tokenizer_lock)

    @property
    def grammar_cache(self):
        """Same cache key as the scheduler's (vocab, EOS ids), so its disk cache serves both processes."""
        with self.tokenizer_lock:  # built once (it reads the vocabulary), by whichever preparing thread comes first
            if self._grammar_cache is None:
                from ..constrained import GrammarCache, cache_options  # deferred: only servers that see a grammar

                self._grammar_cache = GrammarCache(self.tokenizer, self.limits.vocab_size,
                                                   set(self.info["eos_token_ids"]), **cache_options(self.server_args))
            return self._grammar_cache

    def start_background(self) -> None:
        """Called inside the server's event loop."""
        self.loop_task = asyncio.create_task(self._recv_loop())
        self.watch_task = asyncio.create_task(self._watch_processes())

    def fail_requests(self, reason: str) -> None:
        """Ends every request in flight with a 503 ``reason`` (the server is stopping); each one's ``generate``
        then aborts it at the scheduler, freeing its KV."""
        for state in self.rid_to_state.values():
            state.queue.put_nowait(ServerUnavailable(reason))

    def shutdown(self) -> None:
        """Stops the pipeline processes (SIGTERM, then SIGKILL after 10 s)."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and all(p.is_alive() for p in self.procs)

    async def _watch_processes(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(0.1)  # a dead pipeline process is noticed within 0.1 s
            for p in self.procs:
                if not p.is_alive():
                    self._fail_all(f"{p.name} exited with code {p.exitcode}")
                    return

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        self.died.set()
        logger.error("pipeline failure: %s", reason)
        for state in self.rid_to_state.values():
            state.queue.put_nowait(ServerUnavailable(reason))
        for fut in self.control_waiters.values():
            if not fut.done():
                fut.set_exception(ServerUnavailable(reason))

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = await self.recv.recv_pyobj()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one unreadable message must not stop every request's replies
                logger.exception("dropping an unreadable message from the detokenizer")
                continue
            if isinstance(msg, ControlOut):
                fut = self.control_waiters.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.result)
                continue
            if not isinstance(msg, BatchStrOut):
                logger.error("dropping an unexpected message %r", type(msg).__name__)
                continue
            for out in msg.outputs:
                state = self.rid_to_state.get(out.rid)
                if state is not None:  # else the client went away
                    state.queue.put_nowait(out)

    # Requests ---------------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.frontend.tokenize(text, add_special_tokens)

    def prepare(self, *, rid: str | None = None, owner: str = "", **kwargs) -> GenerateInput:
        """Tokenizes and validates one prompt (``RequestFrontend.prepare`` takes the other arguments: text or
        input_ids, sampling_params, stream, return_logprob, logprob_start_len, top_logprobs_num, extra_key,
        image_data, add_special_tokens, cancel); raises ValueError with the reason. Thread-safe (the server
        prepares requests on several threads). ``rid`` is the client's id, unique per ``owner``."""
        if self.dead_reason is not None:
            raise ServerUnavailable(self.dead_reason)
        check_rid(rid)
        if rid is not None and (owner, rid) in self.client_rids:
            raise ValueError(f"request id {rid!r} is already in use")
        gi = self.frontend.prepare(uuid.uuid4().hex, **kwargs)
        gi.client_rid, gi.owner = rid, owner
        gi.session_id = scoped_session_id(owner, gi.session_id)
        return gi

    def check_capacity(self, gis: list[GenerateInput]) -> None:
        """Bounded queue: running slots plus max_queued_requests waiting; beyond that, refuse. Admitted requests
        hold a reservation until generate() starts, or until they are dropped unstarted (a stream whose client
        left first): a weakref finalizer gives the place back then."""
        self.check_room(len(gis))
        for gi in gis:
            self.reserved += 1
            gi.reservation = weakref.finalize(gi, self._unreserve)

    def check_room(self, n: int) -> None:
        """Raises ``Overloaded`` if ``n`` more requests would pass the in-flight bound (running + queued)."""
        sa = self.server_args
        in_flight = len(self.rid_to_state) + self.reserved
        if in_flight + n > sa.max_running_requests + sa.max_queued_requests:
            raise Overloaded(f"{in_flight} requests in flight; the server queues at most "
                             f"{sa.max_running_requests + sa.max_queued_requests}")

    def _unreserve(self) -> None:
        self.reserved -= 1

    async def generate(self, gi: GenerateInput) -> AsyncIterator[dict]:
        """Yields result dicts: text pieces while streaming, then the final one (with finish_reason)."""
        if gi.reservation is not None:
            gi.reservation()  # runs _unreserve once; rid_to_state counts the request from here on
        if self.dead_reason is not None:
            raise ServerUnavailable(self.dead_reason)
        state = RequestState(gi.client_rid or gi.rid, asyncio.Queue(), gi.stream)
        self.rid_to_state[gi.rid] = state
        self.rid_owner[gi.rid] = gi.owner
        client_key = (gi.owner, gi.client_rid)
        if gi.client_rid is not None:
            self.client_rids.setdefault(client_key, gi.rid)  # a racing duplicate runs under its own id only
        self.send.send_pyobj(gi.tokenized())
        finished = False
        try:
            timeout = self.server_args.request_timeout
            deadline = None if timeout is None else state.created + timeout
            while True:
                try:
                    if deadline is None:
                        msg = await state.queue.get()
                    else:
                        msg = await asyncio.wait_for(state.queue.get(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise RequestFailed(f"the request took longer than the server's limit of {timeout:g} s", 504) from None
                if isinstance(msg, Exception):
                    raise msg
                fr = msg.finished_reason or {}
                if fr.get("type") == "abort" and fr.get("status_code", 400) >= 500:
                    # Not marked finished: the finally also aborts it at the scheduler (a no-op if it ended
                    # there; needed when the detokenizer failed it).
                    raise RequestFailed(fr.get("message", "internal error"), fr["status_code"])
                finished = msg.finished_reason is not None
                state.merge(msg)
                if state.first_token_time is None and msg.output_ids:
                    state.first_token_time = time.monotonic()
                    if self.metrics:
                        self.metrics.observe_ttft(state.first_token_time - state.created)
                yield state.result(msg.text if gi.stream else state.text, msg.finished_reason)
                if finished:
                    if self.metrics:
                        self.metrics.observe_finished(state)
                        self.metrics.observe_reason(msg.finished_reason.get("type", "unknown"))
                    return
        finally:
            self.rid_to_state.pop(gi.rid, None)
            self.rid_owner.pop(gi.rid, None)
            if self.client_rids.get(client_key) == gi.rid:
                del self.client_rids[client_key]
            if not finished and self.dead_reason is None:
                # Client disconnected (or cancelled): free its KV now.
                self.send.send_pyobj(AbortReq(gi.rid))

    def abort(self, rid: str, owner: str = "") -> bool:
        """Aborts the caller's own request, named by the id it gave or the id the server returned. Another
        owner's request is "not found", exactly like one that does not exist."""
        internal = self.client_rids.get((owner, rid))
        if internal is None and self.rid_owner.get(rid) == owner:
            internal = rid
        if internal is None:
            return False
        self.send.send_pyobj(AbortReq(internal))
        return True

    async def control(self, kind: str, timeout: float = 30.0, payload=None):
        if self.dead_reason is not None:
            raise ServerUnavailable(self.dead_reason)
        req_id = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[req_id] = fut
        self.send.send_pyobj(ControlReq(kind, req_id, payload))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.control_waiters.pop(req_id, None)

    def num_running(self) -> int:
        return len(self.rid_to_state)

    def cleanup_ipc(self) -> None:
        try:
            for name in os.listdir(self.ipc_dir):
                os.unlink(os.path.join(self.ipc_dir, name))
            os.rmdir(self.ipc_dir)
        except OSError:
            pass
