"""The command line of ``python -m benchmarks.bench_gpu``: flags, output paths, the run's header in the JSON,
then the sections named by --only (see registry.py) and the summary table."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.common import RESULTS_DIR, env_info
from benchmarks.gpu import registry
from benchmarks.gpu.common import MODELS, PATHS, RESULT, Context, log, model_bytes, save
from benchmarks.gpu.table import table

DEFAULT_SECTIONS = "ceilings,correctness,hf,runner,engine_decode,shared,offline,no_radix"


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b", choices=sorted(MODELS))
    ap.add_argument("--only", default=DEFAULT_SECTIONS,
                    help="comma-separated sections, run in registry order: "
                         + ", ".join(s.name for s in registry.SECTIONS))
    ap.add_argument("--hf-parts", default="decode,shared")
    ap.add_argument("--offline-max-requests", type=int, default=64)
    ap.add_argument("--mem-fraction-static", type=float, default=0.9)
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"),
                    help="fp8: online FP8 weights (the floors count one byte per linear weight)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps")
    ap.add_argument("--output", default=None)
    return ap


def set_paths(name: str, output: str | None, quantization: str = "none"):
    """The results JSON ($OUT/gpu_<model>.json, else benchmarks/results/) and the tuned kernel configs beside it."""
    out_dir = os.environ.get("OUT") or RESULTS_DIR
    tag = name.replace("-", "_") + ("" if quantization == "none" else f"_{quantization}")
    PATHS.out = output or os.path.join(out_dir, f"gpu_{tag}.json")
    PATHS.kernel_config = os.path.join(os.path.dirname(PATHS.out) or ".", f"kernel_config_{tag}.json")


def start_run(args, name: str) -> Context:
    """The JSON's header (model, shape, environment, argv, byte counts) and the sections' context."""
    spec = MODELS[name]
    RESULT.update({"benchmark": "gpu", "model": name, "dtype": spec["dtype"], "config": spec["config"],
                   "quantization": args.quantization, "env": env_info(), "argv": sys.argv[1:]})
    try:
        import triton  # optional here: its version is recorded where it is installed

        RESULT["env"]["triton"] = triton.__version__
    except ImportError:
        pass
    dtype_bytes = torch.tensor([], dtype=getattr(torch, spec["dtype"])).element_size()
    mb = model_bytes(spec["config"], dtype_bytes, linear_bytes=1 if args.quantization == "fp8" else None)
    RESULT["model_bytes"] = mb
    return Context(args=args, name=name, spec=spec, mb=mb)


def main(argv=None, description: str | None = None) -> int:
    ap = build_parser(description)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model = "tiny"
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    try:
        registry.select(names)
    except registry.UnknownSection as e:
        ap.error(str(e))
    name = args.model
    set_paths(name, args.output, args.quantization)
    if not torch.cuda.is_available():
        log("bench_gpu needs a CUDA GPU")
        return 1
    ctx = start_run(args, name)
    registry.run_sections(ctx, names)
    save()
    log(table(name, RESULT))
    log(f"results: {PATHS.out}")
    return 0
