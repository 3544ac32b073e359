"""Data parallelism through the real sglang-router (PyPI ``sglang-router``, Rust) on loopback.

``sglang-backend serve --dp 2`` starts two tiny-model workers and the router with its cache_aware policy; a
second router with the round_robin policy is put in front of the same two workers. The same shared-prefix
workload (4 prompt groups, shuffled) runs through each router, caches flushed in between: the first request
of every group at once, then the others one at a time so each worker's /get_stats tells which worker served
which request. Then, with concurrent
requests running through the cache_aware router, one worker is SIGKILLed: the rest of the workload must
be served by the other.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest

from sglang_backend.runtime.distributed.data_parallel import router_argv
from sglang_backend.utils import pdeathsig_preexec

from tests.integration.conftest import REPO_ROOT, descendants, free_port, still_alive

GROUPS = 4
PER_GROUP = 5
STARTUP_TIMEOUT_S = 240
WORDS = ("alpha beta gamma delta river stone cloud forest paper window silver orange market garden planet "
         "music engine rocket bridge castle").split()


def prompts() -> list[tuple[int, str]]:
    """(group, prompt): each group's long shared document + a short question; groups interleaved at random."""
    rng = random.Random(0)
    docs = [f"Document {g}: " + " ".join(rng.choice(WORDS) for _ in range(60)) for g in range(GROUPS)]
    items = [(g, f"{docs[g]} Question {i}: what is item {i}?") for g in range(GROUPS) for i in range(PER_GROUP)]
    rng.shuffle(items)
    return items


def wait_for(check, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            result = check()
            if result:
                return result
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout}s")
        time.sleep(0.5)


def healthy_workers(router_url: str) -> list[str]:
    workers = httpx.get(router_url + "/workers", timeout=5).json()["workers"]
    return sorted(w["url"] for w in workers if w["is_healthy"])


def port_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode().split("\0")
    except OSError:
        return None
    if "serve" in args and "--port" in args:
        return int(args[args.index("--port") + 1])
    return None


def served(worker_urls: list[str]) -> list[int]:
    return [httpx.get(u + "/get_stats", timeout=10).json()["num_prompt_tokens"] for u in worker_urls]


def generate(router_url: str, text: str, max_new_tokens: int) -> dict:
    r = httpx.post(router_url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def run_workload(router_url: str, worker_urls: list[str]) -> dict:
    """Each group's first request all at once (a new prefix goes to the least loaded worker, so the groups
    spread), then the other requests one at a time, each attributed to the worker whose counters moved."""
    for u in worker_urls:
        assert httpx.post(u + "/flush_cache", timeout=30).status_code == 200
    items = prompts()
    firsts = {g: text for g, text in reversed(items)}  # each group's first request in the shuffled order
    rest = [(g, text) for g, text in items if text != firsts[g]]
    with concurrent.futures.ThreadPoolExecutor(GROUPS) as pool:
        metas = list(pool.map(lambda text: generate(router_url, text, 16), firsts.values()))
    where: dict[int, list[int]] = {g: [] for g in range(GROUPS)}
    before = served(worker_urls)
    for g, text in rest:
        metas.append(generate(router_url, text, 1))
        after = served(worker_urls)
        grew = [i for i in range(len(worker_urls)) if after[i] > before[i]]
        assert len(grew) == 1, (before, after)
        where[g].append(grew[0])
        before = after
    majority = sum(max(ws.count(w) for w in set(ws)) for ws in where.values())
    return {"affinity": majority / len(rest), "placement": where,
            "hit_rate": sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)}


@pytest.fixture(scope="module")
def dp_cluster(tiny_gqa_dir, tmp_path_factory):
    """``serve --dp 2`` (router: cache_aware) + a round_robin router over the same workers."""
    log_dir = tmp_path_factory.mktemp("dp")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               SGLANG_BACKEND_DIE_WITH_PARENT="1")
    cmd = [sys.executable, "-m", "sglang_backend.cli", "serve", "--model-path", tiny_gqa_dir, "--dp", "2",
           "--port", str(port), "--log-level", "warning", "--max-total-tokens", "8192"]
    procs, seen = [], {}
    with open(log_dir / "dp.log", "w") as log:
        dp = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    procs.append(dp)
    router_url = f"http://127.0.0.1:{port}"
    try:
        workers = wait_for(lambda: len(healthy_workers(router_url)) == 2 and healthy_workers(router_url),
                           STARTUP_TIMEOUT_S, "serve --dp 2", dp)
        seen.update(descendants(dp.pid))
        rr_port = free_port()
        with open(log_dir / "rr.log", "w") as log:
            rr = subprocess.Popen(router_argv(workers, "127.0.0.1", rr_port, "round_robin", free_port(), "warning"),
                                  stdout=log, stderr=subprocess.STDOUT, preexec_fn=pdeathsig_preexec())
        procs.append(rr)
        rr_url = f"http://127.0.0.1:{rr_port}"
        wait_for(lambda: len(healthy_workers(rr_url)) == 2, 60, "round_robin router", rr)
        pids = {port_of(p): p for p in seen}
        yield {"cache_aware": router_url, "round_robin": rr_url, "workers": workers,
               "worker_pids": [pids[int(u.rsplit(":", 1)[1])] for u in workers]}
    finally:
        for p in procs:
            seen.update(descendants(p.pid))
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=45)
            except subprocess.TimeoutExpired:
                p.kill()
        deadline = time.monotonic() + 15
        while still_alive(seen) and time.monotonic() < deadline:
            time.sleep(0.25)
        orphans = still_alive(seen)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        assert not orphans, f"serve --dp left processes behind: {orphans}"


def test_cache_aware_routing_and_failover(dp_cluster):
    workers = dp_cluster["workers"]
    # What the router asks a worker for at registration, and a feature it may forward that we lack.
    for path in ("/server_info", "/model_info", "/get_load", "/v1/loads"):
        assert httpx.get(workers[0] + path, timeout=10).status_code == 200, path
    r = httpx.post(workers[0] + "/generate", json={"text": "x", "return_hidden_states": True}, timeout=10)
    assert r.status_code == 400 and "return_hidden_states" in r.json()["error"]["message"]
    t0 = time.monotonic()
    rr = run_workload(dp_cluster["round_robin"], workers)
    ca = run_workload(dp_cluster["cache_aware"], workers)
    print(f"\nround_robin: group affinity {rr['affinity']:.2f}, hit rate {rr['hit_rate']:.3f}, placement {rr['placement']}"
          f"\ncache_aware: group affinity {ca['affinity']:.2f}, hit rate {ca['hit_rate']:.3f}, placement {ca['placement']}")
    print(f"both workloads: {time.monotonic() - t0:.1f}s")
    t0 = time.monotonic()
    assert ca["affinity"] >= 0.9
    assert ca["hit_rate"] > rr["hit_rate"]
    assert len({ws[0] for ws in ca["placement"].values()}) == 2  # the groups are spread over both workers

    # Fail-over: 40 requests, 4 at a time, through the cache_aware router; worker 1 is killed after 10.
    survivor = workers[0]
    items = prompts() * 2

    def one(text):
        try:
            r = httpx.post(dp_cluster["cache_aware"] + "/generate",
                           json={"text": text, "sampling_params": {"max_new_tokens": 2}}, timeout=120)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = [pool.submit(one, text) for _, text in items[:10]]
        concurrent.futures.wait(first)
        before = httpx.get(survivor + "/get_stats", timeout=10).json()["num_finished"]
        os.kill(dp_cluster["worker_pids"][1], signal.SIGKILL)
        rest = [pool.submit(one, text) for _, text in items[10:]]
        results_rest = [f.result() for f in rest]
    results_first = [f.result() for f in first]
    ok, failed = sum(results_first + results_rest), (len(items) - sum(results_first + results_rest))
    after = httpx.get(survivor + "/get_stats", timeout=10).json()["num_finished"]
    print(f"fail-over: {ok} succeeded, {failed} failed of {len(items)} (worker 1 killed after the first 10); "
          f"the survivor finished {after - before} of the {len(rest)} sent after the kill; "
          f"router's healthy workers now {healthy_workers(dp_cluster['cache_aware'])}")
    print(f"fail-over phase: {time.monotonic() - t0:.1f}s")
    assert all(results_first)
    assert sum(results_rest) >= len(rest) - 4  # at most the requests in flight at the kill may fail
    assert after - before >= sum(results_rest)  # the survivor served the rest
    whole = wait_for(lambda: httpx.get(survivor + "/check_pool", timeout=10).json()["whole"], 60, "survivor idle")
    assert whole
