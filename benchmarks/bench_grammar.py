"""Grammar engines side by side (issue 25): cold compile time and per-token mask time, ours vs llguidance.

    python -m benchmarks.bench_grammar [--walks 3] [--steps 48] [--out FILE]
    PYTHONPATH=DIR python -m benchmarks.bench_grammar   # DIR holding xgrammar 0.2.8 adds it as a third column

Corpus: every JSON schema and regex of the project's constrained-decoding corpus
(``tests/unit/test_constrained_property.py``, the ``constrained.bench`` schema) and the schemas
langchain-tests' standard structured-output and tool-calling tests send (``LANGCHAIN_SCHEMAS``).

* **compile**: each grammar compiled once, cold (a fresh ``GrammarCache``, no disk cache), per engine:
  ``fsm`` (ours: schema -> regex -> byte DFA -> token index) and ``llguidance`` (schema -> the same regex ->
  llguidance). The per-server setup (llguidance's tokenizer, ~1 s) is reported apart. p50 / p99 / max.
* **mask**: the scheduler's per-step call, ``matcher.fill_mask(logits_row)`` on SmolLM2's vocabulary, along
  random walks (each step a token drawn uniformly from the allowed ones, seeded; drawn on grammars compiled
  apart, so the timed ones start cold), the same tokens replayed on both engines. Mean / p50 / p99
  microseconds. ``mask_us``: the first pass over the walks (each step's state may be new: llguidance builds
  lexer states lazily, our engine materialises a state's cached row); ``mask_us_warm``: the same walks again
  (a schema served before, as in a server that keeps getting the same schema). An llguidance matcher computes
  its next mask on a background thread as soon as it advances, overlapping the forward pass as upstream SGLang
  does. The server's forward (tens of ms for SmolLM2-135M on these CPUs, a few ms for small models on a GPU)
  outlasts the mask (p99 well under 1 ms), so the bench waits for the mask thread before the timer and
  ``mask_us`` is what stays on the scheduler's critical path: -inf written into a freshly written logits row
  where the mask forbids (the scheduler clones the logits just before it masks them), on both engines one C
  call on the CPU row (``constrained/mask_row.py``; ``mask_kernel`` says which build ran, None: numpy / torch).
  The work moved off that path is reported too: ``mask_compute_us`` (llguidance's mask, per step, on the first
  pass, on the mask thread) and ``mask_us_no_overlap`` (``fill_mask`` computing the mask itself, warm).
  ``mask_us_previous``: the first pass again (grammars compiled afresh) with llguidance's ``fill_mask`` as it
  was before the C kernel (``_PreviousFillMask``: numpy, the row and the ids built on the mask thread), a
  before/after in one run. ``advance_us``: ``matcher.advance(token)`` per step (llguidance's includes the
  stop / forced-bytes queries and starting the next mask).

Targets (2 CPU cores): compile p50 <= 50 ms, p99 <= 500 ms; mask mean <= 20 us.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch

from benchmarks.common import default_output, env_info, write_json
from sglang_backend.runtime.constrained import GrammarCache
from sglang_backend.runtime.constrained.bench import BENCH_SCHEMA
from sglang_backend.runtime.constrained.mask_row import kernel as mask_row_kernel
from sglang_backend.runtime.model_loader.embedded import default_model_path

ENGINES = ("fsm", "llguidance")
TARGETS = {"compile_p50_ms": 50.0, "compile_p99_ms": 500.0, "mask_mean_us": 20.0}


def langchain_schemas() -> dict[str, dict]:
    """The JSON schemas langchain-tests' standard chat-model tests send (structured output and tools)."""
    from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
    from langchain_tests.integration_tests import chat_models as lc  # the installed suite (test extra)

    out = {}
    for kind in ("pydantic", "typeddict", "json_schema"):
        schema, _ = lc._get_joke_class(kind)
        out[f"langchain/joke_{kind}"] = convert_to_json_schema(schema)
    for tool in (lc.magic_function, lc.magic_function_no_args, lc.unicode_customer):
        out[f"langchain/tool_{tool.name}"] = convert_to_openai_tool(tool)["function"]["parameters"]
    out["langchain/tool_color_picker"] = {"type": "object", "properties": {"fav_color": {"type": "string"}},
                                          "required": ["fav_color"]}
    return out


def corpus() -> list[tuple[str, str, object]]:
    """(name, kind, spec) for every grammar benchmarked."""
    from tests.unit.test_constrained_property import REGEXES, SCHEMAS  # the project's corpus

    items = [(f"schema/{i}", "json_schema", s) for i, s in enumerate(SCHEMAS)]
    items.append(("schema/bench", "json_schema", BENCH_SCHEMA))
    items += [(name, "json_schema", s) for name, s in langchain_schemas().items()]
    items += [(f"regex/{i}", "regex", r) for i, r in enumerate(REGEXES)]
    return items


def _cache(tokenizer, backend: str) -> GrammarCache:
    return GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, disk_cache=False, backend=backend)


def compile_times(tokenizer, items, backend: str) -> tuple[dict, dict, float]:
    """Cold compile seconds per grammar, the compiled grammars (errors as strings), and the setup seconds."""
    cache = _cache(tokenizer, backend)
    t0 = time.perf_counter()
    if backend == "llguidance":
        cache._llguidance_compiler(required=True)  # the one-off per server: llguidance's tokenizer
    setup = time.perf_counter() - t0
    seconds, compiled = {}, {}
    for name, kind, spec in items:
        t0 = time.perf_counter()
        try:
            compiled[name] = cache.compile(kind, spec)
        except ValueError as e:
            compiled[name] = f"{type(e).__name__}: {e}"[:200]
        seconds[name] = time.perf_counter() - t0
    return seconds, compiled, setup


def random_walk(grammar, eos: set[int], rng: random.Random, steps: int) -> list[int]:
    """Tokens of one walk: each drawn uniformly from the allowed ones (EOS ends it)."""
    matcher, tokens = grammar.matcher(), []
    for _ in range(steps):
        if matcher.is_finished():
            break
        allowed = matcher.allowed_token_ids()
        if not allowed:
            break
        tok = rng.choice(allowed)
        if tok in eos:
            break
        matcher.advance(tok)
        tokens.append(tok)
    return tokens


def mask_times(grammar, walk: list[int], vocab_size: int, gap: bool = True) -> tuple[list[float], list[float]]:
    """Seconds of ``fill_mask`` and of ``advance`` at each step of ``walk`` (a walk another engine rejects stops
    early). Between ``advance`` and the next ``fill_mask`` the server runs the forward pass (milliseconds),
    which outlasts an llguidance matcher's mask computation on its mask thread: with ``gap`` that wait is taken
    before the timer, and the thread let park (the GIL handed over) as it would be during a forward."""
    matcher, row, masks, advances = grammar.matcher(), torch.zeros(vocab_size), [], []
    forward_pass = getattr(matcher, "_sync", None) if gap else None
    for tok in walk + [None]:
        if forward_pass is not None:
            forward_pass()
            time.sleep(0)
        row.zero_()  # after the forward, as the scheduler clones the logits just before it masks them
        t0 = time.perf_counter()
        matcher.fill_mask(row)
        masks.append(time.perf_counter() - t0)
        if tok is None or not bool(row[tok] == 0):
            break
        t0 = time.perf_counter()
        matcher.advance(tok)
        advances.append(time.perf_counter() - t0)
    return masks, advances


class _ComputeTimer:
    """Records the seconds of each mask llguidance matchers compute (on the mask thread or in ``fill_mask``)."""

    def __init__(self):
        from sglang_backend.runtime.constrained.llguidance_backend import LLGuidanceMatcher  # llguidance only

        self.cls, self.original, self.samples = LLGuidanceMatcher, LLGuidanceMatcher._compute_step_mask, []

    def __enter__(self):
        original, samples = self.original, self.samples

        def timed(matcher):
            t0 = time.perf_counter()
            try:
                return original(matcher)
            finally:
                samples.append(time.perf_counter() - t0)

        self.cls._compute_step_mask = timed
        return self

    def __exit__(self, *exc):
        self.cls._compute_step_mask = self.original


class _PreviousFillMask:
    """llguidance's ``fill_mask`` as it was before the C kernel (commit e9ed690; for ``mask_us_previous``, the same
    walks in the same run): the CPU row masked through numpy (``logits_row.numpy()``, then a fill and the allowed
    logits put back where few tokens are allowed, -inf written at the forbidden ids where few are forbidden, else
    the 0/-inf row added), the row and the ids built on the mask thread with every mask. Grammars compiled inside
    the block get no kernel, so their steps carry that row and those ids."""

    def __init__(self):
        from sglang_backend.runtime.constrained import llguidance_backend  # llguidance only

        self.module, self.cls = llguidance_backend, llguidance_backend.LLGuidanceMatcher
        self.saved = (llguidance_backend.mask_row_kernel, self.cls.fill_mask)

    def __enter__(self):
        step_cls, current = self.module._StepMask, self.saved[1]

        def previous(matcher, logits_row):
            step = matcher._next
            if step.__class__ is not step_cls:
                step = matcher._step_mask()
            if logits_row.is_cpu:
                try:
                    row = logits_row.numpy()
                except (TypeError, RuntimeError):
                    row = None
                if row is not None and row.shape == matcher._row_shape:
                    step.apply(row)
                    return
            current(matcher, logits_row)  # other rows: the torch path, unchanged

        self.module.mask_row_kernel = lambda: None
        self.cls.fill_mask = previous
        return self

    def __exit__(self, *exc):
        self.module.mask_row_kernel, self.cls.fill_mask = self.saved


def walk_times(compiled: dict, walks: dict, vocab_size: int, prefetch: bool = True) -> tuple[list[float], list[float]]:
    """``mask_times`` over every walk: all fill_mask seconds, all advance seconds."""
    masks, advances = [], []
    for name, ws in walks.items():
        grammar = compiled[name]
        if isinstance(grammar, str):
            continue
        if hasattr(grammar, "prefetch"):
            grammar.prefetch = prefetch
        for w in ws:
            m, a = mask_times(grammar, w, vocab_size, gap=prefetch)
            masks += m
            advances += a
        if hasattr(grammar, "prefetch"):
            grammar.prefetch = True
    return masks, advances


def _stats(samples: list[float], scale: float) -> dict:
    if not samples:
        return {"n": 0}
    a = np.asarray(samples) * scale
    return {"n": len(samples), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def xgrammar_column(tokenizer, items, walks: dict[str, list[list[int]]]) -> dict:
    """Compile and mask times on xgrammar when it is importable (its own JSON-schema semantics, no digit bounds)."""
    try:
        import xgrammar as xgr  # optional: only measured where installed
    except ImportError:
        return {"skipped": "xgrammar is not installed"}
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    seconds, masks, errors = {}, [], {}
    for name, kind, spec in items:
        t0 = time.perf_counter()
        try:
            grammar = (compiler.compile_json_schema(json.dumps(spec), any_whitespace=False) if kind == "json_schema"
                       else compiler.compile_regex(spec))
        except Exception as e:  # noqa: BLE001 - recorded per grammar
            errors[name] = str(e)[:200]
            continue
        seconds[name] = time.perf_counter() - t0
        bitmask, row = xgr.allocate_token_bitmask(1, info.vocab_size), torch.zeros(1, info.vocab_size)
        for walk in walks.get(name, []):
            matcher = xgr.GrammarMatcher(grammar)
            for tok in walk:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(row, bitmask)
                masks.append(time.perf_counter() - t0)
                if not matcher.accept_token(tok):
                    break
    schema_s = [seconds[n] for n, k, _ in items if k == "json_schema" and n in seconds]
    return {"compile_ms_schemas": _stats(schema_s, 1e3), "compile_ms_all": _stats(list(seconds.values()), 1e3),
            "mask_us": _stats(masks, 1e6),
            "errors": errors, "per_grammar_compile_ms": {k: v * 1e3 for k, v in seconds.items()}}


def _kernel_kind() -> str | None:
    """Which build of the mask kernel runs here: "extension", "ctypes", or None (numpy / torch)."""
    k = mask_row_kernel()
    return None if k is None else "ctypes" if hasattr(k, "argtypes") else "extension"


def run(walks_per_grammar: int = 3, steps: int = 48, seed: int = 0, xgrammar: bool = True) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    eos = {tokenizer.eos_token_id}
    items = corpus()
    result: dict = {"env": env_info(), "tokenizer": "SmolLM2-135M-Instruct", "vocab_size": len(tokenizer),
                    "n_grammars": len(items), "n_schemas": sum(k == "json_schema" for _, k, _ in items),
                    "walks_per_grammar": walks_per_grammar, "steps_per_walk": steps, "targets": TARGETS,
                    "mask_kernel": _kernel_kind(), "engines": {}}
    compiled = {}
    for backend in ENGINES:
        seconds, compiled[backend], setup = compile_times(tokenizer, items, backend)
        result["engines"][backend] = {"setup_s": setup, "seconds": seconds}
    # The walks are drawn on grammars compiled apart, so the timed ones start with no lexer state built.
    _, walkers, _ = compile_times(tokenizer, items, "llguidance")
    rng = random.Random(seed)
    walks = {name: [random_walk(walkers[name], eos, rng, steps) for _ in range(walks_per_grammar)]
             for name, _, _ in items if not isinstance(walkers[name], str)}
    for backend in ENGINES:
        result["engines"][backend].update(engine_times(backend, compiled[backend], walks, items, len(tokenizer),
                                                       result["engines"][backend].pop("seconds")))
    with _PreviousFillMask():
        _, baseline, _ = compile_times(tokenizer, items, "llguidance")  # cold again, for the first pass
        result["engines"]["llguidance"]["mask_us_previous"] = _stats(
            walk_times(baseline, walks, len(tokenizer))[0], 1e6)
    if xgrammar:
        result["engines"]["xgrammar"] = xgrammar_column(tokenizer, items, walks)
    result["summary"] = summary(result)
    return result


def engine_times(backend: str, compiled: dict, walks: dict, items, vocab_size: int, seconds: dict) -> dict:
    """One engine's compile statistics and mask / advance times (first pass, warm pass; llguidance: also the
    mask computation itself and the masks computed inside ``fill_mask``, without the overlap)."""
    r: dict = {}
    if backend == "llguidance":
        with _ComputeTimer() as timer:
            cold, advances = walk_times(compiled, walks, vocab_size)
        r["mask_compute_us"] = _stats(timer.samples, 1e6)
    else:
        cold, advances = walk_times(compiled, walks, vocab_size)
    warm, _ = walk_times(compiled, walks, vocab_size)
    if backend == "llguidance":
        r["mask_us_no_overlap"] = _stats(walk_times(compiled, walks, vocab_size, prefetch=False)[0], 1e6)
    schema_s = [seconds[n] for n, k, _ in items if k == "json_schema"]
    r.update({"compile_ms_schemas": _stats(schema_s, 1e3), "compile_ms_all": _stats(list(seconds.values()), 1e3),
              "mask_us": _stats(cold, 1e6), "mask_us_warm": _stats(warm, 1e6), "advance_us": _stats(advances, 1e6),
              "errors": {n: c for n, c in compiled.items() if isinstance(c, str)},
              "per_grammar_compile_ms": {n: s * 1e3 for n, s in seconds.items()}})
    return r


def summary(result: dict) -> dict:
    out = {}
    for backend, r in result["engines"].items():
        if "compile_ms_schemas" not in r:
            continue
        c = r["compile_ms_schemas"]
        out[backend] = {"compile_p50_ms": c["p50"], "compile_p99_ms": c["p99"], "mask_mean_us": r["mask_us"].get("mean"),
                        "mask_p99_us": r["mask_us"].get("p99"),
                        "mask_previous_mean_us": r.get("mask_us_previous", {}).get("mean"),
                        "mask_previous_p99_us": r.get("mask_us_previous", {}).get("p99"),
                        "mask_warm_mean_us": r.get("mask_us_warm", {}).get("mean"),
                        "mask_compute_mean_us": r.get("mask_compute_us", {}).get("mean"),
                        "mask_no_overlap_mean_us": r.get("mask_us_no_overlap", {}).get("mean"),
                        "advance_mean_us": r.get("advance_us", {}).get("mean"),
                        "meets_targets": bool(c["p50"] <= TARGETS["compile_p50_ms"]
                                              and c["p99"] <= TARGETS["compile_p99_ms"]
                                              and (r["mask_us"].get("mean") or 1e9) <= TARGETS["mask_mean_us"])}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--walks", type=int, default=3, help="random walks per grammar for the mask times")
    p.add_argument("--steps", type=int, default=48, help="tokens per walk at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-xgrammar", action="store_true", help="skip the xgrammar column even where installed")
    p.add_argument("--out", default=default_output("grammar_engines"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.walks, args.steps, args.seed, xgrammar=not args.no_xgrammar)
    write_json(result, args.out)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
