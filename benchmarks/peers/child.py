"""What both sides' child processes share: their command line, the result document (rewritten after every
section, so a crash or a deadline kill keeps the figures so far) and the section loop."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Callable

from benchmarks.peers.sections import SECTIONS
from benchmarks.peers.workloads import FULL, SMOKE, Sizes

TAG = "[peers"  # every line the benchmark itself prints starts with this (the parent filters vLLM's logs by it)


def log(side: str, msg: str) -> None:
    print(f"{TAG} {side} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: str, obj: dict) -> None:
    """Atomically (a reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def child_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True, help="this phase's JSON")
    ap.add_argument("--sections", required=True, help="comma list of section names")
    ap.add_argument("--cache", choices=("on", "off"), default="on", help="prefix caching")
    ap.add_argument("--smoke", action="store_true", help="the shrunk sizes (CPU smoke run)")
    ap.add_argument("--mem-fraction", type=float, default=0.88, help="share of GPU memory for the engine")
    return ap


def sizes_for(args) -> Sizes:
    return SMOKE if args.smoke else FULL


def new_result(side: str, args) -> dict:
    return {"side": side, "cache": args.cache, "sizes": dataclasses.asdict(sizes_for(args)), "info": {},
            "sections": {}, "errors": {}, "argv": sys.argv}


def run_sections(side: str, client, vocab: int, args, result: dict,
                 extra: dict[str, Callable] | None = None) -> int:
    """Run ``args.sections`` through ``client`` in order (``extra``: this side's own sections, called with the
    result dict); each outcome, or its traceback, goes into ``result`` and the JSON is rewritten. Returns the
    number of failed sections."""
    sz, failed = sizes_for(args), 0
    for name in [s for s in args.sections.split(",") if s]:
        log(side, f"cache {args.cache}: section {name}")
        t0 = time.perf_counter()
        try:
            if extra and name in extra:
                out = extra[name](result)
            else:
                out = SECTIONS[name](client, sz, vocab)
            out["section_wall_s"] = time.perf_counter() - t0
            result["sections"][name] = out
            brief = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()
                     if not isinstance(v, (list, dict))}
            log(side, f"cache {args.cache}: {name} done: {json.dumps(brief)}")
        except Exception:  # noqa: BLE001 - keep the other sections
            failed += 1
            result["errors"][name] = traceback.format_exc()
            log(side, f"cache {args.cache}: {name} FAILED\n{result['errors'][name]}")
        write_json(args.out, result)
    return failed


def server_arg_overrides(items: list[str]) -> dict:
    """``KEY=VALUE`` strings as keyword overrides (our ServerArgs, vLLM's LLM); VALUE parsed as JSON (true, 0.5,
    "x"), else kept as a string."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, not {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out
