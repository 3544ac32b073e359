"""Loopback load test of the HTTP server: shared-prefix chat traffic at a fixed concurrency.

Workload: ``--num-groups`` groups of requests; every request of a group shares the group's system prompt
(about ``--system-words`` words, unique per group and per run) and asks its own short question. Requests of all
groups are interleaved in a seeded random order and sent as streaming ``/v1/chat/completions`` calls (greedy,
``ignore_eos``, exactly ``--output-len`` tokens each) by ``--concurrency`` concurrent clients.

Measured client-side from the streams:

* ``ttft_s``   time from sending a request to its first content chunk
* ``tpot_s``   (time of the last token chunk - time of the first) / (completion tokens - 1), per request
* ``e2e_s``    request latency
* throughput: completed requests / wall time, output tokens / wall time

and from the server: the radix-cache hit rate of this run (delta of ``/get_stats`` cached / prompt tokens) next
to the client's view (``usage.prompt_tokens_details.cached_tokens``). The cache is flushed before the run
(``--no-flush`` keeps it).

    python -m benchmarks.bench_server_load                                   # starts its own server (SmolLM2)
    python -m benchmarks.bench_server_load --url http://127.0.0.1:30000 --concurrency 32 --num-requests 256
    python -m benchmarks.bench_server_load --smoke                           # a few requests (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from benchmarks.common import default_output, env_info, format_table, progress, write_json

NAME = "server_load"
DEFAULTS = dict(concurrency=32, num_requests=128, num_groups=8, system_words=120, output_len=32)
SMOKE_DEFAULTS = dict(concurrency=4, num_requests=8, num_groups=2, system_words=20, output_len=4)
QUESTIONS = [
    "What is the main idea?", "Give one example.", "Summarize it in five words.", "What is a common mistake?",
    "Why does it matter?", "Name a related topic.", "What would you try first?", "Explain it to a child.",
    "What is the opposite?", "Give a short tip.", "What question should I ask next?", "List two facts.",
]
TOPICS = ["astronomy", "cooking", "chess", "gardening", "databases", "sailing", "music theory", "geology",
          "painting", "compilers", "birds", "economics", "architecture", "cycling", "poetry", "chemistry"]


# Workload ----------------------------------------------------------------------------------------------------------
def system_prompt(group: int, words: int, salt: str) -> str:
    topic = TOPICS[group % len(TOPICS)]
    head = f"[run {salt} group {group}] You are a helpful expert on {topic}. "
    body = (f"Answer questions about {topic} clearly and briefly, with concrete details, and never invent facts. "
            f"Keep answers focused on {topic}. ")
    text = head
    while len(text.split()) < words:
        text += body
    return " ".join(text.split()[:words])


def build_workload(num_requests: int, num_groups: int, system_words: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    salt = uuid.uuid4().hex[:8]  # fresh prompts every run: the cache starts cold for them even with --no-flush
    systems = [system_prompt(g, system_words, salt) for g in range(num_groups)]
    reqs = []
    for i in range(num_requests):
        g = i % num_groups
        q = QUESTIONS[(i // num_groups) % len(QUESTIONS)]
        reqs.append({"i": i, "group": g, "messages": [{"role": "system", "content": systems[g]},
                                                      {"role": "user", "content": f"Question {i}: {q}"}]})
    rng.shuffle(reqs)
    return reqs


# Client ------------------------------------------------------------------------------------------------------------
async def one_request(client, sem, req: dict, args, bar) -> dict:
    body = {"model": "default", "messages": req["messages"], "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with sem:
        t0 = time.perf_counter()
        token_times: list[float] = []
        usage = None
        error = None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[6:]
                        if payload == "[DONE]":
                            break
                        event = json.loads(payload)
                        if "error" in event:
                            error = str(event["error"])
                            break
                        if event.get("usage"):
                            usage = event["usage"]
                        for choice in event.get("choices", []):
                            if (choice.get("delta") or {}).get("content"):
                                token_times.append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
            error = f"{type(e).__name__}: {e}"
        t1 = time.perf_counter()
    bar.update(1)
    out = {"i": req["i"], "group": req["group"], "error": error, "e2e_s": t1 - t0}
    if error is None:
        completion = usage["completion_tokens"] if usage else len(token_times)
        out.update(
            ttft_s=(token_times[0] - t0) if token_times else None,
            tpot_s=((token_times[-1] - token_times[0]) / (completion - 1)) if len(token_times) > 1 and completion > 1 else None,
            completion_tokens=completion,
            prompt_tokens=usage["prompt_tokens"] if usage else None,
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") if usage else None,
        )
    return out


async def run_load(url: str, headers: dict, workload: list[dict], args) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as client:
        with progress(total=len(workload), desc=f"requests (c={args.concurrency})", disable=args.no_progress) as bar:
            t0 = time.perf_counter()
            results = await asyncio.gather(*[one_request(client, sem, r, args, bar) for r in workload])
            wall = time.perf_counter() - t0
    return results, wall


# Statistics ------------------------------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, Any]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}

    def pct(q: float) -> float:  # linear interpolation between closest ranks (numpy's default)
        pos = (len(vals) - 1) * q
        lo = int(pos)
        hi = min(lo + 1, len(vals) - 1)
        return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)

    return {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99), "mean": sum(vals) / len(vals), "n": len(vals)}


def summarize_run(results: list[dict], wall: float, before: dict, after: dict) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    d_prompt = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    d_cached = after["num_cached_tokens"] - before["num_cached_tokens"]
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "duration_s": wall,
        "req_per_s": len(ok) / wall,
        "output_tok_per_s": out_tokens / wall,
        "input_tok_per_s": prompt_tokens / wall,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_s": percentiles([r.get("ttft_s") for r in ok]),
        "tpot_s": percentiles([r.get("tpot_s") for r in ok]),
        "e2e_s": percentiles([r["e2e_s"] for r in ok]),
        "cache_hit_rate": d_cached / d_prompt if d_prompt else None,  # server: /get_stats delta over the run
        "client_cached_fraction": cached / prompt_tokens if prompt_tokens else None,  # usage.cached_tokens
        "server": {
            "prompt_tokens": d_prompt,
            "cached_tokens": d_cached,
            "generated_tokens": after["num_generated_tokens"] - before["num_generated_tokens"],
            "prefill_batches": after["num_prefill_batches"] - before["num_prefill_batches"],
            "decode_batches": after["num_decode_batches"] - before["num_decode_batches"],
            "forward_seconds": after["forward_seconds"] - before["forward_seconds"],
            "retractions": after["num_retractions"] - before["num_retractions"],
            "evicted_tokens": after["num_evicted_tokens"] - before["num_evicted_tokens"],
        },
    }


# Server ------------------------------------------------------------------------------------------------------------
class OwnServer:
    """``python -m sglang_backend.cli serve`` on a free loopback port; terminated (with its children) on exit."""

    def __init__(self, extra_args: list[str], threads: int | None, api_key: str, startup_timeout: float = 300):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sglang_backend.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--api-key", api_key, "--log-level", "warning", *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.startup_timeout = startup_timeout

    def wait_ready(self) -> float:
        import httpx

        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up; log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > self.startup_timeout:
                raise RuntimeError(f"server not healthy after {self.startup_timeout}s; log: {self.log.name}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# Main --------------------------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_server_load", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one with the embedded SmolLM2)")
    p.add_argument("--api-key", default=None, help="the server's API key (own server: a random one)")
    p.add_argument("--concurrency", type=int, default=None, help=f"concurrent clients (default {DEFAULTS['concurrency']})")
    p.add_argument("--num-requests", type=int, default=None, help=f"default {DEFAULTS['num_requests']}")
    p.add_argument("--num-groups", type=int, default=None, help=f"shared-system-prompt groups (default {DEFAULTS['num_groups']})")
    p.add_argument("--system-words", type=int, default=None, help=f"words per system prompt (default {DEFAULTS['system_words']})")
    p.add_argument("--output-len", type=int, default=None, help=f"tokens per answer (default {DEFAULTS['output_len']})")
    p.add_argument("--seed", type=int, default=0, help="request order RNG seed")
    p.add_argument("--timeout", type=float, default=600, help="per-request timeout, seconds")
    p.add_argument("--no-flush", action="store_true", help="do not flush the radix cache before the run")
    p.add_argument("--server-args", default="", help="extra flags for the own server, e.g. \"--schedule-policy fcfs\"")
    p.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the own server (on a small shared CPU, 1 avoids oversubscription)")
    p.add_argument("--smoke", action="store_true", help="8 requests, concurrency 4, 4 output tokens")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--output", default=None, help=f"JSON result path (default {default_output(NAME)})")
    args = p.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.smoke else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.output is None:
        args.output = default_output(NAME + ("_smoke" if args.smoke else ""))
    for key in ("concurrency", "num_requests", "num_groups", "output_len"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import httpx

    args = parse_args(argv)
    server = None
    startup_s = None
    api_key = args.api_key
    if args.url is None:
        api_key = api_key or f"bench-{uuid.uuid4().hex}"
        server = OwnServer(shlex.split(args.server_args), args.server_threads, api_key)
        print(f"starting a server on {server.url} (log: {server.log.name}) ...", file=sys.stderr)
    try:
        if server is not None:
            startup_s = server.wait_ready()
        url = (args.url or server.url).rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            info = c.get("/get_server_info").json()
            # Warm-up (first-call overheads), then optionally a cold cache.
            c.post("/generate", json={"text": "Warm up.", "sampling_params": {"max_new_tokens": 2}}).raise_for_status()
            if not args.no_flush:
                r = c.post("/flush_cache")
                if r.status_code != 200:
                    print(f"warning: flush_cache returned {r.status_code}; the cache stays warm", file=sys.stderr)
            before = c.get("/get_stats").json()
        workload = build_workload(args.num_requests, args.num_groups, args.system_words, args.seed)
        results, wall = asyncio.run(run_load(url, headers, workload, args))
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            after = c.get("/get_stats").json()
    finally:
        if server is not None:
            server.stop()

    summary = summarize_run(results, wall, before, after)
    result = {
        "name": NAME,
        "config": {k: getattr(args, k) for k in ("concurrency", "num_requests", "num_groups", "system_words",
                                                 "output_len", "seed", "smoke", "no_flush", "server_args",
                                                 "server_threads")}
                  | {"url": args.url or "own server", "server_startup_s": startup_s},
        "server_info": {k: info.get(k) for k in ("model_dir", "served_model_name", "device", "dtype", "context_len",
                                                 "max_total_num_tokens", "schedule_policy", "attention_backend",
                                                 "max_running_requests", "disable_radix_cache")},
        "env": env_info(),
        "results": summary,
        "requests": results,
    }
    path = write_json(result, args.output)
    print_summary(summary, args)
    rel = os.path.relpath(path)
    print(f"saved {path if rel.startswith('..') else rel}")
    return result


def print_summary(s: dict, args) -> None:
    def ms(d, key):
        return None if d[key] is None else d[key] * 1000

    print(f"\n{s['completed']}/{s['num_requests']} requests in {s['duration_s']:.1f}s at concurrency {args.concurrency}: "
          f"{s['req_per_s']:.2f} req/s, {s['output_tok_per_s']:.1f} output tok/s, {s['input_tok_per_s']:.1f} prompt tok/s")
    rows = [[name, ms(s[key], "p50"), ms(s[key], "p90"), ms(s[key], "p99"), ms(s[key], "mean")]
            for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s"))]
    print(format_table(["ms", "p50", "p90", "p99", "mean"], rows))
    hit = s["cache_hit_rate"]
    print(f"cache hit rate (server /get_stats): {hit:.1%}" if hit is not None else "cache hit rate: n/a",
          f"| client-reported cached fraction: {s['client_cached_fraction']:.1%}" if s["client_cached_fraction"] is not None else "")
    if s["failed"]:
        print(f"FAILED requests: {s['failed']}: {s['errors']}")


if __name__ == "__main__":
    main()
    sys.exit(0)
