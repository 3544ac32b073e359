"""What one forward pass needs to know: which tokens, where their KV goes, and each request's layout."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ...utils import to_device_async


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens (a prompt, a chunk of one, or a jump-forward tail) after a cached prefix
    DECODE = "decode"  # exactly one new token per request

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slot each new token writes
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs] total length including the new tokens
    seq_lens_cpu: list[int]
    # Extend only: per request, cached prefix length and number of new tokens.
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    # Rows of the hidden states whose logits are needed (last token of each request, plus prompt-logprob spans).
    logits_indices: torch.Tensor | None = None
    # Extend only, multimodal models: per request its MultimodalInputs (or None); None when no request has any.
    mm_inputs: list | None = None
    # Decode: False when the scheduler knows the requests share no KV prefix long enough for cascade attention
    # (which reads a shared prefix once) to pay (``cascade_worthwhile``); True when unknown.
    shares_prefix: bool = True
    # Extend, embedding requests: per request, the rows [start, end) whose final hidden states it pools (None:
    # none); the model runner leaves each span's fp32 sum in ``pooled_sums`` (None where the span is None).
    pool_spans: list | None = None
    pooled_sums: list | None = None
    # Filled in by the model runner.
    req_to_token_pool: object = None
    token_to_kv_pool: object = None
    attn_backend: object = None
    kernel_options: object = None  # layers.kernel_options.KernelOptions: which kernels the layers run

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


def cascade_worthwhile(req_to_token_pool, rows: list[int], cached_lens: list[int], min_saved_reads: int) -> bool:
    """Whether a decode batch (its requests' table rows and cached KV lengths) shares a prefix long enough that
    reading it once instead of once per request saves ``min_saved_reads`` token reads per layer: what the
    cascade's extra kernels (a prefix pass and a merge per layer) cost. 0: any shared first slot will do."""
    if not rows:
        return True
    n = max(1, -(-min_saved_reads // max(len(rows) - 1, 1)))
    return n <= min(cached_lens) and req_to_token_pool.shares_prefix(rows, n)


def upload_int64(parts: list, device) -> list:
    """The int64 vectors ``parts`` (lists of ints or host tensors) on ``device`` through one host-to-device copy
    that does not wait for queued GPU work (``to_device_async``), as views of one buffer. Each view starts on a
    16-byte boundary: Triton specialises a kernel on its pointers' alignment, so views at odd offsets would
    compile other variants mid-run."""
    host = [p.to(torch.int64).flatten() if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.int64)
            for p in parts]
    starts, total = [], 0
    for t in host:
        starts.append(total)
        total += t.numel() + t.numel() % 2
    buf = torch.zeros(total, dtype=torch.int64)
    for t, start in zip(host, starts):
        buf[start : start + t.numel()] = t
    buf = to_device_async(buf, device)
    return [buf[start : start + t.numel()] for t, start in zip(host, starts)]
