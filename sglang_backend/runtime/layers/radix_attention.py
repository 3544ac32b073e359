from torch import nn


class RadixAttention(nn.Module):
    """One attention layer's identity; the batch's attention backend does the work over the paged KV pool."""

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(self, q, k, v, forward_batch):
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
