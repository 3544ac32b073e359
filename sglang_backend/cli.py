"""Command line: ``sglang-backend demo | serve | bench``."""

from __future__ import annotations

import argparse
import sys
import time


def cmd_demo(args: argparse.Namespace) -> int:
    from .runtime.engine import Engine
    from .runtime.server_args import ServerArgs

    t0 = time.perf_counter()
    engine = Engine(**{k: v for k, v in vars(args).items() if k in ServerArgs.__dataclass_fields__})
    load_s = time.perf_counter() - t0
    questions = args.question or ["What is the capital of France?", "Give me one tip for writing clear code."]
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    gen_s = time.perf_counter() - t0
    for q, o in zip(questions, outs):
        print(f"Q: {q}\nA: {o['text'].strip()}\n")
    # Ask again: the chat-template prefix and the questions are now in the radix cache.
    again = engine.generate(prompts, params)
    stats = engine.get_stats()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    print(f"model: {engine.model_dir}")
    print(f"load {load_s:.1f}s | {len(prompts)} answers, {tokens} tokens in {gen_s:.2f}s "
          f"({tokens / gen_s:.1f} tok/s) | repeat cached tokens: "
          f"{[o['meta_info']['cached_tokens'] for o in again]} of {[o['meta_info']['prompt_tokens'] for o in again]} "
          f"| cache hit rate {stats['cache_hit_rate']:.0%}")
    engine.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .runtime.entrypoints.http_server import launch_server
    from .runtime.server_args import ServerArgs

    if args.dp > 1:
        from .runtime.distributed.data_parallel import serve_dp

        return serve_dp(ServerArgs.from_cli_args(args), args.dp, args.router_policy)
    launch_server(ServerArgs.from_cli_args(args))
    return 0


def cmd_bench(argv: list[str]) -> int:
    """The benchmark suite (benchmarks/suite in the repo); its own parser handles --help."""
    try:
        from benchmarks.suite.main import main as bench_main
    except ImportError:
        import os

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
        from benchmarks.suite.main import main as bench_main
    rows = bench_main(argv)
    return 1 if any(r["errors"] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    from .runtime.server_args import ServerArgs

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="sglang-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="Answer questions with the embedded SmolLM2 (or --model-path)")
    demo.add_argument("--question", action="append", help="A question (repeatable)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--temperature", type=float, default=0.0)
    ServerArgs.add_cli_args(demo)
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: embedded SmolLM2 on 127.0.0.1:30000)")
    ServerArgs.add_cli_args(serve)
    serve.add_argument("--dp", type=int, default=1, help="Data parallelism: N workers on ports port+1..port+N behind "
                       "sglang-router on --port (default: 1, no router)")
    serve.add_argument("--router-policy", default="cache_aware", help="sglang-router policy with --dp "
                       "(cache_aware, round_robin, random, power_of_two; default: cache_aware)")
    serve.set_defaults(func=cmd_serve)

    sub.add_parser("bench", help="LM-program benchmark suite: sglang-backend bench <workload...>|all [--smoke] "
                                 "(see sglang-backend bench --help)")

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
