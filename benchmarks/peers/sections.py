"""The timed sections, written once over the ``Client`` protocol so that both engines run exactly the same
calls: offline throughput, shared prefix, batch-1 and batch-64 decode, cold prefill, and the LM programs.
Each call is made from an empty prefix cache (``client.reset()`` first)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from benchmarks.peers import programs
from benchmarks.peers.workloads import Client, Sizes, offline_warmup_tokens, outputs_ok, specs


def timed_generate(client: Client, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds of one generate call from an empty prefix cache, and its outputs."""
    client.reset()
    t0 = time.perf_counter()
    outs = client.generate(prompts, max_tokens)
    return time.perf_counter() - t0, outs


def median_of_calls(client: Client, spec, vocab: int, max_tokens: int, repeats: int) -> tuple[float, list, bool]:
    """A warm-up call on ``spec``'s warm prompts, then ``repeats`` timed calls on its real ones, each from an empty
    cache: (the median seconds, every call's seconds, whether every output was well formed)."""
    timed_generate(client, spec.prompts(vocab, warm=True), max_tokens)
    real, times, ok = spec.prompts(vocab), [], True
    for _ in range(repeats):
        dt, outs = timed_generate(client, real, max_tokens)
        times.append(dt)
        ok = ok and outputs_ok(outs, spec.count, max_tokens, vocab)
    return statistics.median(times), times, ok


def offline(client: Client, sz: Sizes, vocab: int) -> dict:
    """N requests of 1024 prompt tokens, 1024 output tokens each, one call: output tokens/s."""
    spec = specs(sz)["offline"]
    timed_generate(client, spec.prompts(vocab, warm=True), offline_warmup_tokens(sz))
    dt, outs = timed_generate(client, spec.prompts(vocab), spec.output_len)
    tokens = sum(map(len, outs))
    return dict(requests=spec.count, prompt_len=spec.prompt_len, output_len=spec.output_len, seconds=dt,
                output_tokens=tokens, output_tok_per_s=tokens / dt,
                total_tok_per_s=(tokens + spec.count * spec.prompt_len) / dt,
                well_formed=outputs_ok(outs, spec.count, spec.output_len, vocab))


def shared_prefix(client: Client, sz: Sizes, vocab: int) -> dict:
    """128 requests = one 1024-token prefix + 64 unique tokens, 32 out, one call from a cold cache: requests/s
    (the median of ``program_repeats`` calls)."""
    spec = specs(sz)["shared_prefix"]
    dt, times, ok = median_of_calls(client, spec, vocab, spec.output_len, sz.program_repeats)
    return dict(requests=spec.count, shared_prefix_len=spec.prompt_len, unique_len=spec.unique,
                output_len=spec.output_len, seconds=dt, times_s=times, requests_per_s=spec.count / dt,
                output_tok_per_s=spec.count * spec.output_len / dt, well_formed=ok)


def decode(client: Client, sz: Sizes, vocab: int, name: str) -> dict:
    """ms per decode step = (T(256 out) - T(1 out)) / 255, median over the repeats: both calls pay the same
    cold prefill, so it cancels."""
    spec = specs(sz)[name]
    warm, real = spec.prompts(vocab, warm=True), spec.prompts(vocab)
    timed_generate(client, warm, min(spec.output_len, 32))  # warm-up: the decode path at this batch size
    timed_generate(client, warm, 1)
    runs, ok = [], True
    for _ in range(sz.repeats):
        t1, outs1 = timed_generate(client, real, 1)
        tn, outsn = timed_generate(client, real, spec.output_len)
        ok = ok and outputs_ok(outs1, spec.count, 1, vocab) and outputs_ok(outsn, spec.count, spec.output_len, vocab)
        runs.append(dict(t_1tok_s=t1, t_ntok_s=tn, ms_per_step=(tn - t1) / (spec.output_len - 1) * 1e3))
    ms = statistics.median(r["ms_per_step"] for r in runs)
    return dict(requests=spec.count, prompt_len=spec.prompt_len, output_len=spec.output_len, repeats=sz.repeats,
                ms_per_step=ms, decode_tok_per_s=spec.count * 1e3 / ms if ms > 0 else None, runs=runs,
                well_formed=ok)


def cold_prefill(client: Client, sz: Sizes, vocab: int) -> dict:
    """8 prompts of 1024 tokens, 1 output token, cache emptied before each call: prefill tokens/s (median)."""
    spec = specs(sz)["cold_prefill"]
    seconds, times, ok = median_of_calls(client, spec, vocab, 1, sz.prefill_repeats)
    return dict(requests=spec.count, prompt_len=spec.prompt_len, repeats=sz.prefill_repeats, seconds=seconds,
                times_s=times, prefill_tok_per_s=spec.count * spec.prompt_len / seconds, well_formed=ok)


def program_section(run: Callable) -> Callable:
    """A program as a section: a warm-up pass at a quarter of the size (another seed: its calls and code
    paths, cheaply), then ``program_repeats`` timed passes (each from an empty cache); the median pass is the
    result, with every pass's seconds in ``times_s``, and it is well formed only if every pass was."""

    def section(client: Client, sz: Sizes, vocab: int) -> dict:
        run(client, vocab, sz.scale / 4, seed=1)
        passes = [run(client, vocab, sz.scale, seed=0) for _ in range(sz.program_repeats)]
        result = sorted(passes, key=lambda r: r["seconds"])[(len(passes) - 1) // 2]
        return dict(result, times_s=[r["seconds"] for r in passes],
                    well_formed=all(r["well_formed"] for r in passes))

    section.__doc__ = run.__doc__
    return section


SECTIONS: dict[str, Callable] = {
    "offline": offline,
    "shared_prefix": shared_prefix,
    "decode_bs1": lambda client, sz, vocab: decode(client, sz, vocab, "decode_bs1"),
    "decode_bs64": lambda client, sz, vocab: decode(client, sz, vocab, "decode_bs64"),
    "cold_prefill": cold_prefill,
    **{name: program_section(run) for name, run in programs.PROGRAMS.items()},
}
# Sections run in the cache-off phase (an engine without prefix caching).
CACHE_OFF_SECTIONS = ("shared_prefix",)
GROUPS = {"programs": tuple(programs.PROGRAMS), "all": tuple(SECTIONS)}
SECTIONS.update({name: program_section(run) for name, run in programs.PRESSURE_PROGRAMS.items()})


def expand(names: str) -> list[str]:
    """A comma list of sections and groups -> section names in run order, each once."""
    out: list[str] = []
    for item in (s.strip() for s in names.split(",")):
        if not item:
            continue
        if item not in SECTIONS and item not in GROUPS:
            raise ValueError(f"unknown section {item!r}; known: {', '.join([*SECTIONS, *GROUPS])}")
        out += [n for n in GROUPS.get(item, (item,)) if n not in out]
    return out
