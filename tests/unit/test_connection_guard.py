"""connection_guard on a real uvicorn (in a thread, a toy ASGI app, no model): header and body read timeouts,
keep-alive and long replies untouched, the drain's 503 on kept-alive connections. The same on the real server:
tests/reliability/test_slow_clients.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from sglang_backend.runtime.entrypoints.connection_guard import DrainingMiddleware, guarded_h11_protocol

# Timing-sensitive: run in `make test`'s serial phase, not beside another xdist worker (pyproject markers).
pytestmark = pytest.mark.serial

HEADER_S, BODY_S, IDLE_S = 0.6, 1.2, 0.6
SLACK_S = 1.0


async def toy_app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    path = scope["path"]

    async def reply(status, obj, headers=()):
        body = json.dumps(obj).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})

    if path == "/noread":  # answers before reading the body (as a 401 or a 415 does)
        return await reply(401, {"error": "no"})
    if path == "/stream":  # a reply much longer than every timeout
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(8):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            await asyncio.sleep(0.3)
        return await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    if path == "/sleep":
        await asyncio.sleep(float(scope["query_string"] or b"1"))
        return await reply(200, {"slept": True})
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            from starlette.requests import ClientDisconnect

            raise ClientDisconnect()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await reply(200, {"len": len(body), "port": scope["client"][1]})


class ToyServer:
    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        protocol = guarded_h11_protocol(HEADER_S, BODY_S, IDLE_S)
        app = DrainingMiddleware(toy_app, is_draining=lambda: self.server.should_exit, retry_after=3)
        self.server = uvicorn.Server(uvicorn.Config(app, http=protocol, log_level="warning", timeout_keep_alive=30,
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture
def toy():
    server = ToyServer()
    yield server
    server.stop()


def raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and when it closed (seconds from now)."""
    t0 = time.monotonic()
    s.settimeout(limit_s)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, socket.timeout):
        pytest.fail(f"still open after {limit_s} s; got {data!r}")
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


def dribble(s: socket.socket, pieces: list[bytes], interval_s: float) -> bytes:
    """Sends ``pieces`` one every ``interval_s`` (while listening); returns what came back before the server
    closed the connection (or the pieces ran out)."""
    s.settimeout(interval_s)
    data = b""
    for piece in pieces:
        try:
            s.sendall(piece)
            chunk = s.recv(65536)
            data += chunk
            if not chunk:
                break
        except (TimeoutError, socket.timeout):
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    return data


def parse(data: bytes) -> tuple[int, dict, bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower().decode(): v.strip().decode() for k, v in (line.split(b":", 1) for line in lines[1:])}
    return status, headers, body


def test_silent_connection_is_closed_without_a_reply(toy):
    s = raw(toy.port)
    data, took = read_until_closed(s, HEADER_S + SLACK_S)
    assert data == b"" and took >= HEADER_S - 0.1


def test_slow_headers_get_408_and_are_closed(toy):
    s = raw(toy.port)
    t0 = time.monotonic()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
    # one header line every 0.25 s: each byte resets nothing
    data = dribble(s, [b"X-A: 1\r\n", b"X-B: 2\r\n", b"X-C: 3\r\n", b"X-D: 4\r\n", b"X-E: 5\r\n", b"X-F: 6\r\n"], 0.25)
    rest, _ = read_until_closed(s, HEADER_S + SLACK_S)
    data += rest
    took = time.monotonic() - t0
    status, headers, body = parse(data)
    assert status == 408 and headers["connection"] == "close", data
    assert json.loads(body)["error"]["code"] == 408 and "headers" in json.loads(body)["error"]["message"]
    assert HEADER_S - 0.1 <= took <= HEADER_S + SLACK_S


@pytest.mark.parametrize("how", ["stall", "trickle"])
def test_slow_body_gets_408_json_and_is_closed(toy, how):
    s = raw(toy.port)
    t0 = time.monotonic()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    data = b""
    if how == "trickle":  # a byte every 0.2 s: never idle for IDLE_S, but the whole body takes 20 s
        data = dribble(s, [b" "] * int((BODY_S + SLACK_S) / 0.2), 0.2)
    rest, _ = read_until_closed(s, BODY_S + SLACK_S)
    data += rest
    took = time.monotonic() - t0
    status, headers, body = parse(data)
    err = json.loads(body)["error"]
    assert status == 408 and headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 408
    limit = IDLE_S if how == "stall" else BODY_S
    assert ("arrived for" if how == "stall" else "within") in err["message"], err
    assert limit - 0.1 <= took <= limit + SLACK_S, took


def test_unread_body_does_not_hold_the_connection(toy):
    # The app answered (401) without reading; the client trickles the body on: closed at the body timeout.
    s = raw(toy.port)
    s.sendall(b"POST /noread HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab")
    t0 = time.monotonic()
    data = dribble(s, [b"x"] * int((BODY_S + SLACK_S) / 0.2), 0.2)
    rest, _ = read_until_closed(s, BODY_S + SLACK_S)
    assert parse(data + rest)[0] == 401
    assert time.monotonic() - t0 <= BODY_S + SLACK_S


def test_keep_alive_and_long_replies_are_untouched(toy):
    with httpx.Client(base_url=toy.url, timeout=10) as client:
        first = client.post("/echo", content=b"x" * 300_000).json()
        assert first["len"] == 300_000
        time.sleep(HEADER_S + IDLE_S + 0.3)  # idle on a kept-alive connection: not a slow header
        r = client.post("/echo", content=b"abc")
        assert r.status_code == 200 and r.json() == {"len": 3, "port": first["port"]}
        t0 = time.monotonic()
        with client.stream("GET", "/stream") as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 9
        assert time.monotonic() - t0 > BODY_S + HEADER_S  # the stream outlived every timeout
        r = client.post("/echo", content=b"yy")
        assert r.json() == {"len": 2, "port": first["port"]}  # the same connection throughout
    # a body sent fast in many small pieces is fine however long it is
    s = raw(toy.port)
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n")
    for _ in range(40):
        s.sendall(b"z")
        time.sleep(0.02)
    status, _, body = parse(s.recv(65536))
    assert status == 200 and json.loads(body)["len"] == 40


def test_drain_answers_503_on_kept_alive_connections(toy):
    with httpx.Client(base_url=toy.url, timeout=10) as keep, httpx.Client(base_url=toy.url, timeout=10) as other:
        assert keep.post("/echo", content=b"1").status_code == 200  # the connection is open and idle
        result = {}
        long = threading.Thread(target=lambda: result.setdefault("r", other.get("/sleep?2")))
        long.start()
        time.sleep(0.3)
        toy.server.should_exit = True  # what SIGTERM does
        time.sleep(0.4)  # uvicorn's shutdown has run: the listener is closed
        t0 = time.monotonic()
        r = keep.post("/echo", content=b"2")
        assert time.monotonic() - t0 < 1
        assert r.status_code == 503 and r.headers["retry-after"] == "3" and r.headers["connection"] == "close"
        assert r.json()["error"]["message"] == "the server is shutting down; retry later"
        with pytest.raises(httpx.ConnectError):  # new connections are refused
            httpx.get(toy.url + "/echo", timeout=2)
        long.join(timeout=10)
        assert result["r"].status_code == 200  # the request in flight finished
    toy.thread.join(timeout=5)
    assert not toy.thread.is_alive()  # and the server stopped once it had


def test_drain_closes_idle_connections_when_nothing_is_in_flight(toy):
    with httpx.Client(base_url=toy.url, timeout=10) as keep:
        assert keep.post("/echo", content=b"1").status_code == 200
        t0 = time.monotonic()
        toy.server.should_exit = True
        toy.thread.join(timeout=5)
        assert not toy.thread.is_alive() and time.monotonic() - t0 < 1.5
