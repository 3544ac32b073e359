"""The sections of the GPU benchmark, in run order, each registered once with what it needs: no engine, the
run's shared engine (consecutive such sections share one, made once and shut down after the last), or an
engine of its own with some Engine arguments overridden (the ablations). ``run_sections`` runs the named ones
in registry order, whatever the order of the names."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from benchmarks.gpu import ceilings, engine, hf, kernels, runner
from benchmarks.gpu.common import Context, engine_for

SHARED = {}  # Section.engine for the sections that run on the run's shared engine


@dataclasses.dataclass(frozen=True)
class Section:
    name: str  # as given to --only
    run: Callable[[Context], Any]
    engine: dict | None = None  # None: no engine; SHARED: the shared engine; else its own, these Engine overrides


class UnknownSection(ValueError):
    pass


def _offline(ctx: Context, key: str = "offline_1k_1k"):
    engine.bench_offline(ctx.eng, ctx.vocab, ctx.args.offline_max_requests, key)


def _ablation(suffix: str):
    """The engine-loop step and offline throughput again, on an engine with one feature off."""
    def run(ctx: Context):
        engine.bench_engine_decode(ctx.eng, ctx.vocab, suffix)
        _offline(ctx, "offline_1k_1k" + suffix)
    return run


SECTIONS: list[Section] = [
    Section("ceilings", lambda c: ceilings.ceilings(c.spec["dtype"])),
    Section("correctness", lambda c: kernels.bench_correctness()),
    Section("pdl_probe", lambda c: kernels.bench_pdl_probe()),
    Section("attn_sweep", lambda c: kernels.bench_attn_sweep(c.name)),
    Section("cascade_sweep", lambda c: kernels.bench_cascade_sweep(c.name)),
    Section("attn_layout", lambda c: kernels.bench_attn_layout(c.name)),
    Section("gemv_sweep", lambda c: kernels.bench_gemv_sweep(c.name)),
    Section("hf", lambda c: hf.bench_hf(c.name, c.args)),
    Section("profile", lambda c: runner.bench_profile(c.eng), SHARED),
    # Before runner: the runner's figures then use the winners.
    Section("gemv_step_sweep", lambda c: runner.bench_gemv_step_sweep(c.eng, c.mb), SHARED),
    Section("runner", lambda c: runner.bench_runner(c.eng, c.mb, c.name), SHARED),
    Section("runner_shared", lambda c: runner.bench_runner_shared(c.eng, c.mb), SHARED),
    Section("engine_decode", lambda c: engine.bench_engine_decode(c.eng, c.vocab), SHARED),
    Section("engine_trace", lambda c: engine.bench_engine_trace(c.eng, c.vocab), SHARED),
    Section("cpu_profile", lambda c: engine.bench_cpu_profile(c.eng, c.vocab), SHARED),
    Section("shared", lambda c: engine.bench_shared(c.eng, c.vocab, "shared_prefix"), SHARED),
    Section("shared_trace", lambda c: engine.bench_shared_trace(c.eng, c.vocab), SHARED),
    Section("offline", _offline, SHARED),
    # Ablations, each on its own engine: the synchronous scheduler loop; no programmatic dependent launch (on
    # by default on sm90+); no radix cache.
    Section("no_overlap", _ablation("_no_overlap"), {"disable_overlap_schedule": True}),
    Section("no_pdl", _ablation("_no_pdl"), {"pdl": "off"}),
    Section("no_radix", lambda c: engine.bench_shared(c.eng, c.vocab, "shared_prefix_no_radix"),
            {"disable_radix_cache": True}),
]


def select(names, sections: list[Section] = SECTIONS) -> list[Section]:
    """The named sections in registry order; UnknownSection names the unknown ones and lists the valid ones."""
    known = [s.name for s in sections]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UnknownSection(f"unknown section(s) {', '.join(unknown)}; valid sections: {', '.join(known)}")
    return [s for s in sections if s.name in names]


def plan(selected: list[Section]) -> list[tuple[dict | None, list[Section]]]:
    """(engine, sections) in run order: consecutive shared-engine sections grouped under one engine."""
    groups: list[tuple[dict | None, list[Section]]] = []
    for s in selected:
        if s.engine == SHARED and groups and groups[-1][0] == SHARED:
            groups[-1][1].append(s)
        else:
            groups.append((s.engine, [s]))
    return groups


def run_sections(ctx: Context, names, sections: list[Section] = SECTIONS, open_engine=engine_for):
    """Run the named sections in registry order, each group that needs an engine inside ``open_engine``."""
    for overrides, group in plan(select(names, sections)):
        if overrides is None:
            for s in group:
                s.run(ctx)
            continue
        with open_engine(ctx, **overrides):
            for s in group:
                s.run(ctx)
