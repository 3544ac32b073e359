"""The same request through ``sglang-backend serve`` and through the in-process ``Engine``, interleaved.

One greedy request (a chat prompt, ``--output-len`` tokens, ``ignore_eos``) is sent alternately to a server
this script starts (``python -m sglang_backend.cli serve``, default settings) and to an ``Engine`` built in
this process, ``--rounds`` times each; the cache is flushed before every request so both prefill the same
prompt. Decode speed is ``(completion tokens - 1) / (end - first token)`` from the stream (the server's SSE,
the engine's ``stream=True`` iterator), so the prefill and the HTTP round trip are not in it; the whole
request time is reported too.

Two phases: ``quiet`` (nothing else running) and ``loaded`` (``--load-procs`` busy-looping processes started
by this script keep every core busy). The ratio server / in-process is what should stay near 1.

    python -m benchmarks.bench_server_vs_engine                 # embedded SmolLM2, both phases
    python -m benchmarks.bench_server_vs_engine --smoke         # a tiny dummy model, 2 rounds (CI)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import default_output, env_info, format_table, progress, write_json

NAME = "server_vs_engine"
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _spin() -> None:
    while True:
        pass


class Load:
    """``n`` processes that each keep one core busy (a pure-Python loop) until stopped."""

    def __init__(self, n: int):
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_spin, daemon=True) for _ in range(n)]

    def __enter__(self):
        for p in self.procs:
            p.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()


def decode_rate(times: list[float], tokens: int) -> tuple[float, float]:
    """(decode tok/s after the first token, whole-request seconds) from chunk arrival times."""
    first, last = times[1], times[-1]
    return ((tokens - 1) / (last - first) if last > first else float("nan")), times[-1] - times[0]


def run_engine(engine, prompt: str, output_len: int) -> tuple[float, float]:
    engine.flush_cache()
    times, tokens = [time.perf_counter()], 0
    for piece in engine.generate(prompt, {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
                                 stream=True):
        times.append(time.perf_counter())
        tokens = piece["meta_info"]["completion_tokens"]
    return decode_rate(times, tokens)


def run_server(client, url: str, prompt: str, output_len: int) -> tuple[float, float]:
    client.post(url + "/flush_cache").raise_for_status()
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
    times, tokens = [time.perf_counter()], 0
    with client.stream("POST", url + "/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            times.append(time.perf_counter())
            tokens = json.loads(line[5:])["meta_info"]["completion_tokens"]
    return decode_rate(times, tokens)


def phase(name: str, engine, client, url: str, prompt: str, args) -> dict:
    rows = {"server": [], "engine": []}
    for _ in progress(range(args.rounds), desc=f"{name}: server/engine rounds"):
        for who in ("server", "engine"):  # interleaved, same minute
            rate, secs = (run_server(client, url, prompt, args.output_len) if who == "server"
                          else run_engine(engine, prompt, args.output_len))
            rows[who].append({"decode_tok_s": rate, "request_s": secs})
    out = {}
    for who, rs in rows.items():
        out[who] = {"decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rs),
                    "request_s_median": statistics.median(r["request_s"] for r in rs), "runs": rs}
    out["ratio_server_over_engine"] = out["server"]["decode_tok_s_median"] / out["engine"]["decode_tok_s_median"]
    # Per round too: each pair ran back to back, so a slow minute hits both.
    out["ratio_per_round"] = [s["decode_tok_s"] / e["decode_tok_s"] for s, e in zip(rows["server"], rows["engine"])]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--load-procs", type=int, default=os.cpu_count() or 2,
                   help="busy processes of the loaded phase (default: one per core)")
    p.add_argument("--phases", nargs="+", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    p.add_argument("--smoke", action="store_true", help="tiny dummy model, 2 rounds of 8 tokens")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)

    import httpx

    from benchmarks.bench_server_load import OwnServer
    from sglang_backend import Engine

    model_path = args.model_path
    tmp = None
    if args.smoke:
        from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

        tmp = tempfile.TemporaryDirectory()
        save_dummy_hf_model(dummy_config(), tmp.name, seed=0)
        model_path = tmp.name
        args.rounds, args.output_len, args.load_procs = 2, 8, 1
    common = ["--max-total-tokens", "4096"]
    server = OwnServer(common + (["--model-path", model_path] if model_path else []), threads=None,
                       api_key="bench-key")
    try:
        print(f"server ready in {server.wait_ready():.1f}s", file=sys.stderr)
        engine = Engine(model_path=model_path, max_total_tokens=4096, log_level="warning")
        prompt = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
        client = httpx.Client(headers={"Authorization": "Bearer bench-key"})
        run_server(client, server.url, prompt, 4), run_engine(engine, prompt, 4)  # warm-up, untimed
        result = {"name": NAME, "env": env_info(), "model": engine.model_dir, "output_len": args.output_len,
                  "rounds": args.rounds, "load_procs": args.load_procs, "phases": {}}
        for name in args.phases:
            if name == "loaded":
                with Load(args.load_procs):
                    result["phases"][name] = phase(name, engine, client, server.url, prompt, args)
            else:
                result["phases"][name] = phase(name, engine, client, server.url, prompt, args)
        engine.shutdown()
    finally:
        server.stop()
        if tmp is not None:
            tmp.cleanup()
    rows = [[name, f"{ph['server']['decode_tok_s_median']:.1f}", f"{ph['engine']['decode_tok_s_median']:.1f}",
             f"{ph['ratio_server_over_engine']:.2f}",
             " ".join(f"{r:.2f}" for r in ph["ratio_per_round"])] for name, ph in result["phases"].items()]
    print(format_table(["phase", "server tok/s", "in-process tok/s", "ratio", "ratio per round"], rows))
    path = write_json(result, args.output or default_output(NAME + ("_smoke" if args.smoke else "")))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
