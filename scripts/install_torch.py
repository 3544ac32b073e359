"""Installs the CPU build of torch into the running interpreter's environment (the Quickstart's first step).

An unpinned ``pip install torch`` on Linux x86_64 (and Windows) takes the CUDA build: ~530 MB plus several GB
of CUDA wheels that a CPU machine never uses. So: where pip's configured sources already resolve ``torch`` to
a CPU build (a local wheel, macOS, aarch64 Linux), install that; otherwise take it from PyTorch's CPU wheel
index. A torch that is already installed is kept. ``SGLANG_BACKEND_TORCH=any`` lets pip choose freely (a GPU
machine that wants the CUDA build), ``SGLANG_BACKEND_TORCH=skip`` skips this step.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import urllib.parse

TORCH_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pip(*args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args] + (["-q"] if quiet else [])
    return subprocess.run(cmd, text=True, capture_output=True)


def installed_torch() -> str | None:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                           text=True, capture_output=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def resolved_wheel(spec: str) -> str | None:
    """The file name pip would install for ``spec`` from its configured sources (no download of torch)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        done = pip("install", "--dry-run", "--no-deps", "--ignore-installed", "--report", report, spec)
        if done.returncode != 0:
            return None
        with open(report) as f:
            items = json.load(f).get("install", [])
    urls = [i["download_info"]["url"] for i in items if i["metadata"]["name"].lower() == "torch"]
    return urllib.parse.unquote(urls[0].rsplit("/", 1)[-1]) if urls else None


def pypi_wheel_is_cuda(plat: str = sys.platform, machine: str = platform.machine()) -> bool:
    """On these platforms PyPI's torch wheel is the CUDA build; elsewhere (macOS, aarch64 Linux) it is CPU."""
    return plat == "win32" or (plat.startswith("linux") and machine.lower() in ("x86_64", "amd64"))


def use_configured_sources(wheel: str | None, pypi_is_cuda: bool) -> bool:
    """True when the wheel pip's own sources resolve to is a CPU build (else: PyTorch's CPU index)."""
    return bool(wheel) and ("+cpu" in wheel or not pypi_is_cuda)


def main() -> int:
    mode = os.environ.get("SGLANG_BACKEND_TORCH", "cpu")
    have = installed_torch()
    if mode == "skip" or (have and mode != "reinstall"):
        print(f"torch: keeping the installed torch {have}" if have else "torch: skipped (SGLANG_BACKEND_TORCH=skip)")
        return 0
    spec = f"torch=={TORCH_VERSION}"
    if mode == "any":
        print(f"torch: installing {spec} from pip's configured sources (SGLANG_BACKEND_TORCH=any)")
        return subprocess.call([sys.executable, "-m", "pip", "install", "-q", spec])
    wheel = resolved_wheel(spec)
    if use_configured_sources(wheel, pypi_wheel_is_cuda()):
        print(f"torch: installing {wheel} (CPU build, from pip's configured sources)")
        done = pip("install", spec, quiet=False)
    else:
        print(f"torch: installing {spec} CPU build from {CPU_INDEX} (PyPI's wheel here is the multi-GB CUDA build)")
        # The local version "+cpu" exists only on the CPU index; torch's own dependencies come from either.
        done = pip("install", "--timeout", "30", "--retries", "2", "--extra-index-url", CPU_INDEX,
                   f"{spec}+cpu" if pypi_wheel_is_cuda() else spec, quiet=False)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        sys.stderr.write(
            f"\nCould not install the CPU build of {spec}.\n"
            f"  - If this machine cannot reach {CPU_INDEX}, install a CPU torch yourself into this environment\n"
            f"    ({sys.executable} -m pip install <torch-{TORCH_VERSION}+cpu wheel>) and run the command again;\n"
            f"  - or let pip choose (the CUDA build on Linux x86_64, several GB): SGLANG_BACKEND_TORCH=any.\n")
        return 1
    print(f"torch: {installed_torch()} installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
