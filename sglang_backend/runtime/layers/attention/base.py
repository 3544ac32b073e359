"""Attention backend interface: write this layer's new K/V into the paged pool, then attend.

The whole contract is declared here, capabilities included, so the model runner, the CUDA graph runner and the
layers ask a backend directly instead of probing it:

* ``supports_fused_kv_store``: the model may write the new tokens' K/V into the pool itself (fused with rotary,
  see RadixAttention.forward_qkv) and then call ``forward(..., save_kv=False)``;
* ``supports_cuda_graph``: decode can be captured in CUDA graphs (``init_forward_metadata_capture``,
  ``decode_graph_variants`` and ``update_shared_prefix`` are then implemented);
* ``num_cascade_steps``: decode steps that ran in cascade mode (a statistic; 0 where there is none).

Every backend honours the layer's ``sliding_window`` (None: global; W: the query at position i sees keys
i - W < j <= i, HF's rule) on extend and decode alike, and may reject a ``logit_cap`` it cannot apply
(layers/radix_attention.py).
"""

from __future__ import annotations

import torch


def device_table(req_to_token_pool) -> torch.Tensor:
    """The req_to_token table the kernels read (the GPU mirror when the pool keeps its table on the host)."""
    return getattr(req_to_token_pool, "device_table", req_to_token_pool.req_to_token)


class AttentionBackend:
    supports_fused_kv_store: bool = False
    supports_cuda_graph: bool = False
    num_cascade_steps: int = 0

    def init_forward_metadata(self, forward_batch) -> None:
        """Per-batch precomputation shared by all layers (index tensors, masks)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, forward_batch,
                save_kv: bool = True) -> torch.Tensor:
        """q: [T, H*D]; k, v: [T, Hkv*D] for the new tokens (already in the pool when ``save_kv`` is False).
        Returns [T, H*D]."""
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv: bool = True):
        raise NotImplementedError

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv: bool = True):
        raise NotImplementedError

    # CUDA graphs (supports_cuda_graph) -------------------------------------------------------------------------
    def init_forward_metadata_capture(self, bs: int, shares_prefix: bool = True) -> None:
        """Decode metadata for a CUDA graph of (padded) batch size bs."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def decode_graph_variants(self, bs: int) -> tuple[bool, ...]:
        """The ``shares_prefix`` values whose decode graphs differ at batch size bs."""
        return (False,)

    def update_shared_prefix(self, req_to_token_pool, req_pool_indices, seq_lens_cpu, padded_bs: int,
                             shares_prefix: bool = True) -> None:
        """Before a graph replay: refresh what the graph reads about the batch beyond its index tensors."""
