"""Unmodified DSPy agents under memory pressure (issue 26): the same plain DSPy program through each route to a server
whose KV pool is too small for all the agents' histories.

The program (``Agent``) is ordinary DSPy code: ``steps`` calls of one ``dspy.Predict("task, history -> thought,
action")``, each followed by a tool that sleeps (a seeded draw from ``--tool-s``) and returns an observation that
the next call's ``history`` carries, so every call re-sends the agent's whole history. ``agents`` run at once, one
thread each, every agent with its own long task text. Routes, each on a fresh server with the same pool
(``--pool-tokens``), run in turn (order rotating each round):

* ``sglang``: ``SGLangLM(base_url=...)`` on a server with the host KV tier (``--kv-host-size``) and session pins on
  (the adapter sends the program's session id without user code): everything on;
* ``sglang_no_tier``: ``SGLangLM`` on a server without the tier (pins on): the tier's share;
* ``sglang_radix_only``: ``SGLangLM(auto_session=False)`` on a server with the radix cache alone: the KV of route
  ``openai``, with the adapter's output constraints (a model too small to follow DSPy's output format otherwise
  fails the program at its first unparsable reply);
* ``openai``: ``dspy.LM("openai/<model>", api_base=...)`` on a server with the radix cache alone (``--session-ttl 0``,
  no tier): DSPy's route to any OpenAI-compatible engine with prefix caching.

Reported per route (medians over rounds): program completion time p50 and max, all agents' wall time and programs/s,
LM calls, the server's prompt / cached / computed prompt tokens over the run, KV loaded from the host.

    python -m benchmarks.programs.dspy_agents --out benchmarks/results/programs_dspy_agents_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import threading
import time

import httpx

from benchmarks.common import rotated, variant_medians

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "adapters", "dspy"))  # sglang_dspy, as the tests import it

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu").split()
ROUTES = {  # name: (client, server flags); None: --host-tokens
    "sglang": ("sglang", ["--kv-host-size", None]),
    "sglang_no_tier": ("sglang", []),
    "sglang_radix_only": ("sglang_no_session", ["--session-ttl", "0"]),
    "openai": ("openai", ["--session-ttl", "0"]),
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_agent_class(dspy):
    class Agent(dspy.Module):
        """A plain DSPy agent loop: think and act, run the tool, append the observation, repeat."""

        def __init__(self):
            super().__init__()
            self.step = dspy.Predict("task, history -> thought, action")

        def forward(self, task: str, tool, steps: int):
            history = "(nothing yet)"
            for k in range(steps):
                out = self.step(task=task, history=history)
                history = ("" if k == 0 else history + "\n") + \
                    f"Step {k + 1}: {out.thought} Action: {out.action}\nObservation: {tool(k)}"
            return dspy.Prediction(history=history)

    return Agent


def server_stats(client: httpx.Client) -> dict:
    return client.get("/get_stats").json()


def run_route(flags: list, args, n: int, make_program, label: str = "agent") -> tuple[dict, list[float]]:
    """On a fresh server with the pool ``args.pool_tokens`` plus ``flags`` (``None``: ``args.host_tokens``), ``n``
    programs at once, one thread each. ``make_program(url, key, model_id)`` returns ``program(i)``, which prepares
    program ``i`` and returns it as a callable of no arguments (the part that is timed). Returns the figures (times,
    the server's token counts over the run) and the sorted program times."""
    from benchmarks.bench_server_load import OwnServer  # deferred: only when a server is started here

    extra = [str(args.host_tokens) if a is None else a for a in flags]
    key = secrets.token_hex(8)
    server = OwnServer(["--max-total-tokens", str(args.pool_tokens), *extra], args.server_threads, key)
    try:
        server.wait_ready()
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
        model_id = client.get("/v1/models").json()["data"][0]["id"]
        program = make_program(server.url, key, model_id)
        before = server_stats(client)
        times, errors = [], []

        def run_one(i: int) -> None:
            call = program(i)
            t0 = time.perf_counter()
            try:
                call()
            except Exception as e:  # noqa: BLE001 - a failed program is reported, the others go on
                errors.append(f"{label} {i}: {type(e).__name__}: {e}"[:300])
            times.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run_one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        after = server_stats(client)
    finally:
        server.stop()
    prompt = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    cached = after["num_cached_tokens"] - before["num_cached_tokens"]
    times.sort()
    return dict(elapsed_s=elapsed, programs_per_s=n / elapsed, p50_s=statistics.median(times), max_s=times[-1],
                errors=errors, lm_calls=after["num_finished"] - before["num_finished"], prompt_tokens=prompt,
                cached_tokens=cached, computed_prompt_tokens=prompt - cached,
                host_loaded_tokens=after.get("kv_host_loaded_tokens", 0)), times


def make_lm(dspy, kind: str, url: str, key: str, model_id: str, max_tokens: int):
    """The route's LM: ``SGLangLM`` (``kind`` "sglang": with sessions, "sglang_no_session": without) or
    ``dspy.LM("openai/<model>")`` on the server's /v1; temperature 0, no cache."""
    from sglang_dspy import SGLangLM

    common = dict(api_key=key, max_tokens=max_tokens, temperature=0.0, cache=False)
    if kind.startswith("sglang"):
        return SGLangLM(base_url=url, auto_session=kind == "sglang", **common)
    return dspy.LM(f"openai/{model_id}", api_base=url + "/v1", num_retries=0, **common)


def one_run(route: str, args, dspy, Agent) -> dict:
    """One route on a fresh server: all agents at once; returns times and the server's token counts."""
    kind, flags = ROUTES[route]

    def make_program(url: str, key: str, model_id: str):
        lm = make_lm(dspy, kind, url, key, model_id, args.max_tokens)

        def program(i: int):
            rng = random.Random(1000 + i)
            task = f"Agent {i}. Task: {words(rng, args.task_words)}"

            def tool(k: int) -> str:
                time.sleep(rng.uniform(*args.tool_s))
                return words(rng, args.obs_words)

            def call() -> None:
                with dspy.context(lm=lm):
                    Agent()(task=task, tool=tool, steps=args.steps)

            return call

        return program

    figures, _ = run_route(flags, args, args.agents, make_program)
    return dict(route=route, **figures)


SUMMARY_KEYS = ("p50_s", "max_s", "elapsed_s", "programs_per_s", "lm_calls", "prompt_tokens", "computed_prompt_tokens",
                "host_loaded_tokens")


def route_parser(doc: str, routes: dict) -> argparse.ArgumentParser:
    """The arguments every program benchmark takes: each server's pool and host tier, routes, rounds, threads, out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-tokens", type=int, default=2048, help="each server's KV pool: smaller than the programs' "
                    "histories")
    ap.add_argument("--host-tokens", type=int, default=32768, help="the host tier of the sglang route")
    ap.add_argument("--routes", default=",".join(routes), help="comma-separated: " + ", ".join(routes))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--server-threads", type=int, default=None, help="OMP threads of each server")
    ap.add_argument("--out", default=None)
    return ap


def add_agent_args(ap: argparse.ArgumentParser, max_tokens: int, task_words: int = 300) -> None:
    """An agent program's shape: its task text, each tool observation, each reply, each tool's sleep."""
    ap.add_argument("--task-words", type=int, default=task_words)
    ap.add_argument("--obs-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--tool-s", type=float, nargs=2, default=(0.2, 0.6), metavar=("MIN", "MAX"))


def chosen_routes(ap: argparse.ArgumentParser, args, routes: dict) -> list[str]:
    chosen = [r.strip() for r in args.routes.split(",") if r.strip()]
    if not chosen or any(r not in routes for r in chosen):
        ap.error(f"routes must be among {list(routes)}")
    return chosen


def run_rounds(routes: list[str], args, one_route, summary_keys: tuple[str, ...], base: str = "openai") -> dict:
    """``args.rounds`` interleaved rounds of ``one_route(route)`` (order rotating each round): prints each run, then
    the per-route medians (against ``base``), and writes all to ``args.out``."""
    runs = []
    for rnd in range(args.rounds):
        for route in rotated(routes, rnd):
            runs.append(dict(round=rnd, **one_route(route)))
            r = runs[-1]
            print(f"round {rnd} {route:15s}: p50 {r['p50_s']:.1f} s, max {r['max_s']:.1f} s, {r['programs_per_s']:.3f} "
                  f"programs/s, {r['lm_calls']} calls, prompt {r['prompt_tokens']} computed "
                  f"{r['computed_prompt_tokens']} from host {r['host_loaded_tokens']}, errors {len(r['errors'])}",
                  flush=True)
    summary = variant_medians(runs, "route", routes, summary_keys, base, "p50_s", "programs_per_s")
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), runs=runs, summary=summary), f, indent=1)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = route_parser(__doc__, ROUTES)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    add_agent_args(ap, max_tokens=48)
    args = ap.parse_args(argv)
    routes = chosen_routes(ap, args, ROUTES)
    import dspy  # deferred: --help without DSPy

    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    Agent = make_agent_class(dspy)
    run_rounds(routes, args, lambda route: one_run(route, args, dspy, Agent), SUMMARY_KEYS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
