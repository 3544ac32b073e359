"""The suite's memory, for the closing lines (see ``pytest_terminal_summary`` in conftest): the peak of each test
server, and after each test module the pytest process's RSS (once its garbage is collected and its freed heap
handed back) with the in-process engines still alive."""

from __future__ import annotations

import gc
import sys
import weakref
from dataclasses import dataclass, field

server_peaks_kib: list[int] = []  # per stopped server: the sum of its processes' peak RSS (VmHWM)


@dataclass
class ModuleRow:
    module: str
    rss_kib: int  # when the module's fixtures were torn down
    rss_after_gc_kib: int  # after gc.collect() and malloc_trim
    peak_kib: int  # the process's peak RSS so far (VmHWM)
    engines: int  # Engine objects alive after the module (shared ones included)


module_rows: list[ModuleRow] = []
leak_warnings: list[str] = []  # an Engine or Scheduler still alive after the module that made it
_first_seen: dict[int, tuple[weakref.ref, str]] = {}  # id -> (object, module after which it was first seen alive)
_warned: "weakref.WeakSet" = weakref.WeakSet()


def _proc_status_kib(pid: int | str, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def vm_hwm_kib(pid: int) -> int:
    """Peak resident set size of a live process (Linux /proc), 0 where unknown."""
    return _proc_status_kib(pid, "VmHWM:")


def rss_kib() -> int:
    """This process's resident set size now (Linux /proc), 0 where unknown."""
    return _proc_status_kib("self", "VmRSS:")


def record_server(pids: list[int]) -> None:
    """Call just before stopping a server: its main process and descendants, all still alive."""
    server_peaks_kib.append(sum(vm_hwm_kib(p) for p in pids))


def _live_engines_and_schedulers() -> tuple[list, list]:
    """The live Engine and Scheduler objects (one pass over the tracked objects; none before their import)."""
    engine_cls = getattr(sys.modules.get("sglang_backend.runtime.engine"), "Engine", None)
    sched_cls = getattr(sys.modules.get("sglang_backend.runtime.managers.scheduler"), "Scheduler", None)
    engines, schedulers = [], []
    if engine_cls is None and sched_cls is None:
        return engines, schedulers
    for obj in gc.get_objects():
        cls = type(obj)  # not isinstance: that reads obj.__class__, which some lazy module proxies warn about
        if engine_cls is not None and issubclass(cls, engine_cls):
            engines.append(obj)
        elif sched_cls is not None and issubclass(cls, sched_cls):
            schedulers.append(obj)
    return engines, schedulers


def _describe(obj) -> str:
    args = getattr(obj, "server_args", None)
    path = getattr(args, "model_path", None)
    return f"{type(obj).__name__}(model_path={path!r})" if path else type(obj).__name__


def end_module(module: str, shared: set[int]) -> None:
    """After a test module's fixtures are torn down: frees what it left (garbage, freed heap pages), records
    the RSS and notes each Engine or Scheduler (KV pool) that outlived the module that made it, other than the
    engines in ``shared`` (ids of the engines kept for the next module)."""
    from sglang_backend.utils import release_freed_memory

    rss = rss_kib()
    # pytest keeps the last failure's traceback (for post-mortem debugging): its frames hold that test's
    # locals, an engine among them. --pdb runs at the failure itself, so nothing needs it once the module ended.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
    gc.collect()
    release_freed_memory()
    engines, schedulers = _live_engines_and_schedulers()
    owned = {id(getattr(e, "scheduler", None)) for e in engines}
    schedulers = [s for s in schedulers if id(s) not in owned]  # made directly, not by an engine
    module_rows.append(ModuleRow(module, rss, rss_kib(), _proc_status_kib("self", "VmHWM:"), len(engines)))
    for obj in engines + schedulers:
        ref, made_in = _first_seen.get(id(obj), (None, None))
        if ref is None or ref() is not obj:
            _first_seen[id(obj)] = (weakref.ref(obj), module)
            made_in = module
        if id(obj) in shared or obj in _warned:
            continue
        _warned.add(obj)
        leak_warnings.append(f"{_describe(obj)} made by {made_in} still alive after {module}")
    del engines, schedulers
    for key in [k for k, (ref, _) in _first_seen.items() if ref() is None]:
        del _first_seen[key]


def module_lines() -> list[str]:
    """One line per test module, in run order; ``<- peak`` marks the modules that raised the process's peak."""
    if not module_rows:
        return []
    lines = ["RSS after each test module, GiB (at its teardown -> after gc + malloc_trim; the process's peak so far;"
             " engines alive):"]
    peak = 0
    for row in module_rows:
        mark = "  <- peak" if row.peak_kib > peak else ""
        peak = max(peak, row.peak_kib)
        lines.append(f"  {row.module}: {row.rss_kib / 2**20:.2f} -> {row.rss_after_gc_kib / 2**20:.2f}; "
                     f"peak {row.peak_kib / 2**20:.2f}; engines {row.engines}{mark}")
    return lines
