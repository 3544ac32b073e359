"""GPU benchmark: our engine (triton attention, CUDA graphs) vs the hardware ceilings and vs HF transformers
``generate``, measured in one run on one GPU.

Model: dummy (random) weights at Llama-2-7B shape in fp16 (``--model llama2-7b``) or Llama-3-8B shape in bf16
(``--model llama3-8b``, GQA 32/8); throughput does not depend on weight values.

    python -m benchmarks.bench_gpu                       # the default sections, Llama-2-7B fp16
    python -m benchmarks.bench_gpu --model llama3-8b --only ceilings,attn_sweep,runner,engine_decode
    python -m benchmarks.bench_gpu --smoke               # tiny model, seconds (a GPU is still needed)

Sections (``--only``, comma-separated; they run in this order whatever the order given):

* ceilings: device-to-device copy bandwidth (bytes read + written) and a dense 8192^3 matmul rate, on random
  data: the references of the figures below.
* correctness: worst error of the kernels vs float64 references on fresh random inputs.
* pdl_probe: a chain of dependent GEMVs with and without programmatic dependent launch, eager and graphed:
  whether PDL shortens the gaps between dependent kernels on this GPU.
* attn_sweep: decode-attention launch configs and split counts; the fastest become this run's kernel configs,
  which the engines made afterwards load.
* cascade_sweep: cascade decode (a prefix shared by the batch) at the shared-prefix shape: the prefix kernel's
  configs and programs per SM, then the per-request part's config (the "cascade" entry); the same file.
* attn_layout: decode attention over the engine's KV layout at the offline shape, ours vs FlashInfer.
* gemv_sweep: cuBLAS vs the Triton GEMV for each single-row linear (decode at batch 1).
* hf: HF ``generate`` decode step (batch 1 and 64, 1k context) and shared-prefix requests/s, in batches of 32.
* profile: per-kernel time of an eager decode step.
* gemv_step_sweep: the fused GEMV's launch configs per weight shape, judged by the whole batch-1 step.
* runner: decode step at batch 1 and 64 with 1k context through ``ModelRunner.forward`` (graph replay, back to
  back and with a per-step argmax read as the scheduler does) vs the bandwidth floor = (weights + KV read per
  step) / copy bandwidth, for each kernel variant; prefill of 8 x 1024 tokens, FLOP/s vs the matmul rate.
* runner_shared: decode at batch 128 over a shared 1k prefix vs private prefixes.
* engine_decode: the engine's own per-step time (whole scheduler loop) from ``Engine.generate``.
* engine_trace: GPU timeline of the engine loop: kernel time and idle gaps per step.
* cpu_profile: where the scheduler thread's CPU time goes.
* shared: 128 requests = one 1024-token prefix + 64 unique tokens each, 32 output tokens (greedy), requests/s.
* shared_trace: the same workload once under the profiler: GPU time by kernel kind, idle time, longest gaps.
* offline: 1k in / 1k out, as many requests as fit the KV pool in one wave (at most 64), output tokens/s.
* no_overlap, no_pdl: engine_decode and offline on an engine with the overlapped scheduler, or PDL, off.
* no_radix: shared on an engine without the radix cache.

Writes ``$OUT/gpu_<model>.json`` when $OUT is set, else ``benchmarks/results/gpu_<model>.json`` (or
``--output``). The sections live in ``benchmarks/gpu/`` (registry.py lists them).
"""

from __future__ import annotations

import sys

from benchmarks.gpu import cli
from benchmarks.gpu.common import MODELS, make_model_dir  # noqa: F401 - used by benchmarks/suite (preset gpu)


def main(argv=None) -> int:
    return cli.main(argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
