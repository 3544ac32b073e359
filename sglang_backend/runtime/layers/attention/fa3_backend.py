"""FlashAttention-3 prefill with the triton backend's decode (optional; ``--attention-backend fa3``, Hopper GPUs).

Prefill (new tokens after a cached prefix, or none) runs FlashAttention 3's varlen kernel, the FA3 build shipped
inside vLLM's wheel (``vllm.vllm_flash_attn``; ``pip install vllm``). On an H100 it reaches 340-570 TFLOP/s on
prompt shapes where our Triton extend kernel reaches 200-360 (benchmarks/results/README.md). Decode stays the
triton backend's (split-KV, cascade over a shared prefix, CUDA graphs): at decode FA3 has nothing to add.

Two ways in, per batch:
* no request has a cached prefix (cold prompts, the first chunk of a long one): the new tokens' K/V are attended
  in place, contiguous varlen (``cu_seqlens_k = cu_seqlens_q``), the kernel's TMA path;
* otherwise the pool itself, with one-token pages: the K/V buffers ``[slots, Hkv, D]`` viewed as
  ``[slots, 1, Hkv, D]``, and each request's page list its row of ``req_to_token`` (int32), as FlashInfer's
  backend does. FA3's causal mask is bottom-right aligned, which is exactly "the prefix plus the causal part".

Sliding windows: W (the query at i sees i - W < j <= i) is FA3's ``window_size = (W - 1, 0)``; attention
softcapping is its ``softcap`` at prefill, but the triton decode kernels have none, so a soft-capped model is
refused at decode as on the triton backend. fp16 and bf16 only; head sizes up to 256.
"""

from __future__ import annotations

import torch

from ....utils import to_device_async
from .triton_backend import TritonAttnBackend
from .base import device_table

MAX_HEAD_DIM = 256


def load_varlen():
    """FA3's varlen entry point, or a RuntimeError that says how to get it."""
    try:  # optional dependency: the FA3 build in vLLM's wheel
        from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported
    except ImportError as e:
        raise RuntimeError("--attention-backend fa3 needs FlashAttention 3 from vLLM's wheel (pip install vllm), "
                           "or use --attention-backend triton") from e
    if not is_fa_version_supported(3):
        raise RuntimeError("--attention-backend fa3: this GPU or build has no FlashAttention 3 (it needs a Hopper "
                           "GPU, sm90); use --attention-backend triton")
    return flash_attn_varlen_func


class FA3AttnBackend(TritonAttnBackend):
    def __init__(self, model_runner):
        dtype = model_runner.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"--attention-backend fa3 runs float16 and bfloat16 models, not {dtype}; "
                             "use --dtype float16/bfloat16 or --attention-backend triton")
        head_dim = model_runner.token_to_kv_pool.head_dim
        if head_dim > MAX_HEAD_DIM or head_dim % 8:
            raise ValueError(f"--attention-backend fa3 supports head sizes that are multiples of 8 up to "
                             f"{MAX_HEAD_DIM}; this model's is {head_dim}: use --attention-backend triton")
        self.varlen = load_varlen()
        super().__init__(model_runner)
        self.extend_metadata = None

    def init_forward_metadata(self, fb) -> None:
        if fb.forward_mode.is_decode():
            super().init_forward_metadata(fb)
            return
        extend, prefix = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        n = len(extend)
        meta = torch.zeros((2, n + 1), dtype=torch.int32)
        meta[0, 1:] = torch.tensor(extend, dtype=torch.int32).cumsum(0)  # cu_seqlens_q
        meta[1, :n] = torch.tensor(fb.seq_lens_cpu, dtype=torch.int32)  # seqused_k
        meta = to_device_async(meta, self.device)
        max_q, max_k = max(extend, default=0), max(fb.seq_lens_cpu, default=0)
        pages = None
        # A lone token may come from the one-token GEMV path, which stores its K/V without returning rotated k.
        if any(prefix) or sum(extend) == 1:  # the pool's one-token pages, each request's row of the table
            pages = device_table(fb.req_to_token_pool)[fb.req_pool_indices, :max_k].to(torch.int32)
        self.extend_metadata = (meta[0], meta[1, :n], max_q, max_k, pages)

    def forward_extend(self, q, k, v, layer, fb, save_kv: bool = True):
        if save_kv:
            self._save(k, v, layer, fb)
        cu_q, seqused_k, max_q, max_k, pages = self.extend_metadata
        T, H, Hkv, D = q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        window = [-1, -1] if layer.sliding_window is None else [layer.sliding_window - 1, 0]
        common = dict(softmax_scale=layer.scaling, causal=True, window_size=window, softcap=layer.logit_cap or 0.0,
                      fa_version=3)
        qv = q.view(T, H, D)
        if pages is None:  # cold: attend the new K/V where the projection left them
            o = self.varlen(qv, k.view(T, Hkv, D), v.view(T, Hkv, D), max_q, cu_q, max_q, cu_seqlens_k=cu_q,
                            **common)
        else:
            pool = fb.token_to_kv_pool
            o = self.varlen(qv, pool.get_key_buffer(layer.layer_id).unsqueeze(1),
                            pool.get_value_buffer(layer.layer_id).unsqueeze(1), max_q, cu_q, max_k,
                            seqused_k=seqused_k, block_table=pages, **common)
        return o.view(T, H * D)
