"""Attention backend interface: write this layer's new K/V into the paged pool, then attend."""

from __future__ import annotations

import torch


def device_table(req_to_token_pool) -> torch.Tensor:
    """The req_to_token table the kernels read (the GPU mirror when the pool keeps its table on the host)."""
    return getattr(req_to_token_pool, "device_table", req_to_token_pool.req_to_token)


class AttentionBackend:
    def init_forward_metadata(self, forward_batch) -> None:
        """Per-batch precomputation shared by all layers (index tensors, masks)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, forward_batch) -> torch.Tensor:
        """q: [T, H*D]; k, v: [T, Hkv*D] for the new tokens. Returns [T, H*D]."""
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch):
        raise NotImplementedError

    def forward_decode(self, q, k, v, layer, forward_batch):
        raise NotImplementedError
