"""CUDA graphs for the decode step.

For each batch size in ``capture_bs`` the whole decode forward (the model's own forward with the runner's kernel
options: embedding, all layers, final norm, lm_head, fp32 logits) is captured once over static input buffers.
Changing the kernel options means capturing again (``ModelRunner.set_kernel_options``). A step of batch size ``bs`` copies its five index
tensors into the first ``bs`` rows of those buffers, resets the padding rows (token 0 at position 0 writing
its KV into the reserved padding slot 0, reading one token of request row 0), replays the graph of the next
captured size and returns the first ``bs`` rows of its logits. Per step that is ~10 tiny copies and one
``cudaGraphLaunch`` instead of ~300 kernel launches.

With cascade attention (triton backend, batches of CASCADE_MIN_BS and more) a batch size has two graphs: one
for batches whose requests share a KV prefix long enough to pay for cascade mode (read once per batch) and one
for the rest (no prefix kernel, no separate merge kernel); ``ForwardBatch.shares_prefix`` picks.

The returned logits live in the graph's output buffer: they are valid until the next replay (the scheduler
samples from them before the next forward).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from .forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

DEFAULT_CAPTURE_BS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]


class CudaGraphRunner:
    def __init__(self, model_runner, capture_bs: list[int] | None = None):
        self.mr = model_runner
        max_bs = int(model_runner.server_args.max_running_requests)
        sizes = sorted({b for b in (capture_bs or DEFAULT_CAPTURE_BS) if b <= max_bs})
        if not sizes or (sizes[-1] < max_bs and max_bs <= DEFAULT_CAPTURE_BS[-1]):
            sizes.append(max_bs)
        self.capture_bs = sizes
        self.max_bs = sizes[-1]
        dev = model_runner.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        # Keyed by (batch size, shares_prefix): with cascade attention, batch sizes from CASCADE_MIN_BS up
        # have a graph for batches that may share a prefix and one for batches that share none.
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = None
        self.stream = torch.cuda.Stream(device=dev)
        self.capture()

    def _batch(self, bs: int) -> ForwardBatch:
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,
        )
        fb.req_to_token_pool = self.mr.req_to_token_pool
        fb.token_to_kv_pool = self.mr.token_to_kv_pool
        fb.attn_backend = self.mr.attn_backend
        fb.kernel_options = self.mr.kernel_options.for_tokens(bs)
        return fb

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        backend = self.mr.attn_backend
        torch.cuda.synchronize()
        for bs in reversed(self.capture_bs):  # largest first: smaller graphs reuse its memory pool
            for shared in backend.decode_graph_variants(bs):
                fb = self._batch(bs)
                backend.init_forward_metadata_capture(bs, shared)
                with torch.cuda.stream(self.stream):
                    for _ in range(2):  # compile the kernels, warm cuBLAS outside the capture
                        self.mr._logits_all_rows(fb)
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    out = self.mr._logits_all_rows(fb)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs, shared] = graph
                self.outputs[bs, shared] = out
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.capture_bs,
                    time.perf_counter() - t0)

    def can_run(self, fb: ForwardBatch) -> bool:
        if not fb.forward_mode.is_decode() or fb.batch_size > self.max_bs:
            return False
        # Decode computes the logits of every row; anything else takes the eager path.
        return fb.logits_indices is None or fb.logits_indices.shape[0] == fb.batch_size

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        pbs = self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        self.positions[:bs].copy_(fb.positions, non_blocking=True)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc, non_blocking=True)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(fb.seq_lens, non_blocking=True)
        if pbs > bs:
            self.input_ids[bs:pbs].zero_()
            self.positions[bs:pbs].zero_()
            self.out_cache_loc[bs:pbs].zero_()  # the reserved padding slot
            self.req_pool_indices[bs:pbs].zero_()
            self.seq_lens[bs:pbs].fill_(1)
        key = (pbs, fb.shares_prefix) if (pbs, fb.shares_prefix) in self.graphs else (pbs, False)
        # Cascade decode: the graph reads the batch's shared prefix length.
        self.mr.attn_backend.update_shared_prefix(self.mr.req_to_token_pool, self.req_pool_indices[:bs],
                                                  fb.seq_lens_cpu, pbs, key[1])
        self.graphs[key].replay()
        return self.outputs[key][:bs]
