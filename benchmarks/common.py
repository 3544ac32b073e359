"""Small helpers shared by the benchmarks: timing, environment info, JSON results, progress bars."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(BENCH_DIR, "results")


# Timing ---------------------------------------------------------------------------------------------------------
class Timer:
    """Wall-clock timer (``time.perf_counter``). Use as a context manager or call ``start``/``stop``.

    >>> with Timer() as t:
    ...     work()
    >>> t.elapsed  # seconds
    """

    def __init__(self) -> None:
        self._t0: float | None = None
        self.elapsed: float = 0.0

    def start(self) -> "Timer":
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        if self._t0 is None:
            raise RuntimeError("Timer.stop() before start()")
        self.elapsed = time.perf_counter() - self._t0
        self._t0 = None
        return self.elapsed

    def __enter__(self) -> "Timer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def timed(record: list[float]) -> Iterator[None]:
    """Appends the wall time of the block (seconds) to ``record``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        record.append(time.perf_counter() - t0)


def summarize(samples: list[float]) -> dict[str, Any]:
    """Median / min / max / mean of a list of timings (seconds); the raw samples are kept too."""
    if not samples:
        return {"median": None, "min": None, "max": None, "mean": None, "n": 0, "samples": []}
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "mean": statistics.fmean(samples),
        "n": len(samples),
        "samples": list(samples),
    }


def rotated(names: list[str], round_index: int) -> list[str]:
    """``names`` starting at ``round_index`` (mod their number): interleaved rounds run the variants in another order
    each time."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def variant_medians(runs: list[dict], field: str, names: list[str], keys: tuple[str, ...], base: str, time_key: str,
                    rate_key: str) -> dict[str, dict]:
    """Per variant (``run[field]``), the median over its runs of each of ``keys``; with ``base`` among the variants,
    each one's ``p50_speedup_over_<base>`` (the base's ``time_key`` / its own) and ``throughput_over_<base>`` (its
    ``rate_key`` / the base's)."""
    summary = {n: {k: statistics.median(r[k] for r in runs if r[field] == n) for k in keys} for n in names}
    if base in summary:
        for n in names:
            summary[n][f"p50_speedup_over_{base}"] = summary[base][time_key] / summary[n][time_key]
            summary[n][f"throughput_over_{base}"] = summary[n][rate_key] / summary[base][rate_key]
    return summary


def safe_div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


# Environment ----------------------------------------------------------------------------------------------------
def env_info() -> dict[str, Any]:
    """What the numbers depend on: CPU count, thread count, torch/transformers versions, device."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        info["loadavg"] = list(os.getloadavg())  # other work on the machine skews CPU timings
    except (AttributeError, OSError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_num_threads"] = torch.get_num_threads()
        info["cuda_available"] = torch.cuda.is_available()
        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - env info must never break a benchmark
        info["torch"] = None
        info["device"] = "cpu"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        info["transformers"] = None
    try:
        import sglang_backend

        info["sglang_backend"] = getattr(sglang_backend, "__version__", None)
    except Exception:  # noqa: BLE001
        info["sglang_backend"] = None
    return info


# Results --------------------------------------------------------------------------------------------------------
def default_output(name: str) -> str:
    """``benchmarks/results/<name>.json``."""
    return os.path.join(RESULTS_DIR, f"{name}.json")


def write_json(result: dict[str, Any], path: str) -> str:
    """Writes ``result`` as indented JSON (atomically: temp file + rename); creates parent dirs. Returns path."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# Progress -------------------------------------------------------------------------------------------------------
def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", disable: bool = False,
             **kwargs: Any):
    """A tqdm progress bar (to stderr); a no-op stand-in if tqdm is missing or ``disable`` is set.

    Works as ``for x in progress(items, desc=...)`` or as ``with progress(total=n) as bar: bar.update()``.
    """
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return _NullBar(iterable, total)
    return tqdm(iterable, total=total, desc=desc, disable=disable, dynamic_ncols=True, leave=True, **kwargs)


class _NullBar:
    def __init__(self, iterable=None, total=None):
        self.iterable = iterable
        self.total = total

    def __iter__(self):
        return iter(self.iterable or [])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def write(self, s: str) -> None:
        print(s, file=sys.stderr)

    def close(self) -> None:
        pass


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain fixed-width text table; floats get 3 significant decimals, None prints as '-'."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([line, sep, *body])
