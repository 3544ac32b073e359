"""Faults, overload and isolation on real servers (tiny dummy model, loopback):

* fault injection: a poisoned request in a running batch (NaN logits, or a forward that raises) fails alone with
  a 500 error body; every other request's output is identical to a clean run; pool whole, server healthy;
* a killed scheduler or detokenizer: clients get errors within 5 s, /health goes red, the server exits non-zero
  and leaves no zombie or orphan process;
* overload: past max_running + max_queued requests in flight, 503 with Retry-After; request timeouts give 504;
* request ids: one API key cannot abort another key's request, even knowing its rid.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from sglang_backend.runtime.managers.fault_injection import ENV_VAR

# Timing-sensitive: run in `make test`'s serial phase, not beside another xdist worker (pyproject markers).
pytestmark = pytest.mark.serial

KEY_A, KEY_B = "sk-reliability-a", "sk-reliability-b"
NAN_TOKEN, RAISE_TOKEN = 300, 301
PROMPTS = [[5 + i, 17, 29 + 3 * i, 41, 60 + i, 77] for i in range(8)]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


async def run_batch(server, prompts) -> list[httpx.Response]:
    async with server.async_client(timeout=60) as client:
        return await asyncio.gather(*[client.post("/generate", json={"input_ids": p, "sampling_params": GREEDY})
                                      for p in prompts])


@pytest.fixture(scope="module")
def fault_server(rel):
    """One server with both rules: prompts holding NAN_TOKEN get NaN logits, RAISE_TOKEN a raising forward."""
    rules = [{"mode": "nan", "token": NAN_TOKEN, "after": 3}, {"mode": "raise", "token": RAISE_TOKEN, "after": 3}]
    server = rel.start_server(env={ENV_VAR: json.dumps(rules)})
    yield server
    assert not server.stop(check=False)


@pytest.mark.parametrize("mode,token", [("nan", NAN_TOKEN), ("raise", RAISE_TOKEN)])
def test_fault_in_one_request_fails_only_that_request(rel, fault_server, mode, token):
    server = fault_server
    clean = asyncio.run(run_batch(server, PROMPTS))
    assert all(r.status_code == 200 for r in clean)
    poisoned = [p + [token] if i == 3 else p for i, p in enumerate(PROMPTS)]
    clean_others = [r.json()["output_ids"] for i, r in enumerate(clean) if i != 3]
    faulty = asyncio.run(run_batch(server, poisoned))
    bad = faulty[3]
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert ("non-finite" in err["message"]) if mode == "nan" else ("InjectedFault" in err["message"]), err
    assert "Traceback" not in bad.text
    others = [r for i, r in enumerate(faulty) if i != 3]
    assert all(r.status_code == 200 for r in others), [r.text for r in others]
    assert [r.json()["output_ids"] for r in others] == clean_others
    # A streaming poisoned request ends with an error event, not a broken connection.
    with httpx.stream("POST", server.url + "/generate", headers=server.headers, timeout=60,
                      json={"input_ids": poisoned[3], "sampling_params": GREEDY, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    rel.assert_healthy_and_whole(server)


@pytest.fixture(scope="module")
def limits_server(rel):
    server = rel.start_server("--max-running-requests", "2", "--max-queued-requests", "2", "--request-timeout", "3")
    yield server
    assert not server.stop(check=False)


def test_overload_gets_503_with_retry_after_and_timeouts_504(rel, limits_server):
    c, server = rel, limits_server
    long = {"max_new_tokens": 450, "temperature": 0, "ignore_eos": True}

    async def burst():
        async with server.async_client(timeout=30) as client:
            return await asyncio.gather(*[client.post("/generate", json={"input_ids": PROMPTS[i % 8],
                                                                          "sampling_params": long}) for i in range(12)])

    t0 = time.monotonic()
    results = asyncio.run(burst())
    codes = sorted(r.status_code for r in results)
    refused = [r for r in results if r.status_code == 503]
    assert len(refused) >= 8, codes  # 2 running + 2 queued at most
    assert all(r.headers.get("retry-after") for r in refused)
    assert all("overloaded" in r.json()["error"]["message"] for r in refused)
    # The admitted ones either finished or hit the 3 s timeout (504): nothing hangs.
    assert all(r.status_code in (200, 504) for r in results if r.status_code != 503), codes
    assert time.monotonic() - t0 < 20
    r = httpx.post(server.url + "/generate", headers=server.headers, timeout=30,
                   json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}})
    if r.status_code == 504:
        assert r.json()["error"]["type"] == "timeout_error"
    c.assert_healthy_and_whole(server)  # timed-out requests were aborted and their KV freed


# Last in the module: each kills the (module-scoped) server it uses.
@pytest.mark.parametrize("victim,server_fixture", [("scheduler", "fault_server"), ("detokenizer", "limits_server")])
def test_killed_pipeline_process(request, rel, victim, server_fixture):
    c = rel
    server = request.getfixturevalue(server_fixture)
    try:
        info = httpx.get(server.url + "/get_server_info", headers=server.headers, timeout=10).json()
        pid = info["pipeline_pids"][victim]
        children = c.descendants(server.proc.pid)
        long = {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}

        async def scenario():
            streaming = asyncio.Barrier(2)  # the stream has output (so both requests run) and the killer
            async with server.async_client(timeout=30) as client:
                async def non_stream(i):
                    r = await client.post("/generate", json={"input_ids": PROMPTS[i], "sampling_params": long})
                    return time.monotonic(), r.status_code, r.text

                async def stream(i):
                    async with client.stream("POST", "/generate", json={"input_ids": PROMPTS[i], "sampling_params": long,
                                                                        "stream": True}) as r:
                        last = None
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                if last is None:
                                    await streaming.wait()
                                last = line
                    return time.monotonic(), r.status_code, last

                # Two requests: the limits server runs at most two at once.
                tasks = [asyncio.create_task(non_stream(0)), asyncio.create_task(stream(1))]
                await asyncio.wait_for(streaming.wait(), 20)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                return killed_at, await asyncio.gather(*tasks)

        killed_at, results = asyncio.run(scenario())
        for done_at, status, body in results:
            assert done_at - killed_at < 5, f"a client waited {done_at - killed_at:.1f}s for its error"
            assert status == 503 or (status == 200 and body and '"error"' in body), (status, body)
        health = None
        try:
            health = httpx.get(server.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            pass  # already exited: also "not healthy"
        assert health != 200
        assert server.proc.wait(timeout=30) != 0, "the server must exit non-zero after losing a pipeline process"
        exited_after = time.monotonic() - killed_at  # an upper bound: measured after the clients' checks
        assert exited_after < 1.5, f"the server lived {exited_after:.2f} s after losing a pipeline process"
        def leftovers():  # children still present, alive or zombie (same pid and start time)
            table = c.proc_table()
            return [p for p, start in children.items() if p in table and table[p][2] == start]

        deadline = time.monotonic() + 15
        while leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not leftovers(), "pipeline processes (or their zombies) outlived the server"
    finally:
        server.stop(check=False)


def test_request_ids_are_scoped_per_api_key(rel_server):
    a = {"Authorization": f"Bearer {KEY_A}"}
    b = {"Authorization": f"Bearer {KEY_B}"}
    body = {"input_ids": PROMPTS[0], "stream": True,
            "sampling_params": {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}}

    async def while_running(rid: str, action):
        """Starts key A's stream named ``rid``; once it has output, runs ``action(client)``; returns that and the
        stream's final event."""
        async with httpx.AsyncClient(base_url=rel_server.url, timeout=60) as client:
            async with client.stream("POST", "/generate", json={**body, "rid": rid}, headers=a) as r:
                events, result = [], None
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        if result is None:
                            result = await action(client)
            return result, events[-1]

    async def intruder(client):
        # B knows A's rid: it can neither abort A's request nor is it blocked from using the same name itself.
        denied = await client.post("/abort_request", json={"rid": "shared-name"}, headers=b)
        own_b = await client.post("/generate", headers=b, json={"input_ids": PROMPTS[1], "rid": "shared-name",
                                                                "sampling_params": {"max_new_tokens": 2}})
        return denied, own_b

    (denied, own_b), last = asyncio.run(while_running("shared-name", intruder))
    assert denied.status_code == 404, denied.text
    assert own_b.status_code == 200 and own_b.json()["meta_info"]["id"] == "shared-name"
    assert last["meta_info"]["finish_reason"]["type"] == "length", "B's abort reached A's request"

    async def owner(client):  # the owner can abort its request by its own rid
        return await client.post("/abort_request", json={"rid": "mine"}, headers=a)

    ok, last = asyncio.run(while_running("mine", owner))
    assert ok.status_code == 200 and last["meta_info"]["finish_reason"]["type"] == "abort"


def test_session_ids_are_scoped_per_api_key(rel_server):
    """As request ids: B's session of the same name is its own (its request does not move A's pin), and B can
    neither end A's session nor learn that it exists."""
    a = {"Authorization": f"Bearer {KEY_A}"}
    b = {"Authorization": f"Bearer {KEY_B}"}
    greedy = {"max_new_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=rel_server.url, timeout=60) as client:
        for headers, prompt in ((a, PROMPTS[0]), (b, PROMPTS[1])):
            r = client.post("/generate", headers=headers,
                            json={"input_ids": prompt, "sampling_params": greedy, "session_id": "shared-s"})
            assert r.status_code == 200, r.text
        assert client.get("/get_stats", headers=a).json()["session_pinned_sessions"] >= 2  # two sessions, not one
        ended = [client.post("/end_session", headers=h, json={"session_id": "shared-s"}).json()["released"]
                 for h in (b, b, a, a)]
    assert ended == [True, False, True, False]  # each ends its own, once
