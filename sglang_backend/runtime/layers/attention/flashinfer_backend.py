"""FlashInfer attention backend (optional: ``pip install flashinfer-python``; ``--attention-backend flashinfer``).

FlashInfer's paged wrappers over our KV pool: prefill/append (a ragged batch of new tokens over its cached
prefix, causal, bottom-right aligned) with ``BatchPrefillWithPagedKVCacheWrapper`` and decode with
``BatchDecodeWithPagedKVCacheWrapper``. Our pool is token-granular (``req_to_token`` names a slot per token), so
each slot is presented as a page of one token: the K and V buffers ``[slots, Hkv, D]`` become
``[slots, 1, Hkv, D]`` (layout "NHD") without a copy, and a request's page list is its row of ``req_to_token``.

Per batch, ``init_forward_metadata`` plans both wrappers' work once for all layers: the index pointers are
built on the host from the batch's host-side lengths, the page indices on the GPU by a small Triton kernel
that copies each request's table row (no device-to-host sync, so overlapped decode still overlaps). Decode
runs eagerly: FlashInfer's plan is host work per batch, which a captured CUDA graph would freeze (the triton
backend is the one with CUDA graphs). fp16 and bf16 only (FlashInfer has no fp32 kernels).

Sliding-window layers: FlashInfer's window is a planned parameter, ``window_left`` (the query at position i sees
keys i - window_left .. i; -1: all), so our window W (the last W positions including the query's own, HF's rule)
is ``window_left = W - 1``; attention softcapping is ``logits_soft_cap``. A plan holds one of each, so every
distinct (window, cap) of the model gets its own pair of wrappers (Gemma 3: two), planned by the first layer
using it in each batch; they share the float workspace, as their runs never overlap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .base import AttentionBackend, device_table

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partials)
# Head sizes FlashInfer's prefill kernels are built for (others fail inside the kernel dispatch at run time).
HEAD_DIMS = (64, 128, 256)


@triton.jit
def _kv_page_indices_kernel(Table, stride_t, Rows, Starts, Lens, Out, BLOCK: tl.constexpr):
    """Out[Starts[i] : Starts[i] + Lens[i]] = Table[Rows[i], : Lens[i]] (as int32), one program per request."""
    i = tl.program_id(0)
    row = tl.load(Rows + i).to(tl.int64)
    start = tl.load(Starts + i)
    n = tl.load(Lens + i)
    for j0 in range(0, n, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(Table + row * stride_t + offs, mask=mask, other=0)
        tl.store(Out + start + offs, slots.to(tl.int32), mask=mask)


def kv_page_indices(table: torch.Tensor, rows: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(indptr on the host, indices on the table's device), both int32: request i's pages are its first
    ``lens[i]`` slots of ``table[rows[i]]``."""
    n = torch.tensor(lens, dtype=torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = n.cumsum(0)
    total = int(indptr[-1])
    out = torch.empty(max(total, 1), dtype=torch.int32, device=table.device)[:total]
    if lens:
        meta = torch.stack([indptr[:-1], n])
        if table.is_cuda:
            meta = meta.pin_memory()
        meta = meta.to(table.device, non_blocking=True)
        _kv_page_indices_kernel[(len(lens),)](table, table.stride(0), rows, meta[0], meta[1], out, BLOCK=256)
    return indptr, out


class FlashInferAttnBackend(AttentionBackend):
    # The backend writes the new tokens' K/V itself (no fused store), and decode is not captured in CUDA graphs
    # (the base class's declarations).

    def __init__(self, model_runner):
        try:  # optional dependency
            import flashinfer
        except ImportError as e:
            raise RuntimeError("--attention-backend flashinfer needs the flashinfer-python package "
                               "(pip install flashinfer-python), or use --attention-backend triton") from e
        dtype = model_runner.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"--attention-backend flashinfer runs float16 and bfloat16 models, not {dtype}; "
                             "use --dtype float16/bfloat16 or --attention-backend triton")
        self.dtype = dtype
        self.device = torch.device(model_runner.device)
        self.num_heads = model_runner.num_heads  # this rank's heads
        self.num_kv_heads = model_runner.num_kv_heads
        self.head_dim = model_runner.token_to_kv_pool.head_dim
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"--attention-backend flashinfer supports head sizes {HEAD_DIMS}; this model's is "
                             f"{self.head_dim}: use --attention-backend triton")
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._flashinfer = flashinfer
        self.wrappers: dict[tuple, tuple] = {}  # (window_left, soft cap) -> (decode wrapper, prefill wrapper)
        self.planned: set[tuple] = set()  # the keys planned for the current batch
        self.pages = None  # (indptr, indices) of the current batch
        self.sm_scale: float | None = None  # planned with this; every layer must use it

    def _wrappers(self, key: tuple) -> tuple:
        if key not in self.wrappers:
            fi = self._flashinfer
            self.wrappers[key] = (
                fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                     use_tensor_cores=self.num_heads // self.num_kv_heads >= 4),
                fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD"))
        return self.wrappers[key]

    def _plan(self, fb, scale: float, key: tuple) -> None:
        lens = list(fb.seq_lens_cpu)
        if self.pages is None:  # the batch's page lists, shared by its plans
            self.pages = kv_page_indices(device_table(fb.req_to_token_pool), fb.req_pool_indices, lens)
        indptr, indices = self.pages
        last_page_len = torch.ones(len(lens), dtype=torch.int32)  # one-token pages are always full
        window_left, cap = key
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=scale)
        if window_left >= 0:  # else FlashInfer's defaults (window_left=-1, no soft cap), as before windows
            common["window_left"] = window_left
        if cap is not None:
            common["logits_soft_cap"] = cap
        decode_wrapper, prefill_wrapper = self._wrappers(key)
        if fb.forward_mode.is_decode():
            decode_wrapper.plan(indptr, indices, last_page_len, self.num_heads, self.num_kv_heads,
                                self.head_dim, 1, **common)
        else:
            qo_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int32).cumsum(0)
            prefill_wrapper.plan(qo_indptr, indptr, indices, last_page_len, self.num_heads,
                                 self.num_kv_heads, self.head_dim, 1, causal=True, **common)
        self.sm_scale = scale
        self.planned.add(key)

    def init_forward_metadata(self, fb) -> None:
        self.sm_scale = None  # planned by the first layer, which brings the softmax scale
        self.planned = set()
        self.pages = None

    def forward(self, q, k, v, layer, fb, save_kv: bool = True):
        window = layer.sliding_window
        key = (-1 if window is None else window - 1, layer.logit_cap)  # window_left: see the module docstring
        if self.sm_scale is not None and layer.scaling != self.sm_scale:
            raise ValueError(f"flashinfer backend: layer {layer.layer_id} has softmax scale {layer.scaling}, "
                             f"the batch was planned with {self.sm_scale}")
        if key not in self.planned:
            self._plan(fb, layer.scaling, key)
        pool = fb.token_to_kv_pool
        lid = layer.layer_id
        if save_kv:
            pool.set_kv_buffer(lid, fb.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
                               v.view(-1, layer.num_kv_heads, layer.head_dim))
        kv = (pool.get_key_buffer(lid).unsqueeze(1), pool.get_value_buffer(lid).unsqueeze(1))  # one-token pages
        q = q.reshape(-1, layer.num_heads, layer.head_dim).contiguous()
        decode_wrapper, prefill_wrapper = self.wrappers[key]
        wrapper = decode_wrapper if fb.forward_mode.is_decode() else prefill_wrapper
        return wrapper.run(q, kv).reshape(-1, layer.num_heads * layer.head_dim)
