"""Does a hostile request slow down everyone else? (issue 21: grammar budgets, client templates)

A server this script starts (``sglang-backend serve``, default settings) answers one normal chat request (greedy,
``--output-len`` tokens, ``ignore_eos``) ``--rounds`` times alone and ``--rounds`` times while another client sends
hostile requests back to back, interleaved round by round. Hostile kinds:

* ``nested_defs``: the issue's 2.4 KB JSON schema of 15 nested ``$defs`` (two properties each pointing at the next
  level), with fresh property names every time so no cache helps; before the grammar budget it compiled for a
  long time and stalled every other request. Expected: 400 "grammar too complex" at once.
* ``client_template``: ``chat_template_kwargs.chat_template`` with two nested loops of 20,000 x 10,000 iterations.
  Expected: 400 at once (clients set template variables, not templates).
* ``heavy_grammar`` (informational): a legal schema (8 nested levels, ~7,400 DFA states, fresh names), costly to
  compile but within the budget; it is answered, and shows what a legitimately expensive grammar costs others.

Printed and saved: per kind, the hostile answers (status, median and max seconds) and the normal request's median
latency with and without it, as a ratio.

    python -m benchmarks.bench_hostile_latency            # embedded SmolLM2-135M
    python -m benchmarks.bench_hostile_latency --smoke    # tiny dummy model, 2 rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid

from benchmarks.common import default_output, env_info, format_table, progress, write_json

NAME = "hostile_latency"
HOSTILE_TEMPLATE = "{% for i in range(20000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}hi"


def nested_schema(levels: int, fresh: bool = True) -> dict:
    """The issue's schema: each level an object with two required properties pointing at the next level. ``fresh``:
    property names with a random tag, so no cache of a previous verdict or index helps."""
    tag = uuid.uuid4().hex[:8] if fresh else ""
    defs = {}
    for i in range(levels):
        nxt = {"$ref": f"#/$defs/d{i + 1}"} if i + 1 < levels else {"type": "string"}
        defs[f"d{i}"] = {"type": "object", "properties": {f"a{tag}": nxt, f"b{tag}": nxt},
                         "required": [f"a{tag}", f"b{tag}"]}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def hostile_body(kind: str) -> dict:
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    if kind == "nested_defs":
        return {**base, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": nested_schema(15)}}}
    if kind == "client_template":
        return {**base, "chat_template_kwargs": {"chat_template": HOSTILE_TEMPLATE}}
    if kind == "heavy_grammar":
        return {**base, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": nested_schema(8)}}}
    raise ValueError(kind)


def normal_request(client, url: str, output_len: int) -> float:
    body = {"messages": [{"role": "user", "content": "Tell me about lighthouses."}], "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    client.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - t0


def hostile_loop(client, url: str, kind: str, stop: threading.Event, answers: list) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        r = client.post(url + "/v1/chat/completions", json=hostile_body(kind), timeout=600)
        answers.append((r.status_code, time.perf_counter() - t0, r.json().get("error", {}).get("message", "")[:90]))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kinds", nargs="+", default=["nested_defs", "client_template", "heavy_grammar"])
    p.add_argument("--smoke", action="store_true", help="tiny dummy model, 2 rounds of 8 tokens")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)

    import httpx

    from benchmarks.bench_server_load import OwnServer

    model_path, tmp = args.model_path, None
    if args.smoke:
        from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

        tmp = tempfile.TemporaryDirectory()
        save_dummy_hf_model(dummy_config(), tmp.name, seed=0)
        model_path, args.rounds, args.output_len = tmp.name, 2, 8
    server = OwnServer(["--max-total-tokens", "4096"] + (["--model-path", model_path] if model_path else []),
                       threads=None, api_key="bench-key")
    result = {"name": NAME, "env": env_info(), "output_len": args.output_len, "rounds": args.rounds, "kinds": {}}
    try:
        print(f"server ready in {server.wait_ready():.1f}s", file=sys.stderr)
        headers = {"Authorization": "Bearer bench-key"}
        normal, attacker = httpx.Client(headers=headers), httpx.Client(headers=headers)
        normal_request(normal, server.url, 4)  # warm-up, untimed
        for kind in args.kinds:
            alone, attacked, answers = [], [], []
            for _ in progress(range(args.rounds), desc=f"{kind}: alone / attacked rounds"):
                alone.append(normal_request(normal, server.url, args.output_len))
                stop = threading.Event()
                t = threading.Thread(target=hostile_loop, args=(attacker, server.url, kind, stop, answers))
                t.start()
                time.sleep(0.05)  # the first hostile request is in preparation when the normal one arrives
                attacked.append(normal_request(normal, server.url, args.output_len))
                stop.set()
                t.join()
            secs = [a[1] for a in answers]
            result["kinds"][kind] = {
                "normal_alone_s_median": statistics.median(alone), "normal_attacked_s_median": statistics.median(attacked),
                "ratio": statistics.median(attacked) / statistics.median(alone), "alone_s": alone, "attacked_s": attacked,
                "hostile_requests": len(answers), "hostile_statuses": sorted({a[0] for a in answers}),
                "hostile_s_median": statistics.median(secs), "hostile_s_max": max(secs),
                "hostile_message": answers[0][2]}
    finally:
        server.stop()
        if tmp is not None:
            tmp.cleanup()
    rows = [[k, r["hostile_requests"], r["hostile_statuses"], f"{r['hostile_s_median']:.3f}", f"{r['hostile_s_max']:.3f}",
             f"{r['normal_alone_s_median']:.3f}", f"{r['normal_attacked_s_median']:.3f}", f"{r['ratio']:.2f}"]
            for k, r in result["kinds"].items()]
    print(format_table(["hostile kind", "sent", "status", "median s", "max s", "normal alone s", "normal attacked s",
                        "ratio"], rows))
    for k, r in result["kinds"].items():
        print(f"{k}: {r['hostile_message']}")
    path = write_json(result, args.output or default_output(NAME + ("_smoke" if args.smoke else "")))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
