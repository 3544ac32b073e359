"""The peer benchmark's report from its merged JSON: a Markdown table (workload | metric | ours | vLLM | ratio,
the ratio oriented so that > 1 always means we are better) and a PNG of the ratios (horizontal bars, a line at
1.0).

    python -m benchmarks.peers report RESULT.json    # rewrites RESULT.md and RESULT.png beside it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

from benchmarks.peers.programs import NOT_COVERED, PRESSURE_PROGRAMS, PROGRAMS


@dataclasses.dataclass(frozen=True)
class Metric:
    """One table row: ``key`` of section ``section`` in the ``cache`` phase; ``higher_is_better`` orients the
    ratio; ``plot``: drawn in the PNG (rows that only restate another row's ratio are not)."""

    section: str
    cache: str
    key: str
    label: str
    higher_is_better: bool
    plot: bool = True


METRICS = [
    Metric("offline", "on", "output_tok_per_s", "output tok/s", True),
    Metric("shared_prefix", "on", "requests_per_s", "requests/s", True),
    Metric("shared_prefix", "off", "requests_per_s", "requests/s", True),
    Metric("decode_bs1", "on", "ms_per_step", "ms/step", False),
    Metric("decode_bs64", "on", "ms_per_step", "ms/step", False),
    Metric("cold_prefill", "on", "prefill_tok_per_s", "prefill tok/s", True),
    Metric("cold_prefill", "on", "seconds", "s per call (median)", False, plot=False),
    *[Metric(name, "on", "programs_per_s", "programs/s", True) for name in (*PROGRAMS, *PRESSURE_PROGRAMS)],
]


def ratio(ours: float | None, peer: float | None, higher_is_better: bool) -> float | None:
    """ours/peer for rates, peer/ours for times: > 1 means we are better. None when a side is missing or 0."""
    if not ours or not peer:
        return None
    return ours / peer if higher_is_better else peer / ours


def section_of(result: dict, side: str, cache: str, name: str) -> dict | None:
    return (((result.get("runs") or {}).get(side) or {}).get(cache) or {}).get("sections", {}).get(name)


def rows(result: dict) -> list[dict]:
    """The table's rows: one per metric that at least one side measured."""
    out = []
    for m in METRICS:
        ours, peer = section_of(result, "ours", m.cache, m.section), section_of(result, "vllm", m.cache, m.section)
        if ours is None and peer is None:
            continue
        a, b = (ours or {}).get(m.key), (peer or {}).get(m.key)
        out.append(dict(workload=m.section, cache=m.cache, metric=m.label, ours=a, vllm=b,
                        ratio=ratio(a, b, m.higher_is_better), plot=m.plot,
                        well_formed_ours=(ours or {}).get("well_formed"),
                        well_formed_vllm=(peer or {}).get("well_formed")))
    return out


def program_geomean(table: list[dict]) -> dict | None:
    """The LM-program suite's geometric mean of ratios (``PROGRAMS``; the pressure programs are apart), over the
    programs both sides ran, with the lowest one; None when none has a ratio."""
    ratios = {r["workload"]: r["ratio"] for r in table if r["workload"] in PROGRAMS and r["ratio"]}
    if not ratios:
        return None
    lowest = min(ratios, key=ratios.get)
    return dict(geomean=math.exp(sum(map(math.log, ratios.values())) / len(ratios)), programs=len(ratios),
                of=len(PROGRAMS), lowest=lowest, lowest_ratio=ratios[lowest])


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v)


def workload_name(row: dict) -> str:
    return row["workload"] + (" (prefix cache off)" if row["cache"] == "off" else "")


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(result: dict) -> str:
    meta = result.get("meta", {})
    lines = [f"# Peer benchmark: {meta.get('model')} — ours vs vLLM {meta.get('vllm_version') or '(not run)'}", "",
             f"GPU: {meta.get('gpu') or '-'}; date {meta.get('date')}; ours {meta.get('ours_version') or 'git ' + str(meta.get('git_head'))}, "
             f"torch {meta.get('torch_version')}; vLLM attention: {meta.get('vllm_attention_backend') or '-'}",
             "", "Ratio = ours/vLLM for rates and vLLM/ours for times: **> 1 means ours is better**.", "",
             "| workload | metric | ours | vLLM | ratio (>1: ours better) | well-formed ours/vLLM |",
             "|---|---|---:|---:|---:|---|"]
    table = rows(result)
    for r in table:
        lines.append(f"| {workload_name(r)} | {r['metric']} | {fmt(r['ours'])} | {fmt(r['vllm'])} | "
                     f"{fmt_ratio(r['ratio'])} | "
                     f"{fmt(r['well_formed_ours'])}/{fmt(r['well_formed_vllm'])} |")
    suite = program_geomean(table)
    if suite:
        lines += ["", f"LM programs: geometric mean of the ratios {suite['geomean']:.2f}x over {suite['programs']} of "
                      f"{suite['of']} programs; lowest {suite['lowest']} {suite['lowest_ratio']:.2f}x"]
    check = section_of(result, "ours", "off", "check")
    if check:
        detail = (f"skipped ({check['skipped']})" if "skipped" in check else
                  json.dumps({k: check.get(k) for k in ("tokens_equal", "ok", "near_tie", "partings")}))
        lines += ["", f"Correctness (ours: triton vs torch_native, first {check.get('tokens', '?')} greedy tokens "
                      f"of {check.get('prompts', '?')} prompts): {detail}"]
    if meta.get("note"):  # how a merged table was put together
        lines += ["", f"Note: {meta['note']}"]
    if NOT_COVERED:
        lines += ["", "Not covered yet: " + "; ".join(f"{k} ({v})" for k, v in NOT_COVERED.items())]
    errors = result.get("errors") or {}
    if errors:
        lines += ["", "Errors (tracebacks in the JSON):"]
        for key in sorted(errors):
            last = [x for x in str(errors[key]).strip().splitlines() if x.strip()]
            lines.append(f"- {key}: {last[-1][:300] if last else ''}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """Horizontal bars of the ratios (green: ours better, red: vLLM better), a line at 1.0."""
    # Deferred heavy import (matplotlib takes a second): only the PNG needs it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display on the GPU machine

    drawn = [r for r in rows(result) if r["plot"] and r["ratio"] is not None][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * max(len(drawn), 4) + 1.5))
    if drawn:
        labels = [f"{workload_name(r)}: {r['metric']}" for r in drawn]
        values = [r["ratio"] for r in drawn]
        ax.barh(labels, values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
        for i, (v, r) in enumerate(zip(values, drawn)):
            ax.text(v, i, f" {v:.2f}x  (ours {fmt(r['ours'])}, vLLM {fmt(r['vllm'])})", va="center", fontsize=8)
        # Log scale: 0.9x and 1.1x sit as far from the line as they deserve, and an 8x bar does not flatten them.
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(0.5, min(values) / 1.2), max(2.0, max(values)) * 4)
    else:
        ax.text(0.5, 0.5, "no vLLM figures in this run (ours only)", ha="center", va="center",
                transform=ax.transAxes)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    meta = result.get("meta", {})
    ax.set_xlabel("ratio, log scale (> 1: ours better; rates ours/vLLM, times vLLM/ours)")
    gpu = (meta.get("gpu") or "?").split(",")[0]  # the name, without the driver and memory
    date = (meta.get("date") or "")[:10]
    ax.set_title(f"ours vs vLLM {meta.get('vllm_version') or ''}: {meta.get('model')}, {gpu}, {date}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict, json_path: str) -> tuple[str, str]:
    """Writes the .md and .png beside ``json_path``; returns their paths."""
    stem = os.path.splitext(json_path)[0]
    md, png = stem + ".md", stem + ".png"
    with open(md, "w") as f:
        f.write(markdown(result))
    plot(result, png)
    return md, png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers report",
                                 description="rewrite the Markdown table and the PNG from a peers JSON")
    ap.add_argument("json_path")
    args = ap.parse_args(argv)
    with open(args.json_path) as f:
        result = json.load(f)
    md, png = write_report(result, args.json_path)
    print(markdown(result))
    print(f"wrote {md} and {png}")
    return 0
