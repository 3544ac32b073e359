"""Host KV tier copy speed on the GPU (issue 26): ``HostKVPool.backup`` (device -> pinned host) and ``restore``
(host -> device), each timed to completion, at Llama-3-8B's KV shape (32 layers x 8 KV heads x 128, bf16:
128 KiB per token) for 1k, 4k and 16k scattered slots; the third of three repeats is kept. Needs CUDA.

    python -m benchmarks.bench_host_tier --out benchmarks/results/host_tier_copy_h200.json
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=40000, help="device pool and host tier size, tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch  # deferred: --help without torch

    from sglang_backend.runtime.mem_cache.host_pool import HostKVPool
    from sglang_backend.runtime.mem_cache.memory_pool import MHATokenToKVPool

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = MHATokenToKVPool(args.slots, torch.bfloat16, 8, 128, 32, "cuda")
    host = HostKVPool(dev, args.slots)
    result = {}
    for n in (1024, 4096, 16384):
        src, dst = torch.randperm(args.slots)[:n] + 1, torch.randperm(args.slots)[:n] + 1
        slots = host.alloc(n)
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.backup(src, slots)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            host.restore(slots, dst)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        gb = n * dev.bytes_per_token(8, 128, 32, torch.bfloat16) / 1e9
        result[n] = dict(backup_ms=(t1 - t0) * 1e3, restore_ms=(t2 - t1) * 1e3, gb=gb, backup_gbps=gb / (t1 - t0),
                         restore_gbps=gb / (t2 - t1))
        print(n, result[n], flush=True)
        host.free(slots)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
