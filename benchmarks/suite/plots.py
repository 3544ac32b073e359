"""PNG figures from the result rows: normalized throughput per workload (paper Fig. 5), normalized latency
(Fig. 6), ablations (Fig. 8c) and achieved vs optimal cache hit rate (Fig. 13)."""

from __future__ import annotations

import os


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _grouped_bars(path: str, title: str, ylabel: str, workloads: list[str], series: dict[str, list]) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(workloads) + 4), 4.2))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(workloads))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: bars stay visible
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _normalized(rows, mode: str, key: str, baselines: list[str], best) -> tuple[list[str], dict[str, list]]:
    """Per workload, ``key`` of each baseline divided by the best baseline's (max for throughput, min for
    latency), so the best system is 1.0 as in the paper's figures."""
    by = {(r["workload"], r["baseline"]): r.get(key) for r in rows if r["mode"] == mode and r.get(key)}
    workloads = sorted({w for w, b in by if b in baselines}, key=lambda w: [r["workload"] for r in rows].index(w))
    series = {b: [] for b in baselines if any((w, b) in by for w in workloads)}
    for w in workloads:
        ref = best(v for (ww, b), v in by.items() if ww == w and b in series)
        for b in series:
            v = by.get((w, b))
            series[b].append(v / ref if v is not None and ref else None)
    return workloads, series


def make_plots(rows: list[dict], out_dir: str, title: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    main = [b for b in ("full", "no_cache", "hf_batched", "hf_sequential") if any(r["baseline"] == b for r in rows)]
    ablations = [b for b in ("full", "no_cache", "no_tree", "fcfs", "random", "no_frontend_parallel", "no_hints",
                             "no_jump_forward") if any(r["baseline"] == b for r in rows)]
    w, s = _normalized(rows, "throughput", "programs_per_s", main, max)
    if w:
        paths.append(_grouped_bars(os.path.join(out_dir, "fig5_throughput.png"),
                                   f"Normalized throughput (programs/s, higher is better) - {title}",
                                   "normalized throughput", w, s))
    w, s = _normalized(rows, "latency", "latency_s_mean", main, min)
    if w:
        paths.append(_grouped_bars(os.path.join(out_dir, "fig6_latency.png"),
                                   f"Normalized latency (mean per program, lower is better) - {title}",
                                   "normalized latency", w, s))
    abl_workloads = sorted({r["workload"] for r in rows if r["baseline"] in ablations[2:]})
    if abl_workloads:
        w, s = _normalized([r for r in rows if r["workload"] in abl_workloads], "throughput", "programs_per_s",
                           ablations, max)
        paths.append(_grouped_bars(os.path.join(out_dir, "fig8c_ablation.png"),
                                   f"Ablations: normalized throughput - {title}", "normalized throughput", w, s))
    full = [r for r in rows if r["baseline"] == "full" and r["mode"] == "throughput" and r.get("hit_rate") is not None]
    if full:
        paths.append(_grouped_bars(os.path.join(out_dir, "fig13_hit_rate.png"),
                                   f"Cache hit rate: achieved vs optimal (full system) - {title}", "hit rate",
                                   [r["workload"] for r in full],
                                   {"achieved": [r["hit_rate"] for r in full],
                                    "optimal": [r["optimal_hit_rate"] for r in full]}))
    return paths
