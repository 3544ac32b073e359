"""Rotary position embedding computed from explicit positions (requests in a batch sit at different offsets).

Frequencies come from transformers' rope-init functions, so every rope type a config names (llama3, linear,
yarn, longrope) scales exactly as the HF reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RopeBatch:
    """Rotary inputs of one batch: the reference path's ``cos``/``sin`` rows [T, D] in the activations' dtype,
    or (fused kernels) the fp32 ``table`` [max_positions, D] (cos in the first D/2 columns, sin in the last)."""
    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    table: torch.Tensor | None = None


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's rope parameters; ``layer_type``: those of one kind of layer, for configs that give each kind
    its own (Gemma 3: "full_attention" / "sliding_attention")."""
    params = getattr(config, "rope_parameters", None)  # transformers >= 5
    if params and layer_type is not None:
        return dict(params[layer_type])
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    """``layer_type``: the frequencies of that kind of layer, where the config has one set per kind (Gemma 3)."""

    def __init__(self, config, head_dim: int, layer_type: str | None = None):
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise NotImplementedError("dynamic NTK rope scaling depends on the running length; not supported yet")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # deferred: heavy, rarely needed

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise NotImplementedError(f"rope type {rope_type!r} is not supported")
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)
        self._table: torch.Tensor | None = None  # the fused kernels' cos|sin table (not a buffer: stays fp32)

    def _apply(self, fn, recurse=True):
        """``module.to(dtype)`` would round the frequencies to the serving dtype: they stay fp32, as HF keeps
        them (the model runner's cast of the whole model reaches every rotary embedding of a model)."""
        inv_freq = self.inv_freq
        out = super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = inv_freq.to(device=self.inv_freq.device)
        return out

    def for_batch(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool, max_positions: int) -> RopeBatch:
        if fused:
            return RopeBatch(positions, table=self.table(max_positions, positions.device))
        cos, sin = self.cos_sin(positions, dtype)
        return RopeBatch(positions, cos, sin)

    def table(self, max_positions: int, device) -> torch.Tensor:
        """cos | sin (times the rope scaling) of positions 0 .. max_positions - 1, fp32, built once per device
        with the same fp32 arithmetic as ``cos_sin`` (positions.float() * inv_freq)."""
        t = self._table
        if t is None or t.shape[0] < max_positions or t.device != torch.device(device):
            inv_freq = self.inv_freq.to(device=device, dtype=torch.float32)
            pos = torch.arange(max_positions, device=device, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq[None, :]
            scale = self.attention_scaling
            t = self._table = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).contiguous()
        return t

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
