"""Soak: 2,000 mixed requests at concurrency 64 against one server (tiny dummy model): native and OpenAI routes,
streaming and not, regex-constrained, and 20% aborted at random points (stream hang-ups after a random number of
chunks, non-streaming clients that give up after a random delay).

Every request that was not aborted is answered with exactly its own prompt's reference output (computed one by
one beforehand; greedy decoding), so a duplicate, a lost request or cross-talk between requests fails the test.
A hung-up stream's partial text must be a prefix of its reference. Afterwards the KV pool is whole (conftest) and
the server's memory (all its processes) has not grown by more than MAX_RSS_GROWTH_MIB.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

NUM_REQUESTS = 2000
CONCURRENCY = 64
ABORT_FRACTION = 0.2
NUM_PROMPTS = 24
OUT_LEN = 12
REGEX = "[a-z]{2,6}( [a-z]{2,6}){1,3}"
MAX_RSS_GROWTH_MIB = 150
KINDS = ("gen", "gen_stream", "comp", "comp_stream", "gen_regex")


def prompts() -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 30))] for _ in range(NUM_PROMPTS)]


def sampling(kind: str) -> dict:
    sp = {"max_new_tokens": OUT_LEN, "temperature": 0, "ignore_eos": True}
    return {**sp, "regex": REGEX, "ignore_eos": False} if kind == "gen_regex" else sp


def request_for(kind: str, ids: list[int]) -> tuple[str, dict]:
    if kind.startswith("comp"):
        return "/v1/completions", {"model": "default", "prompt": ids, "max_tokens": OUT_LEN, "temperature": 0,
                                   "ignore_eos": True, "stream": kind == "comp_stream"}
    return "/generate", {"input_ids": ids, "sampling_params": sampling(kind), "stream": kind == "gen_stream"}


def text_of(kind: str, payload: dict) -> str:
    return payload["choices"][0]["text"] if kind.startswith("comp") else payload["text"]


async def run_one(client: httpx.AsyncClient, kind: str, ids: list[int], abort_after: float | None,
                  abort_chunks: int | None) -> dict:
    path, body = request_for(kind, ids)
    if body.get("stream"):
        pieces, done, error = [], False, None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "body": (await r.aread())[:300]}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                pieces.append(text_of(kind, event))
                if abort_chunks is not None and len(pieces) >= abort_chunks:
                    break  # hang up mid-stream
        return {"status": 200, "text": "".join(pieces), "done": done, "error": error}
    try:
        r = await asyncio.wait_for(client.post(path, json=body), abort_after)
    except asyncio.TimeoutError:
        return {"status": None, "gave_up": True}
    if r.status_code != 200:
        return {"status": r.status_code, "body": r.text[:300]}
    payload = r.json()
    return {"status": 200, "text": text_of(kind, payload), "ids": payload.get("output_ids"), "done": True}


def test_soak(rel_server, rel):
    ps = prompts()
    headers = rel_server.headers
    # References, one request at a time (also the warm-up before the memory baseline).
    refs: dict[tuple[str, int], dict] = {}
    with httpx.Client(base_url=rel_server.url, headers=headers, timeout=60) as c:
        for i, ids in enumerate(ps):
            for grammar in ("gen", "gen_regex"):
                r = c.post("/generate", json={"input_ids": ids, "sampling_params": sampling(grammar)})
                assert r.status_code == 200, r.text
                refs[(grammar, i)] = {"text": r.json()["text"], "ids": r.json()["output_ids"]}
    rss_before = rel.rss_kib(rel.server_pids(rel_server))

    rng = random.Random(2024)
    plan = []
    for n in range(NUM_REQUESTS):
        kind = KINDS[n % len(KINDS)]
        aborted = rng.random() < ABORT_FRACTION
        plan.append((n, kind, rng.randrange(NUM_PROMPTS), aborted and rng.uniform(0.0, 0.3),
                     (1 + rng.randrange(OUT_LEN)) if aborted else None))

    async def soak():
        sem = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=rel_server.url, headers=headers, timeout=120, limits=limits) as client:
            async def one(item):
                n, kind, p, abort_after, abort_chunks = item
                async with sem:
                    return item, await run_one(client, kind, ps[p], abort_after if abort_after is not False else None,
                                               abort_chunks if kind.endswith("stream") else None)
            return await asyncio.gather(*[one(item) for item in plan])

    t0 = time.monotonic()
    results = asyncio.run(soak())
    elapsed = time.monotonic() - t0
    rel.assert_healthy_and_whole(rel_server)
    rss_after = rel.rss_kib(rel.server_pids(rel_server))

    failures: dict[str, list] = {"wrong_output": [], "http_error": [], "error_event": [], "incomplete": []}
    counts = {"answered": 0, "aborted": 0, "aborted_but_completed": 0}
    for (n, kind, p, abort_after, abort_chunks), res in results:
        ref = refs[("gen_regex" if kind == "gen_regex" else "gen", p)]
        aborted = abort_after is not False
        if res.get("gave_up"):
            counts["aborted"] += 1
            continue
        if res["status"] != 200:
            failures["http_error"].append((n, kind, res))
            continue
        if res.get("error"):
            failures["error_event"].append((n, kind, res["error"]))
            continue
        if not res["done"]:  # a stream we hung up on: what arrived must be the start of this prompt's answer
            counts["aborted"] += 1
            if not ref["text"].startswith(res["text"]):
                failures["wrong_output"].append((n, kind, p, res["text"], ref["text"]))
            continue
        counts["aborted_but_completed" if aborted else "answered"] += 1
        if res["text"] != ref["text"] or (res.get("ids") is not None and res["ids"] != ref["ids"]):
            failures["wrong_output"].append((n, kind, p, res["text"], ref["text"]))
    print(f"\nsoak: {NUM_REQUESTS} requests at concurrency {CONCURRENCY} in {elapsed:.1f}s; {counts}; "
          f"failures by kind {{{', '.join(f'{k}: {len(v)}' for k, v in failures.items())}}}; "
          f"server RSS {rss_before / 1024:.1f} MiB before, {rss_after / 1024:.1f} MiB after")
    assert not any(failures.values()), {k: v[:3] for k, v in failures.items() if v}
    assert counts["answered"] + counts["aborted"] + counts["aborted_but_completed"] == NUM_REQUESTS
    assert counts["aborted"] >= NUM_REQUESTS * ABORT_FRACTION / 3, counts  # the aborts really happened mid-flight
    assert (rss_after - rss_before) / 1024 < MAX_RSS_GROWTH_MIB
