"""Gemma 3 text decoder (``Gemma3ForCausalLM``, config ``gemma3_text``: Gemma 3 270M / 1B and the text stacks of
the larger ones) over the paged KV pool.

What differs from Llama (models/llama.py), all following HF's ``modeling_gemma3``:

* RMSNorms scale by ``1 + w`` in fp32 (``GemmaRMSNorm``), and every layer has four: before and after attention,
  before and after the MLP; the residual adds come after the post-norms;
* q and k are RMS-normalised per head (``q_norm`` / ``k_norm``, also ``1 + w``) before rotary;
* the MLP is GeGLU: gelu(tanh approximation)(gate) * up;
* embeddings are multiplied by sqrt(hidden_size) rounded to the embedding dtype, as HF's scaled embedding does;
* the softmax scale is ``query_pre_attn_scalar ** -0.5``, not head_dim's;
* ``layer_types`` interleaves local layers ("sliding_attention": each token sees the last ``sliding_window``
  positions, itself included, see layers/radix_attention.py) with global ones ("full_attention"); local layers
  rotate with their own frequencies (``rope_parameters["sliding_attention"]``, HF's ``rope_local_base_freq``),
  global ones with ``rope_parameters["full_attention"]`` (``rope_theta`` and its rope scaling);
* attention and final logit softcapping (None in Gemma 3) are honoured when a config sets them (attention
  softcapping: torch_native and flashinfer backends only);
* input and output embeddings are tied unless the config says otherwise.

Memory: the KV pool and the radix cache keep every token's K/V in every layer, local ones included (simpler, and
a cached prefix serves both kinds of layer); the window only limits what local layers attend to, so no memory is
saved for them.

The norms, GeGLU and embedding scale run as torch ops on every device (the fused Triton kernels of the Llama path
round as Llama does); the linears, rotary + KV store and attention use the batch's kernels as Llama's do.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.parallel_state import get_tp_rank, kv_head_range, split_evenly
from ..layers.activation import gelu_tanh_and_mul
from ..layers.kernel_options import KernelOptions
from ..layers.layernorm import GemmaRMSNorm
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..layers.radix_attention import RadixAttention
from ..layers.rotary_embedding import RopeBatch, RotaryEmbedding
from .causal_lm import CausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_python_tanh")  # HF's names of the same tanh GELU


def check_config(config) -> None:
    """What this forward does not implement raises here, at build time."""
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act not in GELU_TANH:
        raise NotImplementedError(f"Gemma 3 hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    unknown = set(config.layer_types) - {SLIDING, FULL}
    if unknown or len(config.layer_types) < config.num_hidden_layers:
        raise NotImplementedError(f"Gemma 3 layer_types {config.layer_types!r}: expected one of {SLIDING!r} / "
                                  f"{FULL!r} per layer")


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = config.num_key_value_heads
        self.num_heads = split_evenly(total_heads, "num_attention_heads")
        kv_start, self.num_kv_heads = kv_head_range(total_kv_heads)
        self.head_dim = D = config.head_dim
        self.q_size = self.num_heads * D
        self.kv_size = self.num_kv_heads * D
        bias = bool(getattr(config, "attention_bias", False))
        kv_part = (total_kv_heads * D, kv_start * D, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [(total_heads * D, get_tp_rank() * self.q_size, self.q_size), kv_part, kv_part], bias)
        self.o_proj = RowParallelLinear(total_heads * D, config.hidden_size, bias)
        self.q_norm = GemmaRMSNorm(D, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(D, config.rms_norm_eps)
        self.is_sliding = config.layer_types[layer_id] == SLIDING
        self.attn = RadixAttention(self.num_heads, D, config.query_pre_attn_scalar**-0.5, self.num_kv_heads,
                                   layer_id, sliding_window=config.sliding_window if self.is_sliding else None,
                                   logit_cap=getattr(config, "attn_logit_softcapping", None))

    def forward(self, hidden: torch.Tensor, rope: RopeBatch, forward_batch) -> torch.Tensor:
        opts = forward_batch.kernel_options
        q, k, v = self.qkv_proj(hidden, opts).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        D = self.head_dim
        q = self.q_norm(q.reshape(-1, D)).reshape(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, D)).reshape(-1, self.kv_size)
        qkv = torch.cat([q, k, v], dim=-1)  # rotary (+ the fused KV store) works on the fused layout
        return self.o_proj(self.attn.forward_qkv(qkv, rope, forward_batch), opts)


class Gemma3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.even(config.hidden_size, [config.intermediate_size] * 2, False,
                                                      "intermediate_size")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, "intermediate_size")

    def forward(self, x: torch.Tensor, opts: KernelOptions | None = None) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x, opts)), opts)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_id)
        self.mlp = Gemma3MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, rope: RopeBatch, forward_batch) -> torch.Tensor:
        """HF's order: x + post_norm(attn(norm(x))), then the same around the MLP."""
        attn = self.self_attn(self.input_layernorm(hidden), rope, forward_batch)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden), forward_batch.kernel_options)
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_config(config)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # The global layers' rotary is ``rotary_emb`` (the model runner looks it up by that name); the local ones'.
        self.rotary_emb = RotaryEmbedding(config, config.head_dim, FULL)
        self.rotary_emb_local = RotaryEmbedding(config, config.head_dim, SLIDING)
        self.embed_scale = config.hidden_size**0.5

    def scaled_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding * sqrt(hidden), the factor rounded to the embedding dtype first (HF's buffer lives in it)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * float(torch.tensor(self.embed_scale, dtype=hidden.dtype))

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        fb = forward_batch
        opts = fb.kernel_options
        hidden = self.scaled_embedding(input_ids)
        fused = opts is not None and (opts.fused_ops or opts.native_cpu)  # rotary from the cos|sin table
        max_positions = fb.req_to_token_pool.max_context_len if fused else 0
        ropes = {FULL: self.rotary_emb.for_batch(positions, hidden.dtype, fused, max_positions)}
        if SLIDING in self.config.layer_types:
            ropes[SLIDING] = self.rotary_emb_local.for_batch(positions, hidden.dtype, fused, max_positions)
        for layer in self.layers:
            hidden = layer(hidden, ropes[SLIDING if layer.self_attn.is_sliding else FULL], fb)
        return self.norm(hidden)


class Gemma3ForCausalLM(CausalLM):
    supports_cuda_graph = True
    dummy_norm_value = 0.0  # (1 + w) norms: zero is the identity

    def __init__(self, config):
        super().__init__(config, Gemma3Model(config), tie_by_default=True)


EntryClass = [Gemma3ForCausalLM]
