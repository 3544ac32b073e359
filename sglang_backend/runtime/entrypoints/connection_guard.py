"""Connection-level defences of the HTTP server (uvicorn, h11): read timeouts for slow clients, and the drain
after SIGTERM.

* ``guarded_h11_protocol(...)``: uvicorn's ``H11Protocol`` with read timeouts. uvicorn itself has only a
  keep-alive timeout, and even that is cancelled by the first byte of a next request, so a client that sends
  its headers or its body a byte at a time holds a connection for ever (slowloris). Here:

  - headers: a request's complete headers must arrive within ``header_read_timeout`` seconds of the
    connection's opening, or of the first byte of a next request on a kept-alive connection (an idle
    kept-alive connection is uvicorn's keep-alive timeout's business). Then: 408 if the client sent part of a
    request, else a plain close.
  - body: the whole body must arrive within ``body_read_timeout`` seconds of the headers, and never stall for
    ``body_idle_timeout`` seconds. Then: 408 with a JSON error body (the server's error format) if no reply
    has started (the application then sees a disconnect), and the connection is closed either way. This holds
    also for a body the application never reads (a 401/413/415 answered before the body came).

  Once a request's body is in, nothing is timed: replies (SSE streams included) take as long as they take.

* Drain: ``H11Protocol.shutdown`` (uvicorn's graceful shutdown) closes idle kept-alive connections at once, so a
  client's next request on one fails with a reset. Here such connections stay open while requests are in
  flight; a request on one meets ``DrainingMiddleware``: 503 + Retry-After + ``Connection: close``, never run.
  They are closed as soon as no request is in flight (uvicorn's shutdown waits for open connections).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

import h11
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1


def error_json(message: str, status: int, err_type: str) -> bytes:
    """The body ``http_server.error_response`` sends (same JSON, same rendering as Starlette's JSONResponse)."""
    return json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}},
                      ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _fmt(seconds: float) -> str:
    return f"{seconds:g} s"


class GuardedH11Protocol(H11Protocol):
    """Set the class attributes with ``guarded_h11_protocol`` (uvicorn builds one protocol per connection)."""

    header_read_timeout: float = 10.0
    body_read_timeout: float = 30.0
    body_idle_timeout: float = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._guard_timer = None  # asyncio.TimerHandle of the read phase below
        self._phase: str | None = None  # "headers", "body" or None (nothing is being read under a deadline)
        self._deadline = 0.0  # headers: when they must be complete
        self._body_start = 0.0
        self._last_read = 0.0
        self._drain_timer = None

    # uvicorn's hooks --------------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow(activity=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow(activity=False)

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            # Idle: kept open while other requests are in flight, so a request sent on it now gets a 503 with
            # Retry-After (DrainingMiddleware) rather than a reset connection.
            self._hold_while_draining()
        else:
            super().shutdown()  # busy: closed after its reply

    # The read deadlines -----------------------------------------------------------------------------------------
    def _follow(self, activity: bool) -> None:
        """Puts the deadlines in step with h11's view of the client after bytes came in or a reply ended."""
        if self.transport is None or self.transport.is_closing():
            self._stop_timer()
            return
        theirs = self.conn.their_state
        if theirs is h11.IDLE:  # waiting for (the rest of) a request's headers
            if self._phase != "headers":
                if activity or self.conn.trailing_data[0]:  # a next request has begun
                    self._start_headers()
                else:  # an idle kept-alive connection: uvicorn's keep-alive timer
                    self._stop_timer()
        elif theirs is h11.SEND_BODY:
            now = time.monotonic()
            if self._phase != "body":
                self._stop_timer()
                self._phase, self._body_start, self._last_read = "body", now, now
                self._arm(min(self.body_read_timeout, self.body_idle_timeout))
            elif activity:
                self._last_read = now  # the timer checks this when it fires
        else:  # the request is in (or the connection is done with): nothing is timed
            self._stop_timer()

    def _start_headers(self) -> None:
        self._stop_timer()
        self._phase = "headers"
        self._deadline = time.monotonic() + self.header_read_timeout
        self._arm(self.header_read_timeout)

    def _arm(self, delay: float) -> None:
        self._guard_timer = self.loop.call_later(max(delay, 0.0), self._on_timer)

    def _stop_timer(self) -> None:
        if self._guard_timer is not None:
            self._guard_timer.cancel()
            self._guard_timer = None
        self._phase = None

    def _on_timer(self) -> None:
        self._guard_timer = None
        if self.transport.is_closing():
            return
        now = time.monotonic()
        if self._phase == "headers":
            if self.conn.their_state is not h11.IDLE:  # they completed meanwhile (not seen by _follow)
                return self._follow(activity=False)
            if now < self._deadline:
                return self._arm(self._deadline - now)
            return self._headers_timed_out()
        if self._phase == "body":
            if self.conn.their_state is not h11.SEND_BODY:
                return self._follow(activity=False)
            if self.flow.read_paused:  # we stopped reading (the application has not taken what came): not a stall
                self._last_read = now
            total_end = self._body_start + self.body_read_timeout
            idle_end = self._last_read + self.body_idle_timeout
            if now < min(total_end, idle_end):
                return self._arm(min(total_end, idle_end) - now)
            if now >= total_end:
                message = f"the request body did not arrive within {_fmt(self.body_read_timeout)}"
            else:
                message = f"no bytes of the request body arrived for {_fmt(self.body_idle_timeout)}"
            return self._body_timed_out(message)

    def _headers_timed_out(self) -> None:
        self._phase = None
        client = "%s:%d" % self.client if self.client else "?"
        if self.conn.trailing_data[0].strip() and self.conn.our_state is h11.IDLE:  # part of a request came: say why
            logger.debug("%s: request headers not complete within %s: 408", client, _fmt(self.header_read_timeout))
            self._write_408(f"the request headers did not arrive within {_fmt(self.header_read_timeout)}")
        self._close()

    def _body_timed_out(self, message: str) -> None:
        self._phase = None
        client = "%s:%d" % self.client if self.client else "?"
        logger.debug("%s: %s", client, message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            # The application is still waiting for the body: we answer, it sees a disconnect (and anything it
            # sends from now on is dropped).
            cycle.disconnected = True
            cycle.message_event.set()
            self._write_408(message)
        self._close()

    def _write_408(self, message: str) -> None:
        body = error_json(message, 408, "timeout_error")
        headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        try:
            out = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            out += self.conn.send(h11.Data(data=body))
            out += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # h11 cannot answer in this state: just close
            return
        self.transport.write(out)

    def _close(self) -> None:
        self._stop_timer()
        if not self.transport.is_closing():
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    # The drain --------------------------------------------------------------------------------------------------
    def _hold_while_draining(self) -> None:
        self._drain_timer = None
        if self.transport.is_closing():
            return
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.server_state.tasks and not self.conn.trailing_data[0]:
            return H11Protocol.shutdown(self)  # nothing in flight any more: close now
        if not idle:  # a request came on it during the drain: closed after its reply (Connection: close)
            self.cycle.keep_alive = False
            return
        self._drain_timer = self.loop.call_later(DRAIN_POLL_S, self._hold_while_draining)


def guarded_h11_protocol(header_read_timeout: float, body_read_timeout: float,
                         body_idle_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``, with these timeouts (seconds)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_read_timeout": float(header_read_timeout), "body_read_timeout": float(body_read_timeout),
        "body_idle_timeout": float(body_idle_timeout)})


class DrainingMiddleware:
    """While the server is stopping (``is_draining()``): every new request gets 503 + Retry-After + ``Connection:
    close`` and a JSON error ("the server is shutting down") without being started. Requests already running
    are not touched.

    Also: a client that went away (or was cut off by a body read timeout) while its body was being read makes
    the route raise Starlette's ``ClientDisconnect``; there is nobody to answer, so it ends here quietly rather
    than as an "internal error" with two tracebacks in the log."""

    def __init__(self, app, is_draining: Callable[[], bool], retry_after: int = 1):
        self.app = app
        self.is_draining = is_draining
        self.retry_after = retry_after

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.is_draining():
            body = error_json("the server is shutting down; retry later", 503, "server_error")
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(self.retry_after).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            logger.debug("client disconnected before its request body was read: %s", scope.get("path"))
