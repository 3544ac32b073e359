"""GPU execution of a Llama-family model (models/llama.py) with fused element-wise kernels.

The model object keeps its weights and its reference ``forward``; this executor walks the same modules
(embedding, per-layer qkv/o/gate_up/down linears, norms) but replaces the chains of small torch ops with one
Triton kernel each: residual-add + RMSNorm, rotary on q/k (+ the KV store when the backend allows it), and
SiLU-and-mul. Rotary reads a cos/sin table precomputed once from the model's own ``inv_freq`` (and rope
scaling), so no per-step trigonometry runs either. The result is graph-capturable: no host syncs, shapes depend
only on the number of tokens.

One-token batches (decode at batch 1) can run their linears through the Triton GEMV (``gemv_mode``):

* ``"off"``: cuBLAS, as every other batch;
* ``"on"``: the GEMV in place of cuBLAS, norms and SiLU-mul as separate kernels;
* ``"fused"``: the GEMV also does the RMSNorm (prologue), the SiLU-mul (epilogue of gate_up) and the residual
  add (epilogue of o_proj and down_proj): two kernels per layer fewer, the same roundings;
* ``"fused_rope"``: "fused" plus rotary and the KV store in the qkv GEMV's epilogue, one more kernel fewer
  (with backends that let the model store KV; with others it is "fused"). With the triton backend's decode
  attention (its merge folded in) a layer is then 5 kernels: qkv, attention, o_proj, gate_up, down_proj.

Chosen with SGLANG_BACKEND_GEMV (off/on/fused/fused_rope); the default is "fused_rope" on Hopper and newer, where
it measured fastest on an H100 (benchmarks/bench_gpu.py ``runner`` times every mode: 5.46 ms per batch-1 step
against 5.55 for "fused", 5.78 for "on" and 6.16 for cuBLAS), else "off".

Tensor parallelism: the GEMVs read this rank's shards; the row-parallel ones (o_proj, down_proj) all-reduce
their output before the residual add (which then cannot be the GEMV's epilogue), and the LM head gathers the
vocabulary shards, as the model's own layers do.
"""

from __future__ import annotations


import torch

from ..... import environ
from ....distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp_size
from ...linear import RowParallelLinear
from .fused_ops import fused_add_rmsnorm, rmsnorm, rope_and_store_kv, silu_and_mul
from .gemv import RopeStore, gemv

GEMV_MODES = ("off", "on", "fused", "fused_rope")


def default_gemv_mode(device) -> str:
    mode = environ.GEMV.get()
    if mode is not None:
        mode = {"0": "off", "1": "on"}.get(mode, mode)
        if mode not in GEMV_MODES:
            raise ValueError(f"SGLANG_BACKEND_GEMV={mode!r}: expected one of {', '.join(GEMV_MODES)}")
        return mode
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev.index or 0)[0] >= 9:
        return "fused_rope"
    return "off"


class FusedLlamaExecutor:
    def __init__(self, model, max_positions: int, device):
        self.model = model
        inner = model.model
        first = inner.layers[0].self_attn
        self.num_heads = first.num_heads
        self.num_kv_heads = first.num_kv_heads
        self.head_dim = first.head_dim
        rot = inner.rotary_emb
        inv_freq = rot.inv_freq.to(device=device, dtype=torch.float32)
        # Same fp32 arithmetic as RotaryEmbedding.cos_sin (positions.float() * inv_freq).
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        scale = rot.attention_scaling
        self.cos_sin = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).contiguous()
        self.max_positions = max_positions
        self.gemv_mode = default_gemv_mode(device)
        self.tp_size = get_tp_size()
        self.vocab_size = model.config.vocab_size

    def _row_parallel(self, mod) -> bool:
        return self.tp_size > 1 and isinstance(mod, RowParallelLinear)

    def linear(self, x: torch.Tensor, mod) -> torch.Tensor:
        if self.gemv_mode != "off" and x.shape[0] == 1:
            if self._row_parallel(mod):  # partial sums: reduce, then the bias once (RowParallelLinear.forward)
                y = all_reduce(gemv(x, mod.weight))
                return y if mod.bias is None else y + mod.bias
            return gemv(x, mod.weight, mod.bias)
        return mod(x)

    def add_linear(self, residual: torch.Tensor, x: torch.Tensor, mod) -> None:
        """residual += mod(x) for one token, in place: the add fused into the GEMV unless the output must be
        all-reduced first."""
        if self._row_parallel(mod):
            residual.add_(self.linear(x, mod))
        else:
            gemv(x, mod.weight, mod.bias, residual=residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gemv_mode != "off" and hidden.shape[0] == 1:
            logits = gemv(hidden.contiguous(), self.model.lm_head_weight)
            if self.tp_size > 1:  # this rank's vocabulary rows (vocab_parallel_logits)
                logits = all_gather_last_dim(logits)[..., : self.vocab_size]
            return logits.float()
        return self.model.compute_logits(hidden)

    @staticmethod
    def supports(model) -> bool:
        from ....models.llama import LlamaForCausalLM

        if type(model) is not LlamaForCausalLM:
            return False
        attn = model.model.layers[0].self_attn
        return attn.head_dim % 2 == 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        inner = self.model.model
        backend = fb.attn_backend
        fused_store = bool(getattr(backend, "supports_fused_kv_store", False))
        pool = fb.token_to_kv_pool
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = H * D, Hkv * D

        residual = inner.embed_tokens(input_ids)
        layers = inner.layers
        if self.gemv_mode.startswith("fused") and input_ids.shape[0] == 1:
            return self._one_token(residual, positions, fb, fused_store)
        x = rmsnorm(residual, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        mlp_out = None
        for i, layer in enumerate(layers):
            if i > 0:
                norm = layer.input_layernorm
                x = fused_add_rmsnorm(mlp_out, residual, norm.weight, norm.eps)
            attn = layer.self_attn
            qkv = self.linear(x, attn.qkv_proj)
            if fused_store:
                lid = attn.attn.layer_id
                rope_and_store_kv(qkv, positions, self.cos_sin, H, Hkv, D, fb.out_cache_loc,
                                  pool.get_key_buffer(lid), pool.get_value_buffer(lid))
            else:
                rope_and_store_kv(qkv, positions, self.cos_sin, H, Hkv, D)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            if fused_store:
                o = backend.forward(q, k, v, attn.attn, fb, save_kv=False)
            else:
                o = attn.attn(q, k, v, fb)
            o = self.linear(o, attn.o_proj)
            norm = layer.post_attention_layernorm
            x = fused_add_rmsnorm(o, residual, norm.weight, norm.eps)
            mlp = layer.mlp
            mlp_out = self.linear(silu_and_mul(self.linear(x, mlp.gate_up_proj)), mlp.down_proj)
        return fused_add_rmsnorm(mlp_out, residual, inner.norm.weight, inner.norm.eps)

    def _one_token(self, residual: torch.Tensor, positions: torch.Tensor, fb, fused_store: bool) -> torch.Tensor:
        """The same layers for a single token, every linear a fused GEMV (see the module docstring)."""
        inner = self.model.model
        backend, pool = fb.attn_backend, fb.token_to_kv_pool
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = H * D, Hkv * D
        residual = residual.contiguous()
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            lid = attn.attn.layer_id
            store = (fb.out_cache_loc, pool.get_key_buffer(lid), pool.get_value_buffer(lid)) if fused_store else ()
            rope = None
            if fused_store and self.gemv_mode == "fused_rope":  # rotary + KV store in the GEMV's epilogue
                rope = RopeStore(positions, self.cos_sin, H, Hkv, D, *store)
            qkv = gemv(residual, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=norm.weight, eps=norm.eps,
                       rope=rope)
            if rope is None:
                rope_and_store_kv(qkv, positions, self.cos_sin, H, Hkv, D, *store)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            if fused_store:
                o = backend.forward(q, k, v, attn.attn, fb, save_kv=False)
            else:
                o = attn.attn(q, k, v, fb)
            self.add_linear(residual, o.reshape(1, -1).contiguous(), attn.o_proj)
            norm = layer.post_attention_layernorm
            h = gemv(residual, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm_weight=norm.weight,
                     eps=norm.eps, silu_mul=True)
            self.add_linear(residual, h, mlp.down_proj)
        return rmsnorm(residual, inner.norm.weight, inner.norm.eps)
