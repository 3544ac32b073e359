"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over the paged KV pool.

Our own modules, not HF's: tokens of many requests are packed into one flat [num_tokens, hidden] batch and
attention goes through the batch's backend. Arithmetic follows HF's reference so greedy outputs match it.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
import torch.nn.functional as F

from ..layers.layernorm import RMSNorm
from ..layers.radix_attention import RadixAttention
from ..layers.rotary_embedding import RotaryEmbedding, apply_rotary


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen2 always has q/k/v biases; Llama may via attention_bias.
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        # q, k and v in one matmul (weights are concatenated at load time).
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2")
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id)

    def forward(self, hidden, cos, sin, forward_batch):
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.reshape(-1, self.num_heads, self.head_dim), cos, sin).reshape(-1, self.q_size)
        k = apply_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), cos, sin).reshape(-1, self.kv_size)
        out = self.attn(q, k, v, forward_batch)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, forward_batch):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, forward_batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        # input_embeds: multimodal models pass embeddings with image features already merged in.
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, forward_batch)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        """Returns final hidden states [num_tokens, hidden]; logits are computed only where needed."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight).float()

    # Weight loading: HF names in, merged q/k/v and gate/up out.
    _stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in self._stacked:
                merged, shard = self._stacked[parts[-2]]
                parts[-2] = merged
            target = ".".join(parts)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                    param.copy_(tensor)
                else:
                    self._shard_view(target, shard, param).copy_(tensor)
            loaded.add(f"{target}#{shard}" if shard is not None else target)
        expected = set()
        for name in params:
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                expected |= {f"{name}#{i}" for i in range(3)}
            elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _shard_view(self, target: str, shard: int, param: torch.Tensor) -> torch.Tensor:
        if "qkv_proj" in target:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights at the config's shapes (benchmarks, tests): normal(0, initializer_range), norms 1."""
        gen = torch.Generator().manual_seed(seed)
        std = float(getattr(self.config, "initializer_range", 0.02))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


EntryClass = [LlamaForCausalLM]
