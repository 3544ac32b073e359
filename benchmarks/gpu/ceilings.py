"""The hardware ceilings the other figures are compared with, measured on random data: device-to-device copy
bandwidth (bytes read + written; the floor of a memory-bound decode step) and a dense 8192^3 matmul rate per
half-precision dtype (the roof of prefill)."""

from __future__ import annotations

import statistics

import torch

from benchmarks.gpu.common import RESULT, cuda_time, log, section


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device copy of 2 GiB buffers (three sources rotated, past the L2)."""
    n = 1 << 30  # 2 GiB per buffer in fp16
    bufs = [torch.empty(n, dtype=torch.float16, device="cuda").normal_() for _ in range(3)]
    dst = torch.empty_like(bufs[0])
    i = [0]

    def copy():
        dst.copy_(bufs[i[0] % 3])
        i[0] += 1

    t = statistics.median(cuda_time(copy, 20, 3))
    bw = 2 * bufs[0].numel() * 2 / t
    del bufs, dst
    torch.cuda.empty_cache()
    return bw


def matmul_rate(dt) -> float:
    """FLOP/s of an 8192^3 matmul in ``dt`` (two left operands rotated)."""
    m = 8192
    a = [torch.randn(m, m, device="cuda", dtype=dt) for _ in range(2)]
    b = torch.randn(m, m, device="cuda", dtype=dt)
    j = [0]

    def mm():
        torch.mm(a[j[0] % 2], b)
        j[0] += 1

    tm = statistics.median(cuda_time(mm, 20, 5))
    del a, b
    return 2 * m**3 / tm


@section("ceilings")
def ceilings(dtype):
    bw = copy_bandwidth()
    rates = {str(dt).replace("torch.", ""): matmul_rate(dt) for dt in (torch.float16, torch.bfloat16)}
    RESULT["ceilings"] = {"copy_bw_Bps": bw, "matmul_flops": rates}
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s; matmul " + ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in rates.items()))
    torch.cuda.empty_cache()
