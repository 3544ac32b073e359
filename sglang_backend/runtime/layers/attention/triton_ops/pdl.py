"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

A decode step is a chain of ~250 small kernels; without PDL each one starts only after the previous one has
fully drained, and the gap (launch, ramp-up, tail) costs a few microseconds per kernel, ~0.5 ms of a 6 ms
batch-1 step. With PDL a kernel launched with ``launch_pdl=True`` may start while its predecessor is still
running: it first does what does not depend on the predecessor (the GEMV prefetches its weights), then waits
(``griddepcontrol.wait``: the predecessor has completed and its writes are visible) before it reads
activations or writes anything. Every kernel that launches this way calls :func:`pdl_begin` before its first
dependent access, in every program, so the ordering stays transitive along the whole chain. Kernels launched
without PDL (cuBLAS, torch ops) keep ordinary stream order.

On by default on sm90+. On an H100, inside the decode CUDA graphs (Llama-2-7B fp16, 1k context, batch 1, the
fused GEMV with rotary, merge folded into attention stage 1): 5.21 ms per step with PDL vs 5.38 ms without
(benchmarks/bench_gpu.py ``runner`` times both, 2026-11-21); batch 64 19.12 vs 19.14 ms. (An earlier kernel set
with fewer, longer GEMV programs had measured no gain.) ``--pdl off`` (``KernelOptions.pdl``, passed to every
launch) turns it off; ``auto`` (the default) leaves it off for one-token batches of grouped-query models, whose step
measured faster without it (Llama-3-8B on an H200, Qwen3-8B on an H100); never under the Triton interpreter or on older
GPUs, where the instructions do not exist.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ..... import environ


def _triton_has_pdl() -> bool:
    """Triton 3.3+ has both the ``launch_pdl`` launch option and the griddepcontrol intrinsics; older ones would
    reject the option, so PDL stays off there."""
    try:  # the NVIDIA backend's module layout differs between Triton versions
        from triton.backends.nvidia.compiler import CUDAOptions

        return ("launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
                and hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents"))
    except Exception:  # noqa: BLE001 - any other Triton layout: no PDL
        return False


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    if environ.TRITON_INTERPRET.get() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _triton_has_pdl()


def supported(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t``'s device can launch with PDL."""
    return t.device.type == "cuda" and _supported(t.device.index or 0)


def launch_args(t: torch.Tensor, enabled: bool) -> dict:
    """Keyword arguments for launching a kernel (with a ``PDL: tl.constexpr`` parameter) on ``t``'s device:
    with PDL when ``enabled`` (``KernelOptions.pdl``) and the device and Triton support it."""
    on = enabled and supported(t)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}  # (older Triton lacks launch_pdl)


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Waits for the preceding kernel (when launched with PDL) and lets the next one start launching."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
