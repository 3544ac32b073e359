"""DSPy RAG pipeline throughput: ``SGLangLM`` vs DSPy's plain OpenAI-compatible route, same server, same run.

The program is examples/rag_pipeline's ``RAG`` (BM25 over the shipped corpus -> ``dspy.Predict``), run with
``batch(num_threads=T)`` over the example's questions, with DSPy's response cache off and the server's radix
cache flushed before every run. The two routes to the same ``sglang-backend serve``:

* ``sglang``: ``SGLangLM(base_url=...)`` - prefix hints for the shared system prompt (and demos), ChatAdapter
  sections / JSON outputs as decoding constraints (markers jump-forwarded);
* ``openai``: ``dspy.LM("openai/<model>", api_base=<server>/v1)`` - DSPy's own route to an OpenAI-compatible
  server: plain chat completions, nothing but the messages.

Same adapter (DSPy's default ChatAdapter unless ``--adapter json``), same max_tokens, greedy. Runs are
interleaved (sglang, openai, sglang, ...) ``--repeats`` times. Reported per route: programs/s (median over
repeats), LM calls, parse failures, and the server's cache hit rate over the run (``/get_stats`` delta).

    python -m benchmarks.bench_dspy_rag                       # starts its own server (embedded SmolLM2)
    python -m benchmarks.bench_dspy_rag --url http://127.0.0.1:30000 --api-key KEY
    python -m benchmarks.bench_dspy_rag --smoke               # CI: one short repeat
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import sys
import time

import httpx

from benchmarks.common import default_output, env_info, format_table, summarize, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "adapters", "dspy"))
NAME = "dspy_rag"


def load_example():
    spec = importlib.util.spec_from_file_location("rag_run", os.path.join(REPO, "examples", "rag_pipeline", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def server_stats(client: httpx.Client) -> dict:
    r = client.get("/get_stats")
    r.raise_for_status()
    return r.json()


def one_run(route: str, lm, rag, questions: list[str], threads: int, adapter, client: httpx.Client) -> dict:
    import dspy

    client.post("/flush_cache").raise_for_status()
    if hasattr(lm, "backend"):
        lm.backend.hints.clear()  # the cache was flushed: every prefix must be hinted again
    lm.history.clear()
    before = server_stats(client)
    examples = [dspy.Example(question=q).with_inputs("question") for q in questions]
    t0 = time.perf_counter()
    with dspy.context(lm=lm, adapter=adapter):
        outs = rag.batch(examples, num_threads=threads, max_errors=len(examples) + 1, provide_traceback=False,
                         disable_progress_bar=True)
    wall = time.perf_counter() - t0
    after = server_stats(client)
    d_prompt = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    d_cached = after["num_cached_tokens"] - before["num_cached_tokens"]
    failures = sum(1 for o in outs if o is None or not isinstance(getattr(o, "answer", None), str))
    return {"route": route, "wall_s": wall, "programs_per_s": len(questions) / wall, "lm_calls": len(lm.history),
            "parse_failures": failures, "server_prompt_tokens": d_prompt, "server_cached_tokens": d_cached,
            "server_cache_hit_rate": d_cached / d_prompt if d_prompt else None,
            "generated_tokens": after["num_generated_tokens"] - before["num_generated_tokens"],
            "jump_forward_tokens": after.get("num_jump_forward_tokens", 0) - before.get("num_jump_forward_tokens", 0)}


# Few-shot reuse (in-process engine) ------------------------------------------------------------------------------
def fewshot_run(lm, hints: bool, n: int = 32, threads: int = 8) -> dict:
    """A 4-demo few-shot Predict over ``n`` questions (ChatAdapter, 8 threads) on a flushed cache.

    ``runtime_hit_rate``: 1 - (prefill tokens the runtime computed for the run, hints included) / (the request
    set's prompt tokens), comparable with ``optimal_hit_rate`` over the same prompts. ``request_hit_rate``:
    what the calls themselves saw (lm.history usage)."""
    import dspy

    from sglang_backend.runtime.managers.schedule_policy import optimal_hit_rate
    from sglang_dspy import hit_rate_from_history

    lm = lm.copy(max_tokens=4, prefix_hints=hints)
    lm.flush_cache()
    p = dspy.Predict("question -> answer")
    p.demos = [dspy.Example(question=f"What is {a} plus {a}? Think about it and explain.", answer=str(2 * a))
               for a in (3, 5, 7, 9)]
    before = lm.get_stats()
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
        p.batch([dspy.Example(question=f"What is {i} plus {i}?").with_inputs("question") for i in range(n)],
                num_threads=threads, max_errors=n + 1, provide_traceback=False, disable_progress_bar=True)
    after = lm.get_stats()
    entries = lm.history[-n:]
    total = sum(e["usage"]["prompt_tokens"] for e in entries)
    computed = (after["num_prompt_tokens"] - before["num_prompt_tokens"]) - (
        after["num_cached_tokens"] - before["num_cached_tokens"])
    tok, rt = lm.runtime.tokenizer, lm.runtime
    prompts = [(None, tok.encode(rt.apply_chat_template(e["messages"]), add_special_tokens=False)) for e in entries]
    return {"hints": hints, "requests": len(entries), "prompt_tokens": total, "computed_tokens": computed,
            "runtime_hit_rate": 1 - computed / total, "request_hit_rate": hit_rate_from_history(entries),
            "optimal_hit_rate": optimal_hit_rate(prompts), "hints_sent": lm.hints_sent,
            "min_cached_tokens": min(e["usage"]["prompt_tokens_details"]["cached_tokens"] for e in entries),
            "prompt_lengths_match": [len(ids) for _, ids in prompts] == [e["usage"]["prompt_tokens"] for e in entries]}


def fewshot_section() -> list[dict]:
    """Plain vs hinted on the default runtime and on one without in-batch prefix dedup (the scheduler's own
    mechanism for concurrent shared prefixes), where only the radix cache and the hints remain."""
    from sglang_backend import Engine
    from sglang_dspy import SGLangLM

    rows = []
    for dedup in (True, False):
        runtime = Engine(log_level="warning", enable_in_batch_prefix_dedup=dedup)
        lm = SGLangLM(runtime=runtime, max_tokens=4, cache=False)
        for hints in (False, True):
            r = fewshot_run(lm, hints)
            r["in_batch_dedup"] = dedup
            rows.append(r)
            print(f"few-shot x32 dedup={dedup} hints={hints}: runtime hit {r['runtime_hit_rate']:.4f} "
                  f"(optimal {r['optimal_hit_rate']:.4f}), request-level {r['request_hit_rate']:.4f}",
                  file=sys.stderr)
        runtime.shutdown()
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_dspy_rag", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one with the embedded SmolLM2)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--threads", type=int, default=8, help="DSPy batch threads")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--questions", type=int, default=0, help="use the first N questions (0: all)")
    p.add_argument("--adapter", choices=("chat", "json"), default="chat")
    p.add_argument("--server-threads", type=int, default=None, help="OMP threads of the own server")
    p.add_argument("--smoke", action="store_true", help="one repeat over 3 questions with 8 tokens (CI)")
    p.add_argument("--no-fewshot", action="store_true", help="skip the few-shot reuse section (in-process engines)")
    p.add_argument("--output", default=None, help=f"JSON path (default benchmarks/results/{NAME}.json)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        args.repeats, args.questions, args.max_tokens, args.no_fewshot = 1, 3, 8, True
    import dspy

    from sglang_dspy import SGLangLM

    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    ex = load_example()
    own = None
    url, key = args.url, args.api_key
    if url is None:
        from benchmarks.bench_server_load import OwnServer

        key = key or secrets.token_hex(8)
        own = OwnServer([], args.server_threads, key)
        own.wait_ready()
        url = own.url
    try:
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=600)
        model_id = client.get("/v1/models").json()["data"][0]["id"]
        lms = {
            "sglang": SGLangLM(base_url=url, api_key=key, max_tokens=args.max_tokens, temperature=0.0, cache=False,
                               max_string_length=200),
            "openai": dspy.LM(f"openai/{model_id}", api_base=url + "/v1", api_key=key or "none",
                              max_tokens=args.max_tokens, temperature=0.0, cache=False, num_retries=0),
        }
        adapter = dspy.ChatAdapter() if args.adapter == "chat" else dspy.JSONAdapter()
        rag = ex.RAG(ex.BM25(ex.load_corpus()))
        questions = ex.QUESTIONS[: args.questions] if args.questions else list(ex.QUESTIONS)
        runs = []
        for rep in range(args.repeats):
            for route, lm in lms.items():
                r = one_run(route, lm, rag, questions, args.threads, adapter, client)
                r["repeat"] = rep
                runs.append(r)
                print(f"[{rep}] {route:6s} {r['programs_per_s']:.3f} programs/s  calls={r['lm_calls']} "
                      f"failures={r['parse_failures']} hit={r['server_cache_hit_rate']:.3f}", file=sys.stderr)
    finally:
        if own is not None:
            own.stop()
    summary = {}
    for route in lms:
        mine = [r for r in runs if r["route"] == route]
        summary[route] = {"programs_per_s": summarize([r["programs_per_s"] for r in mine]),
                          "parse_failures": [r["parse_failures"] for r in mine],
                          "lm_calls": [r["lm_calls"] for r in mine],
                          "server_cache_hit_rate": [r["server_cache_hit_rate"] for r in mine]}
    speedup = summary["sglang"]["programs_per_s"]["median"] / summary["openai"]["programs_per_s"]["median"]
    result = {"name": NAME, "env": env_info(), "config": {**vars(args), "url": url if args.url else "own server",
                                                           "num_questions": len(questions), "model": model_id},
              "runs": runs, "summary": summary, "speedup_sglang_over_openai": speedup,
              "fewshot_reuse": [] if args.no_fewshot else fewshot_section()}
    rows = [[route, s["programs_per_s"]["median"], sum(s["parse_failures"]), sum(s["lm_calls"]),
             sum(h for h in s["server_cache_hit_rate"] if h is not None) / len(s["server_cache_hit_rate"])]
            for route, s in summary.items()]
    print(format_table(["route", "programs/s (median)", "parse failures", "LM calls", "mean hit rate"], rows))
    print(f"SGLangLM / plain OpenAI route: {speedup:.2f}x")
    path = write_json(result, args.output or default_output(NAME + ("_smoke" if args.smoke else "")))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
