"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM; Qwen3-MoE and Mixtral) over the paged KV pool.
Qwen3 is Llama plus an RMSNorm over each head of q and of k before rotary (``LlamaAttention.q_norm`` /
``k_norm``) and no qkv bias; the MoE models replace the MLP of their sparse layers by ``layers.moe.SparseMoE``.

Our own modules, not HF's: tokens of many requests are packed into one flat [num_tokens, hidden] batch and
attention goes through the batch's backend. Arithmetic follows HF's reference so greedy outputs match it.

This is the only Llama forward, on the CPU and the GPU, eager and in CUDA graphs. The batch's kernel options
(``ForwardBatch.kernel_options``, from ServerArgs) pick the kernels inside the layers: on the GPU with fused ops,
RMSNorm adds the residual in the same Triton kernel, rotary and the KV store are one kernel in the attention
layer, SiLU-mul one kernel, and one-token batches run their linears as Triton GEMVs, which in the "fused" GEMV
modes also take in the norms and the residual adds (``LlamaDecoderLayer.forward_one_token``). Without them (CPU,
--disable-fused-ops) every layer is the torch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.parallel_state import get_tp_rank, kv_head_range, split_evenly
from ..layers import gguf_quant
from ..layers.activation import silu_and_mul
from ..layers.kernel_options import KernelOptions
from ..layers.layernorm import RMSNorm, head_rmsnorm
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..layers.moe import SparseMoE
from ..layers.radix_attention import RadixAttention
from ..layers.rotary_embedding import RopeBatch, RotaryEmbedding
from .causal_lm import CausalLM


def sliding_window_of(config, layer_id: int) -> int | None:
    """The layer's attention window, as HF applies it: every layer of Mistral, Mixtral and Qwen3-MoE when the
    config sets ``sliding_window``; Qwen2 and Qwen3 only the layers ``layer_types`` calls "sliding_attention"
    (their configs keep the window only with ``use_sliding_window``); Llama none."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if config.model_type in ("mistral", "mixtral", "qwen3_moe"):
        return window
    layer_types = getattr(config, "layer_types", None) or []
    if config.model_type in ("qwen2", "qwen3") and layer_id < len(layer_types):
        return window if layer_types[layer_id] == "sliding_attention" else None
    return None


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        # Tensor parallelism: this rank's query heads and the KV heads they read (split or replicated).
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.num_heads = split_evenly(total_heads, "num_attention_heads")
        kv_start, self.num_kv_heads = kv_head_range(total_kv_heads)
        self.head_dim = D = head_dim_of(config)
        self.q_size = self.num_heads * D
        self.kv_size = self.num_kv_heads * D
        # Qwen2 always has q/k/v biases; Llama may via attention_bias.
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        # q, k and v in one matmul (weights are concatenated at load time).
        kv_part = (total_kv_heads * D, kv_start * D, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [(total_heads * D, get_tp_rank() * self.q_size, self.q_size), kv_part, kv_part], bias)
        self.o_proj = RowParallelLinear(total_heads * D, config.hidden_size, bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2")
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id,
                                   sliding_window=sliding_window_of(config, layer_id))
        # Qwen3: each head of q and k is RMS-normalised (weights over head_dim, shared by the heads) before rotary.
        self.q_norm = self.k_norm = None
        if config.model_type in ("qwen3", "qwen3_moe"):
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def forward(self, hidden, rope: RopeBatch, forward_batch):
        opts = forward_batch.kernel_options
        return self.o_proj(self.rotate_attend(self.qkv_proj(hidden, opts), rope, forward_batch), opts)

    def rotate_attend(self, qkv: torch.Tensor, rope: RopeBatch, fb, rotated: bool = False) -> torch.Tensor:
        """q/k norms (Qwen3), rotary, KV store and attention on the fused projection's output. With the fused
        kernels the norms run inside the rotary kernel: one launch per layer fewer at every batch size."""
        opts = fb.kernel_options
        if self.q_norm is not None and not rotated and rope.table is not None and opts is not None and opts.fused_ops:
            return self.attn.forward_qkv(qkv, rope, fb, qk_norm=(self.q_norm.weight, self.k_norm.weight,
                                                                  self.q_norm.eps))
        return self.attn.forward_qkv(self.norm_qk(qkv, opts), rope, fb, rotated=rotated)

    def norm_qk(self, qkv: torch.Tensor, opts: KernelOptions | None) -> torch.Tensor:
        """The per-head q and k norms on the fused projection's output (models without them: unchanged)."""
        if self.q_norm is None:
            return qkv
        return head_rmsnorm(qkv, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads, self.head_dim, opts)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = split_evenly(config.intermediate_size, "intermediate_size")  # this rank's share
        self.gate_up_proj = ColumnParallelLinear.even(config.hidden_size, [config.intermediate_size] * 2, bias,
                                                      "intermediate_size")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, "intermediate_size")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")

    def forward(self, x, opts: KernelOptions | None = None):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, opts), opts), opts)


def moe_of(config, layer_id: int) -> SparseMoE | None:
    """The layer's mixture of experts (Qwen3-MoE's sparse layers, every Mixtral layer), or None (dense MLP)."""
    if config.model_type == "mixtral":
        return SparseMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                         config.num_experts_per_tok, True, config.hidden_act)
    if config.model_type == "qwen3_moe":
        sparse = (layer_id not in (config.mlp_only_layers or []) and config.num_experts > 0
                  and (layer_id + 1) % config.decoder_sparse_step == 0)
        if sparse:
            return SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                             config.num_experts_per_tok, bool(config.norm_topk_prob), config.hidden_act)
    return None


def has_moe(config) -> bool:
    return config.model_type in ("mixtral", "qwen3_moe")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = moe_of(config, layer_id) or LlamaMLP(config)
        # One-token fused GEMVs fold the MLP into gate_up/down GEMVs: dense models only (every layer alike).
        self.fused_one_token = not has_moe(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, rope: RopeBatch, forward_batch):
        """The residual stream is carried apart from the layer outputs, so each norm can add the previous
        output in (one kernel with fused ops). ``residual`` None: ``hidden`` is the embedding (first layer).
        Returns (this layer's MLP output, residual stream before it); the next norm adds the two."""
        opts = forward_batch.kernel_options
        if self.fused_one_token and opts is not None and opts.one_token_path(residual if hidden is None else hidden):
            return None, self.forward_one_token(hidden if residual is None else residual, rope, forward_batch)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, opts=opts)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, opts)
        hidden = self.self_attn(hidden, rope, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual, opts)
        return self.mlp(hidden, opts), residual

    def forward_one_token(self, residual, rope: RopeBatch, fb):
        """One token, every linear a fused GEMV (GEMV modes "fused" and "fused_rope"): the norms in the qkv and
        gate_up GEMVs' prologues, SiLU-mul in gate_up's epilogue, the residual adds in o_proj's and down_proj's
        (``residual`` is updated in place and returned); "fused_rope" also folds rotary and the KV store into
        the qkv GEMV. The same roundings as the separate kernels. On the CPU the native kernels do the same
        folds, a call per linear (layers/native/one_token.c)."""
        opts = fb.kernel_options
        attn, mlp = self.self_attn, self.mlp
        residual = residual.contiguous()
        # Rotary in the GEMV's epilogue would come before the q/k norms: not for models that have them.
        fold_rope = opts.gemv_mode == "fused_rope" and attn.q_norm is None
        rope_store = attn.attn.rope_store(rope, fb) if fold_rope else None
        qkv = attn.qkv_proj.norm_gemv(residual, self.input_layernorm, opts, rope=rope_store)
        o = attn.rotate_attend(qkv, rope, fb, rotated=rope_store is not None)
        attn.o_proj.add_into(residual, o.reshape(1, -1).contiguous(), opts)
        h = mlp.gate_up_proj.norm_gemv(residual, self.post_attention_layernorm, opts, silu_mul=True)
        mlp.down_proj.add_into(residual, h, opts)
        return residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))
        self._native_stack = (None, None)  # (key, ctypes array of layers or None): see native_one_token

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        # input_embeds: multimodal models pass embeddings with image features already merged in.
        fb = forward_batch
        opts = fb.kernel_options
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        fused = opts is not None and (opts.fused_ops or opts.native_cpu)  # rotary from the cos|sin table
        rope = self.rotary_emb.for_batch(positions, hidden.dtype, fused,
                                         fb.req_to_token_pool.max_context_len if fused else 0)
        if opts is not None and opts.native_cpu and opts.one_token_path(hidden):
            out = self.native_one_token(hidden, rope, fb)
            if out is not None:
                return out
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, fb)
        if hidden is None:  # one-token fused GEMVs: the residual adds are done
            return self.norm(residual, opts=opts)
        return self.norm(hidden, residual, opts)[0]

    def native_one_token(self, hidden: torch.Tensor, rope: RopeBatch, fb) -> torch.Tensor | None:
        """CPU, one token, native kernels: every decoder layer and the final norm in one C call
        (gguf_quant.decoder_one_token; the same kernels and roundings as forward_one_token's calls and the norm's),
        ``hidden`` (the embedding, contiguous) updated in place into the residual stream; returns the normed
        output. None (nothing done) where a layer does not fit: Qwen3's q/k norms, MoE, a linear kept in float or
        with a bias, an attention backend not reading the pool in place for this batch. The layers' pointers are
        collected once per KV pool (held with it)."""
        rows = getattr(fb.attn_backend, "native_rows", None)
        tokens = getattr(fb.attn_backend, "native_tokens", None)
        if tokens is None or rope.table is None or not hidden.is_contiguous():
            return None
        pool = fb.token_to_kv_pool
        weight = self.layers[0].self_attn.qkv_proj.weight.data_ptr()
        key, layers = self._native_stack
        if key is None or key[0] is not pool or key[1] != weight:
            # the key holds the pool and its buffers: the pointers in `layers` stay valid while it is in use
            layers = self._one_token_layers(pool)
            buffers = [(pool.get_key_buffer(i), pool.get_value_buffer(i)) for i in range(len(self.layers))]
            self._native_stack = ((pool, weight, buffers), layers)
        if layers is None:
            return None
        attn = self.layers[0].self_attn
        return gguf_quant.decoder_one_token(layers, hidden, (attn.num_heads, attn.num_kv_heads, attn.head_dim),
                                            rope.positions.to(torch.int64), rope.table,
                                            fb.out_cache_loc.to(torch.int64), rows, tokens[1], final_norm=self.norm,
                                            q8=fb.kernel_options.q8_activations)

    def _one_token_layers(self, pool):
        """The ctypes array of gguf_quant.OneTokenLayer for native_one_token, or None (see there)."""
        layers = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not layer.fused_one_token or attn.q_norm is not None or not isinstance(mlp, LlamaMLP):
                return None
            hidden = layer.input_layernorm.weight.shape[0]
            heads = attn.num_heads * attn.head_dim
            shapes_fit = (attn.qkv_proj.weight.shape[0] == heads + 2 * attn.num_kv_heads * attn.head_dim
                          and attn.o_proj.weight.shape[0] == hidden and mlp.down_proj.weight.shape[0] == hidden)
            entry = gguf_quant.one_token_layer(
                attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, layer.input_layernorm,
                layer.post_attention_layernorm, pool.get_key_buffer(i), pool.get_value_buffer(i), attn.attn.scaling,
                attn.attn.sliding_window, attn.attn.logit_cap) if shapes_fit else None
            if entry is None:
                return None
            layers.append(entry)
        return (gguf_quant.OneTokenLayer * len(layers))(*layers)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__(config, LlamaModel(config), tie_by_default=False)
        self.supports_cuda_graph = not has_moe(config) or SparseMoE.cuda_graph_safe  # fused MoE: no host sync


EntryClass = [LlamaForCausalLM]
