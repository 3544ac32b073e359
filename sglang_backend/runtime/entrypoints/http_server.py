"""FastAPI server: native /generate, OpenAI-compatible /v1/*, Ollama's /api/*, and operations endpoints.

This module builds the app (``create_app``) and serves it (``launch_server``). The routes live in one module per
API family (``native_api``, ``openai_chat``, ``openai_completions``, ``openai_embeddings``, ``ollama_api``,
``operations``), sharing ``app_context`` (the per-app state), ``request_parsing``, ``execution`` (preparing and
running requests), ``streaming`` (SSE), ``errors`` (every exception -> status and body) and ``middleware``.

Every error a client can cause is a 4xx with an OpenAI-style body {"error": {"message", "type", "param",
"code"}}; internal failures are 5xx without stack traces.

Hostile-input and overload defences (README "Reliability and security"): request bodies are capped
(``--max-request-body-bytes``, 413) and parsed JSON is checked for depth and invalid Unicode before any model
sees it; slow clients are closed at the header and body read timeouts (``connection_guard``); tokenizing, chat
templates, images and grammar compilation run on a bounded pool of threads, each job within its budget
(``preparation``), so one heavy request never stalls the event loop or the others; past
``max_running_requests + max_queued_requests`` requests in flight new ones get 503 + Retry-After;
``--request-timeout`` aborts slow requests (504). Request ids are scoped to the credential that sent them (the
Authorization header), so one client cannot abort another's request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI

from ...utils import die_with_parent_if_requested
from ..managers.tokenizer_manager import TokenizerManager
from . import native_api, ollama_api, openai_chat, openai_completions, openai_embeddings, openai_responses, operations
from .app_context import AppContext
from .connection_guard import DrainingMiddleware, guarded_h11_protocol
from .errors import RETRY_AFTER_S, APIError, install_error_handlers
from .middleware import APIKeyMiddleware, install_middleware
from .request_parsing import check_json_value

# APIError, APIKeyMiddleware and check_json_value: still importable from here, where they used to live.
__all__ = ["APIError", "APIKeyMiddleware", "check_json_value", "create_app", "launch_server"]

logger = logging.getLogger(__name__)

PIPELINE_DEATH_GRACE_S = 0.3  # after a pipeline process dies: time for error replies to reach clients before exit

# The API families: one module each, whose ``register(app)`` adds its routes. A new family (tool calling,
# Responses, Ollama, embeddings, ...) is one new module plus one line here; its routes read the shared state
# with ``app_context.get_context(request)``.
API_FAMILIES = (
    native_api,  # /generate
    openai_chat,  # /v1/chat/completions
    openai_completions,  # /v1/completions
    openai_embeddings,  # /v1/embeddings
    openai_responses,  # /v1/responses, GET / DELETE /v1/responses/{id}
    ollama_api,  # /api/chat, /api/generate, /api/embed, /api/tags, /api/show, ... (Ollama's API)
    operations,  # /tokenize, /v1/models, health, info, load, stats, flush_cache, abort, metrics
)


def create_app(tm: TokenizerManager, server_args) -> FastAPI:
    app = FastAPI(title="sglang_backend", version=operations.VERSION)
    ctx = AppContext.build(tm, server_args)
    tm.metrics = ctx.metrics
    app.state.ctx = ctx  # what the routes share (app_context.get_context)
    app.router.add_event_handler("startup", tm.start_background)  # inside the server's event loop
    install_error_handlers(app)
    install_middleware(app, server_args)
    for family in API_FAMILIES:
        family.register(app)
    return app


class _StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM for ``launch_server``. The first one prints one line and is remembered (it
    picks the exit status); during start-up it raises KeyboardInterrupt to unwind the start (``launch`` stops
    the processes it started), while serving it asks uvicorn to stop. Later ones change nothing: the shutdown
    already under way is bounded."""

    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.received: list[int] = []
        self.server = None  # the uvicorn server, once serving
        self.previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self.previous = {sig: signal.signal(sig, self.handle) for sig in self.NAMES}

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def note(self, sig: int) -> None:
        if not self.received:
            os.write(2, f"sglang-backend: shutting down ({self.NAMES.get(sig, sig)})\n".encode())
        self.received.append(sig)

    def handle(self, sig: int, frame) -> None:
        first = not self.received
        self.note(sig)
        if self.server is not None:
            self.server.should_exit = True
        elif first:
            raise KeyboardInterrupt

    @property
    def interrupted(self) -> bool:
        return bool(self.received) and self.received[0] == signal.SIGINT

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 0  # 128 + SIGINT, as a shell reports a Ctrl-C'd program


def launch_server(server_args) -> None:
    """Starts the pipeline processes and serves HTTP until stopped; no orphan processes are left.

    Ctrl-C (SIGINT, which a terminal sends to the whole process group; the pipeline processes ignore it) or
    SIGTERM, at any time, start-up included: one line on stderr ("sglang-backend: shutting down (Ctrl-C)"), the
    requests in flight end with a 503 (after Ctrl-C at once; after SIGTERM once they had up to
    ``--graceful-shutdown-timeout`` seconds to finish), new connections are refused and a request sent meanwhile on
    a connection kept alive gets 503 + Retry-After without being run (``connection_guard``), the pipeline
    processes are stopped, and the process exits with 130 after Ctrl-C, 0 after SIGTERM, 1 if a pipeline process
    died. A second Ctrl-C stops waiting for open connections. With ``SGLANG_BACKEND_DIE_WITH_PARENT=1`` in the
    environment this process also dies with its parent, even a SIGKILLed one (``utils.die_with_parent_if_requested``).
    """
    die_with_parent_if_requested()
    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    stop = _StopSignals()
    stop.install()
    tm = TokenizerManager(server_args)
    try:
        tm.launch()  # model loading (on a first run also the embedded model's conversion)
        server = _build_server(create_app(tm, server_args), server_args, stop)
        asyncio.run(_serve(server, tm, stop, server_args.graceful_shutdown_timeout))
    except KeyboardInterrupt:  # raised by stop.handle during start-up
        if not stop.received:
            raise
    finally:
        tm.shutdown()
        if getattr(tm, "ipc_dir", None):
            tm.cleanup_ipc()
        stop.restore()
    if tm.dead_reason is not None:
        _exit_after_pipeline_death(tm.dead_reason)
    if stop.received:
        raise SystemExit(stop.exit_code)


class _Server(uvicorn.Server):
    """uvicorn's server, telling ``stop`` about the signals its own handler receives while it serves."""

    def __init__(self, config: uvicorn.Config, stop: _StopSignals):
        super().__init__(config)
        self.stop = stop

    def handle_exit(self, sig, frame):
        self.stop.note(sig)
        super().handle_exit(sig, frame)


def _build_server(app: FastAPI, server_args, stop: _StopSignals) -> _Server:
    # Outermost: once stopping, requests (on connections still open) get 503 + Retry-After, not started.
    app.add_middleware(DrainingMiddleware, is_draining=lambda: server.should_exit, retry_after=RETRY_AFTER_S)
    # h11 with header and body read timeouts (slow clients), idle connections kept for the drain's 503s.
    protocol = guarded_h11_protocol(server_args.header_read_timeout, server_args.body_read_timeout,
                                    server_args.body_idle_timeout)
    server = _Server(uvicorn.Config(app, host=server_args.host, port=server_args.port, http=protocol,
                                    log_level=server_args.log_level,
                                    timeout_keep_alive=server_args.keep_alive_timeout,
                                    timeout_graceful_shutdown=server_args.graceful_shutdown_timeout + 2), stop)
    stop.server = server
    if stop.received:  # a signal between the end of start-up and here
        server.should_exit = True
    return server


async def _serve(server: _Server, tm: TokenizerManager, stop: _StopSignals, graceful_s: float) -> None:
    watchers = [asyncio.create_task(_exit_when_pipeline_dies(server, tm)),
                asyncio.create_task(_end_requests_when_stopping(server, tm, stop, graceful_s))]
    try:
        await server.serve()
    finally:
        for w in watchers:
            w.cancel()


async def _exit_when_pipeline_dies(server: _Server, tm: TokenizerManager) -> None:
    # The tokenizer manager has already failed every pending request; give the replies a moment to reach their
    # clients, then stop serving so a supervisor sees a non-zero exit and restarts us.
    await tm.died.wait()
    await asyncio.sleep(PIPELINE_DEATH_GRACE_S)
    server.should_exit = True


async def _end_requests_when_stopping(server: _Server, tm: TokenizerManager, stop: _StopSignals, graceful_s: float) -> None:
    # uvicorn stops accepting at once, then waits for the requests in flight: end them (503) at once after a
    # Ctrl-C, after a drain period otherwise, rather than have uvicorn cancel them.
    while not server.should_exit:
        await asyncio.sleep(0.1)
    deadline = time.monotonic() + (0 if stop.interrupted else graceful_s)
    while tm.num_running() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    tm.fail_requests("the server is shutting down")


def _exit_after_pipeline_death(reason: str) -> None:
    logger.error("exiting: %s", reason)
    # Everything is answered and stopped; skip the interpreter's teardown (torch and friends took ~1 s of it), so
    # a supervisor can restart us sooner: the whole path from a killed child to exit takes ~0.6 s.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
