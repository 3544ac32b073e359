"""Aborts: a storm of streaming requests with a third of the clients hanging up mid-stream, explicit
POST /abort_request for running requests, and client disconnects on non-streaming requests. Afterwards every
surviving request has finished normally, the KV pool is whole and the server healthy."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid

import httpx
import pytest

NUM_REQUESTS = 200
CONCURRENCY = 48
OUTPUT_LEN = 16  # completed requests: exactly this many tokens (ignore_eos)
DISCONNECT_OUTPUT_LEN = 256  # hung-up requests ask for more, so only an abort (not a finish) can end them early
TOPICS = ["the sea", "mountains", "a robot", "coffee", "the moon", "trains", "a garden", "winter"]


def storm_plan(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    plan = []
    for i in range(NUM_REQUESTS):
        disconnect = i % 3 == 1
        kind = ("generate", "chat", "completions")[i % 3 if not disconnect else rng.randrange(3)]
        prompt = f"Request {i}: write a short line about {TOPICS[i % len(TOPICS)]}."
        plan.append({"i": i, "kind": kind, "prompt": prompt, "disconnect": disconnect,
                     "after_chunks": 1 + i % 2, "rid": f"storm-{uuid.uuid4().hex}"})
    return plan


def request_for(item: dict) -> tuple[str, dict]:
    n = DISCONNECT_OUTPUT_LEN if item["disconnect"] else OUTPUT_LEN
    common = {"ignore_eos": True, "temperature": 0}
    if item["kind"] == "generate":
        return "/generate", {"text": item["prompt"], "rid": item["rid"], "stream": True,
                             "sampling_params": {"max_new_tokens": n, **common}}
    if item["kind"] == "chat":
        return "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": item["prompt"]}],
                                        "max_tokens": n, "stream": True, "rid": item["rid"], **common}
    return "/v1/completions", {"model": "default", "prompt": item["prompt"], "max_tokens": n, "stream": True, **common}


async def run_one(client: httpx.AsyncClient, sem: asyncio.Semaphore, item: dict) -> dict:
    path, body = request_for(item)
    async with sem:
        events, done = [], False
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                assert line.startswith("data: "), line
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    break
                events.append(json.loads(payload))
                if item["disconnect"] and len(events) >= item["after_chunks"]:
                    break  # leaving the block closes the connection mid-stream
        return {**item, "events": events, "done": done}


def check_completed(res: dict) -> None:
    events = res["events"]
    assert res["done"], f"stream {res['i']} ended without [DONE]"
    assert not any("error" in e for e in events), events[-1]
    if res["kind"] == "generate":
        last = events[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": OUTPUT_LEN}
        assert len(last["output_ids"]) == OUTPUT_LEN and last["meta_info"]["completion_tokens"] == OUTPUT_LEN
        assert last["meta_info"]["id"] == res["rid"]
        assert "".join(e["text"] for e in events)
    else:
        reasons = [c["finish_reason"] for e in events for c in e["choices"]]
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1]), reasons
        key = "delta" if res["kind"] == "chat" else None
        text = "".join((c["delta"].get("content") or "") if key else c["text"] for e in events for c in e["choices"])
        assert text


def test_abort_storm(server):
    plan = storm_plan()
    n_disconnect = sum(p["disconnect"] for p in plan)
    before = server.wait_idle()

    async def storm():
        sem = asyncio.Semaphore(CONCURRENCY)
        async with server.async_client(timeout=180, max_connections=CONCURRENCY + 8) as client:
            return await asyncio.gather(*[run_one(client, sem, item) for item in plan])

    t0 = time.monotonic()
    results = asyncio.run(storm())
    elapsed = time.monotonic() - t0
    completed = [r for r in results if not r["disconnect"]]
    assert len(completed) == NUM_REQUESTS - n_disconnect >= 130
    for res in completed:
        check_completed(res)
    for res in results:
        if res["disconnect"]:
            assert not res["done"] and len(res["events"]) == res["after_chunks"]

    after = server.wait_idle(timeout=60)
    # Every hung-up request was aborted (none ran on to its 256 tokens), and every other one finished.
    assert after["num_aborted"] - before["num_aborted"] == n_disconnect, (before, after)
    assert after["num_generated_tokens"] - before["num_generated_tokens"] < (
        len(completed) * OUTPUT_LEN + n_disconnect * DISCONNECT_OUTPUT_LEN // 4)
    server.assert_pool_whole()
    with server.client() as c:
        assert c.get("/health").status_code == 200
        ok = c.post("/generate", json={"text": "Still alive?", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] >= 1
        load = c.get("/get_load").json()[0]
        assert load["num_reqs"] == 0 and load["num_tokens"] == 0
    print(f"abort storm: {NUM_REQUESTS} requests ({n_disconnect} hung up) in {elapsed:.1f}s")


def _start_stream(server, path: str, body: dict):
    """Opens a streaming request and reads its first event; returns (client, response, stream context, lines)."""
    client = server.client(timeout=120)
    ctx = client.stream("POST", path, json=body)
    r = ctx.__enter__()
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    first = next(line for line in lines if line.strip())
    return client, ctx, lines, json.loads(first[len("data: "):])


def _rest(lines) -> list:
    out = []
    for line in lines:
        if line.strip():
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize("kind", ["generate", "chat", "completions"])
def test_abort_request_ends_running_stream(server, http, kind):
    """POST /abort_request {"rid"} ends a running streaming request with finish_reason abort."""
    rid = f"abort-{kind}-{uuid.uuid4().hex}"
    long = {"ignore_eos": True, "temperature": 0}
    if kind == "generate":
        path, body = "/generate", {"text": "Count to a thousand:", "rid": rid, "stream": True,
                                   "sampling_params": {"max_new_tokens": 4000, **long}}
    elif kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to a thousand."}],
                                              "max_tokens": 4000, "stream": True, "rid": rid, **long}
    else:  # BUG (reported): /v1/completions ignores the rid field, so its requests cannot be aborted by id
        path, body = "/v1/completions", {"prompt": "Count to a thousand:", "max_tokens": 4000, "stream": True,
                                         "rid": rid, **long}
    client, ctx, lines, first = _start_stream(server, path, body)
    try:
        r = http.post("/abort_request", json={"rid": rid})
        assert r.status_code == 200 and r.json() == {"success": True}, r.text
        rest = _rest(lines)
    finally:
        ctx.__exit__(None, None, None)
        client.close()
    assert rest[-1] == "[DONE]"
    final = rest[-2]
    if kind == "generate":
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert final["meta_info"]["completion_tokens"] < 4000
    else:
        assert final["choices"][0]["finish_reason"] == "abort"
    # the rid is gone now
    assert http.post("/abort_request", json={"rid": rid}).status_code == 404


def test_abort_request_ends_non_streaming_request(server, http):
    rid = f"abort-blocking-{uuid.uuid4().hex}"
    result = {}

    def blocking():
        with server.client() as c:
            result["r"] = c.post("/generate", json={"text": "Count:", "rid": rid,
                                                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})

    t = threading.Thread(target=blocking)
    t.start()
    deadline = time.monotonic() + 30
    while http.get("/get_load").json()[0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    time.sleep(0.3)  # let it decode a few tokens
    assert http.post("/abort_request", json={"rid": rid}).json() == {"success": True}
    t.join(60)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 1 <= out["meta_info"]["completion_tokens"] < 4000
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"]


def test_abort_one_prompt_of_a_batch(server, http):
    """Aborting one prompt of a running batch ends only that one."""
    rids = [f"batch-{i}-{uuid.uuid4().hex}" for i in range(3)]
    result = {}

    def blocking():
        with server.client() as c:
            result["r"] = c.post("/generate", json={
                "text": ["Alpha:", "Beta:", "Gamma:"], "rid": rids,
                "sampling_params": [{"max_new_tokens": 12, "ignore_eos": True},
                                    {"max_new_tokens": 4000, "ignore_eos": True},
                                    {"max_new_tokens": 12, "ignore_eos": True}]})

    t = threading.Thread(target=blocking)
    t.start()
    deadline = time.monotonic() + 30
    while http.get("/get_load").json()[0]["num_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert http.post("/abort_request", json={"rid": rids[1]}).status_code == 200
    t.join(60)
    outs = result["r"].json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length", "abort", "length"]
    assert outs[0]["meta_info"]["completion_tokens"] == 12 == outs[2]["meta_info"]["completion_tokens"]


def test_client_disconnect_aborts_non_streaming_request(server, http):
    """A non-streaming client that hangs up must not leave its generation running to the end.

    BUG (reported): the auth middleware is a Starlette BaseHTTPMiddleware, behind which
    request.is_disconnected() never turns true, so run_to_end never notices the hang-up."""
    rid = f"hangup-{uuid.uuid4().hex}"
    before = server.wait_idle()
    try:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/generate", json={"text": "Count:", "rid": rid,
                                         "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}, timeout=1.5)
        deadline = time.monotonic() + 5  # the server polls for disconnects every 0.5 s
        while True:
            stats = server.stats()
            if stats["num_aborted"] > before["num_aborted"] and stats["num_running"] == 0:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the request kept running after its client hung up: {stats['num_running']} running")
            time.sleep(0.2)
    finally:
        http.post("/abort_request", json={"rid": rid})
