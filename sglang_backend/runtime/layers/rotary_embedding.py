"""Rotary position embedding computed from explicit positions (requests in a batch sit at different offsets).

Frequencies come from transformers' rope-init functions, so every rope type a config names (llama3, linear,
yarn, longrope) scales exactly as the HF reference does.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)  # transformers >= 5
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int):
        super().__init__()
        params = rope_parameters(config)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise NotImplementedError("dynamic NTK rope scaling depends on the running length; not supported yet")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise NotImplementedError(f"rope type {rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin
