"""Command line: ``sglang-backend demo | serve | bench`` (also ``python -m sglang_backend``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from . import __version__
from .runtime.server_args import ServerArgs
from .utils import die_with_parent_if_requested


NEXT_STEPS = """\
Next steps:
  sglang-backend serve        # the same model behind an OpenAI-compatible server on http://127.0.0.1:30000
  curl http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "default", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32, "temperature": 0}'
  README.md: "The language" (the DSL), "DSPy", "LangChain and guidance"; `make test` runs the tests."""


def cmd_demo(args: argparse.Namespace) -> int:
    # The runtime imports torch and transformers (seconds): deferred so --help and --version stay instant.
    from .runtime.engine import Engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")  # an application
    print(f"loading {args.model_path or 'the embedded SmolLM2-135M-Instruct'} ...", flush=True)
    t0 = time.perf_counter()
    engine = Engine(**{k: v for k, v in vars(args).items() if k in ServerArgs.__dataclass_fields__})
    load_s = time.perf_counter() - t0
    try:
        questions = args.question or ["What is the capital of France?",
                                      "Give me one tip for writing clear code, in one sentence."]
        # The template writes the model's own special tokens (Gemma's <bos>): tokenized without adding more.
        prompts = [engine.tokenizer.encode(engine.apply_chat_template([{"role": "user", "content": q}]),
                                           add_special_tokens=False) for q in questions]
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        gen_s = time.perf_counter() - t0
        for q, o in zip(questions, outs):
            cut = o["meta_info"]["finish_reason"]["type"] == "length"
            print(f"Q: {q}\nA: {o['text'].strip()}{' [... cut at --max-new-tokens]' if cut else ''}\n")
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        print(f"model {engine.model_dir}: loaded in {load_s:.1f} s; {len(prompts)} answers, {tokens} tokens "
              f"in {gen_s:.2f} s ({tokens / gen_s:.1f} tokens/s)")
        # Ask again: the chat-template prefix and the questions are now in the radix cache.
        again = engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
        counts = [f"{o['meta_info']['cached_tokens']} of {o['meta_info']['prompt_tokens']}" for o in again]
        reused = counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + " and " + counts[-1]
        print(f"Asked again: {reused} prompt tokens came from the radix cache, so their KV was reused, not\n"
              f"recomputed (the last prompt token always runs: it predicts the first answer token).\n")
        print(NEXT_STEPS)
    finally:
        engine.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # Deferred: the runtime imports torch (see cmd_demo).
    from .runtime.entrypoints.http_server import launch_server

    if args.dp > 1:  # data parallelism needs the router (sglang-router), imported only here
        from .runtime.distributed.data_parallel import serve_dp

        return serve_dp(ServerArgs.from_cli_args(args), args.dp, args.router_policy)
    launch_server(ServerArgs.from_cli_args(args))
    return 0


def cmd_bench(argv: list[str]) -> int:
    """The benchmark suite (benchmarks/suite in the repo); its own parser handles --help."""
    try:  # benchmarks/ is a sibling of the package in a source checkout, not part of the installed package
        from benchmarks.suite.main import main as bench_main
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
        from benchmarks.suite.main import main as bench_main
    rows = bench_main(argv)
    return 1 if any(r["errors"] for r in rows) else 0


def version() -> str:
    """The installed distribution's version, else the package's own ``__version__`` (a source checkout)."""
    try:
        return dist_version("sglang-backend")
    except PackageNotFoundError:
        return __version__


def main(argv: list[str] | None = None) -> int:
    """Runs a command; Ctrl-C ends it with one line on stderr and status 130 (no traceback)."""
    die_with_parent_if_requested()  # SGLANG_BACKEND_DIE_WITH_PARENT=1: as early as possible (see utils)
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("sglang-backend: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="sglang-backend", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sglang-backend {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="Answer questions with the embedded SmolLM2 (or --model-path)")
    demo.add_argument("--question", action="append", help="A question (repeatable)")
    demo.add_argument("--max-new-tokens", type=int, default=160, help="Tokens per answer at most (default: 160)")
    demo.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default: 0.0, greedy)")
    ServerArgs.add_cli_args(demo)
    demo.set_defaults(func=cmd_demo, log_level="warning")  # a quiet demo; --log-level info shows the engine's log

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
