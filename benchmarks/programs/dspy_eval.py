"""Unmodified DSPy evaluation and optimization under memory pressure (issue 26): ``dspy.Evaluate`` over a dev set and
a ``dspy.BootstrapFewShotWithRandomSearch`` run, through each route of ``dspy_agents`` to a server whose KV pool is
smaller than what the concurrent calls need.

The task is synthetic and seeded: each example's ``context`` is a long run of filler words with a few facts in it
("The code of Mira is tango."), its ``question`` asks for one of them, its ``answer`` is that code word; the metric is
exact match on the answer's last word. The program is plain DSPy: one ``dspy.Predict("context, question ->
answer")`` in a ``dspy.Module``.

* ``--workload evaluate``: the program compiled with ``dspy.LabeledFewShot(k=--demos)`` over a seeded trainset (so
  every call shares the long prefix of the instructions and demos, each demo with its own context), then
  ``dspy.Evaluate(devset=..., metric=..., num_threads=--threads)`` over ``--devset`` examples;
* ``--workload optimizer``: ``dspy.BootstrapFewShotWithRandomSearch(metric=..., max_bootstrapped_demos=--bootstrapped,
  max_labeled_demos=--demos, num_candidate_programs=--candidates, num_threads=--threads).compile(program,
  trainset=..., valset=...)``: DSPy's zero-shot, labeled-only and unshuffled candidates plus ``--candidates`` seeded
  ones, each bootstrapped on the trainset (the teacher runs one example at a time) and scored by ``Evaluate`` over
  the valset: many programs with different demo sets, i.e. different long prefixes, over one valset.

DSPy's caches are off (every call reaches the server). ``max_errors`` is raised (``--max-errors``) so that a route
whose replies do not parse finishes the run and its failures are counted rather than stopping it. Each route runs on
a fresh server with the same pool (``--pool-tokens``), routes in turn, the order rotating each round (see
``dspy_agents`` for the routes). A DSPy callback times every call of the program (one example: p50 / p99 / max) and
counts DSPy's LM calls and the program's exceptions.

Reported per route (medians over rounds): wall time, examples/s (program calls / wall time), per-example p50 / p99,
DSPy LM calls and server requests (the adapter's prefix hints included), the server's prompt / cached / computed
prompt tokens, KV loaded from the host tier, errors, the score (Evaluate's; the optimizer's best candidate's).

    python -m benchmarks.programs.dspy_eval --workload evaluate --out benchmarks/results/programs_dspy_evaluate_cpu.json
"""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
import time

from benchmarks.programs.dspy_agents import (ROUTES, WORDS, chosen_routes, make_lm, route_parser, run_route, run_rounds,
                                             words)

NAMES = ("Ada Boris Cleo Dmitri Elsa Farid Greta Hugo Ines Jonas Kira Lars Mira Nils Olga Pavel Quinn Rosa Sven Tara "
         "Ugo Vera Wim Xena Yuri Zoe").split()
SIGNATURE = "context, question -> answer"
WORKLOADS = ("evaluate", "optimizer")


# The task ----------------------------------------------------------------------------------------------------------
def make_example(dspy, rng: random.Random, context_words: int, facts: int):
    """One example: ``facts`` facts ("The code of <name> is <word>.") at random places in ``context_words`` filler
    words; the question asks for one of them, the answer is its code word."""
    names = rng.sample(NAMES, facts)
    codes = [rng.choice(WORDS) for _ in names]
    filler = words(rng, context_words).split()
    for name, code in zip(names, codes):
        filler.insert(rng.randrange(len(filler) + 1), f"The code of {name} is {code}.")
    k = rng.randrange(facts)
    return dspy.Example(context=" ".join(filler), question=f"What is the code of {names[k]}?",
                        answer=codes[k]).with_inputs("context", "question")


def make_dataset(dspy, n: int, seed: int, context_words: int = 120, facts: int = 4) -> list:
    """``n`` examples, the same for the same arguments."""
    if n < 1 or context_words < 1 or facts < 1:
        raise ValueError("a dataset needs n >= 1 examples, context_words >= 1 and facts >= 1")
    rng = random.Random(seed)
    return [make_example(dspy, rng, context_words, facts) for _ in range(n)]


def exact_match(example, prediction, trace=None) -> bool:
    """The metric: the predicted answer's last word is the code word (case and punctuation ignored), so "tango" and
    "The code of Zoe is tango." both match "tango"."""
    said = str(getattr(prediction, "answer", None) or "").split()
    return bool(said) and said[-1].strip(".,;:!?'\"`*()").lower() == example.answer.lower()


def make_program_class(dspy):
    class QA(dspy.Module):
        """A plain DSPy program: one Predict over the context and the question."""

        def __init__(self):
            super().__init__()
            self.answer = dspy.Predict(SIGNATURE)

        def forward(self, context: str, question: str):
            return self.answer(context=context, question=question)

    return QA


def few_shot_program(dspy, QA, trainset: list, demos: int):
    """The program the evaluate workload scores: ``LabeledFewShot(k=demos)`` over ``trainset`` (seeded sample)."""
    return dspy.LabeledFewShot(k=demos).compile(QA(), trainset=trainset)


# Timing every program call: a DSPy callback ---------------------------------------------------------------------
def make_recorder(dspy, program_class):
    from dspy.utils.callback import BaseCallback

    class Recorder(BaseCallback):
        """Times each call of a ``program_class`` module (the program; its own Predict is not timed), counts DSPy's
        LM calls and keeps the program calls' exceptions."""

        def __init__(self):
            self.lock = threading.Lock()
            self.started: dict[str, float] = {}
            self.times: list[float] = []
            self.errors: list[str] = []
            self.lm_calls = 0

        def on_module_start(self, call_id, instance, inputs):
            if isinstance(instance, program_class):
                with self.lock:
                    self.started[call_id] = time.perf_counter()

        def on_module_end(self, call_id, outputs, exception=None):
            with self.lock:
                t0 = self.started.pop(call_id, None)
                if t0 is None:
                    return
                self.times.append(time.perf_counter() - t0)
                if exception is not None:
                    self.errors.append(f"{type(exception).__name__}: {exception}"[:300])

        def on_lm_start(self, call_id, instance, inputs):
            with self.lock:
                self.lm_calls += 1

    return Recorder()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100]) of a non-empty list."""
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


# The workloads -----------------------------------------------------------------------------------------------------
def build_workload(dspy, QA, args):
    """The workload as a callable of no arguments returning ``(score, details)``, its data built (seeded) here."""
    kw = dict(context_words=args.context_words, facts=args.facts)
    trainset = make_dataset(dspy, args.trainset, args.seed * 1000 + 1, **kw)
    if args.workload == "evaluate":
        devset = make_dataset(dspy, args.devset, args.seed * 1000 + 2, **kw)
        program = few_shot_program(dspy, QA, trainset, args.demos)
        evaluate = dspy.Evaluate(devset=devset, metric=exact_match, num_threads=args.threads,
                                 max_errors=args.max_errors)

        def run():
            result = evaluate(program)
            return result.score, dict(examples=len(devset), demos=len(program.answer.demos))

        return run
    valset = make_dataset(dspy, args.valset, args.seed * 1000 + 3, **kw)
    optimizer = dspy.BootstrapFewShotWithRandomSearch(
        metric=exact_match, max_bootstrapped_demos=args.bootstrapped, max_labeled_demos=args.demos,
        num_candidate_programs=args.candidates, num_threads=args.threads, max_errors=args.max_errors)

    def run():
        best = optimizer.compile(QA(), trainset=trainset, valset=valset)
        candidates = [dict(seed=c["seed"], score=c["score"]) for c in best.candidate_programs]
        return max(c["score"] for c in candidates), dict(candidates=sorted(candidates, key=lambda c: c["seed"]),
                                                         best_demos=len(best.answer.demos))

    return run


def one_run(route: str, args, dspy, QA) -> dict:
    """The workload through one route on a fresh server; the figures of ``dspy_agents.run_route`` (its one "program"
    is the whole run) with the per-example figures in place of the program ones."""
    kind, flags = ROUTES[route]
    out: dict = {}

    def make_program(url: str, key: str, model_id: str):
        lm = make_lm(dspy, kind, url, key, model_id, args.max_tokens)
        recorder = make_recorder(dspy, QA)
        workload = build_workload(dspy, QA, args)
        out["recorder"] = recorder

        def call() -> None:
            with dspy.context(lm=lm, callbacks=[recorder]):
                out["score"], out["details"] = workload()

        return lambda i: call

    figures, _ = run_route(flags, args, 1, make_program, label="run")
    rec = out["recorder"]
    times = rec.times or [float("nan")]
    elapsed = figures["elapsed_s"]
    return dict(route=route, workload=args.workload, elapsed_s=elapsed, examples=len(rec.times),
                programs_per_s=len(rec.times) / elapsed, p50_s=statistics.median(times), p99_s=percentile(times, 99),
                max_s=max(times), score=out.get("score", float("nan")), details=out.get("details"),
                errors=rec.errors + figures["errors"], dspy_lm_calls=rec.lm_calls, lm_calls=figures["lm_calls"],
                prompt_tokens=figures["prompt_tokens"], cached_tokens=figures["cached_tokens"],
                computed_prompt_tokens=figures["computed_prompt_tokens"],
                hit_rate=figures["cached_tokens"] / max(1, figures["prompt_tokens"]),
                host_loaded_tokens=figures["host_loaded_tokens"])


SUMMARY_KEYS = ("elapsed_s", "programs_per_s", "p50_s", "p99_s", "max_s", "examples", "score", "dspy_lm_calls",
                "lm_calls", "prompt_tokens", "computed_prompt_tokens", "hit_rate", "host_loaded_tokens")


def add_ratios(summary: dict) -> None:
    """Adds each route's wall-time speedup over routes ``openai`` and ``sglang_radix_only`` (those present) and its
    p50 / throughput ratios against ``sglang_radix_only`` (``run_rounds`` gives them against ``openai``)."""
    for base in ("openai", "sglang_radix_only"):
        if base not in summary:
            continue
        b = summary[base]
        for s in summary.values():
            s[f"wall_speedup_over_{base}"] = b["elapsed_s"] / s["elapsed_s"]
            if base != "openai":
                s[f"p50_speedup_over_{base}"] = b["p50_s"] / s["p50_s"]
                s[f"throughput_over_{base}"] = s["programs_per_s"] / b["programs_per_s"]


def parse_args(argv: list[str] | None):
    ap = route_parser(__doc__, ROUTES)
    ap.add_argument("--workload", choices=WORKLOADS, default="evaluate")
    ap.add_argument("--devset", type=int, default=48, help="evaluate: dev set size")
    ap.add_argument("--trainset", type=int, default=8, help="the demos' source (optimizer: its trainset)")
    ap.add_argument("--valset", type=int, default=16, help="optimizer: the valset each candidate is scored on")
    ap.add_argument("--demos", type=int, default=4, help="labeled demos (evaluate: of the program; optimizer: "
                    "max_labeled_demos)")
    ap.add_argument("--bootstrapped", type=int, default=2, help="optimizer: max_bootstrapped_demos")
    ap.add_argument("--candidates", type=int, default=3, help="optimizer: num_candidate_programs (DSPy adds 3)")
    ap.add_argument("--threads", type=int, default=8, help="num_threads of Evaluate / the optimizer")
    ap.add_argument("--context-words", type=int, default=120, help="filler words in each example's context")
    ap.add_argument("--facts", type=int, default=4, help="facts in each example's context")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-errors", type=int, default=100000, help="DSPy's max_errors (high: failures are counted)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    routes = chosen_routes(ap, args, ROUTES)
    for name in ("devset", "trainset", "valset", "threads", "context_words", "facts", "max_tokens", "candidates",
                 "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.demos < 0 or args.bootstrapped < 0:
        ap.error("--demos and --bootstrapped must not be negative")
    if args.facts > len(NAMES):
        ap.error(f"--facts must be at most {len(NAMES)}")
    return args, routes


def main(argv: list[str] | None = None) -> int:
    args, routes = parse_args(argv)
    import dspy  # deferred: --help without DSPy

    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    QA = make_program_class(dspy)
    summary = run_rounds(routes, args, lambda route: one_run(route, args, dspy, QA), SUMMARY_KEYS)
    add_ratios(summary)
    print(json.dumps({r: {k: v for k, v in s.items() if k.startswith("wall_") or k.endswith("radix_only")}
                      for r, s in summary.items()}, indent=1))
    if args.out:  # run_rounds wrote it: the summary again, with the ratios added here
        with open(args.out) as f:
            result = json.load(f)
        result["summary"] = summary
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
