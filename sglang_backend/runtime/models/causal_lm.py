"""What every decoder-only model class shares (``LlamaForCausalLM``, ``Gemma3ForCausalLM``): the LM head, tied to
the embedding or not; the logits, with a final soft-cap where the config sets one (Gemma); loading an HF
checkpoint into our fused parameters (q/k/v and gate/up merged, experts stacked), each rank taking its shard;
and dummy weights. A subclass builds its decoder (``self.model``) and passes it in."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..distributed.parallel_state import get_tp_size
from ..layers import fp8, gguf_quant
from ..layers.kernel_options import KernelOptions
from ..layers.linear import BlockWeight, Fp8Weight, VocabParallelEmbedding, vocab_parallel_logits


class CausalLM(nn.Module):
    # Norm weights of dummy models: 1 for ``w * x`` norms; Gemma's ``(1 + w) * x`` norms set 0 (the identity).
    dummy_norm_value = 1.0

    def __init__(self, config, model: nn.Module, tie_by_default: bool):
        super().__init__()
        self.config = config
        self.model = model
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_by_default))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        if not self.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size)  # used as a weight only

    @property
    def output_embedding(self) -> VocabParallelEmbedding:
        """The LM head's weight holder: the input embedding when tied."""
        return self.model.embed_tokens if self.tie_word_embeddings else self.lm_head

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.output_embedding.weight

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        """Returns final hidden states [num_tokens, hidden]; logits are computed only where needed."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor, opts: KernelOptions | None = None) -> torch.Tensor:
        head = self.output_embedding
        logits = vocab_parallel_logits(hidden, head.weight, self.config.vocab_size, opts, head.gguf_type)
        cap = self.final_logit_softcapping
        if cap:  # in the logits' dtype, as HF
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    # Weight loading: HF names in, merged q/k/v and gate/up out.
    _stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # Expert weights: gate / up / down of expert E, as Qwen3-MoE and Mixtral checkpoints name them.
    _expert_parts = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}

    def keep_gguf_blocks(self, block_types: dict[str, str]) -> list[str]:
        """Linear layers and embeddings whose checkpoint tensors are all GGUF blocks of one kernel-supported
        type (or of types that convert into one exactly, ``gguf_quant.common_format``) keep them as blocks
        (``block_types``: checkpoint name -> GGUF type, from ``iterate_weights``'s files). Tensor parallelism and
        the rest dequantize at load. Returns the parameters that keep blocks."""
        if get_tp_size() != 1:
            return []
        params = dict(self.named_parameters())
        pieces = self._expected_pieces(params)
        types_by_target: dict[str, dict[object, str]] = {}
        for name, gguf_type in block_types.items():
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = self._checkpoint_target(name)
            types_by_target.setdefault(target, {})[shard] = gguf_type
        kept = []
        for target, by_shard in types_by_target.items():
            owner = self._owner(target) if target in params else None
            common = gguf_quant.common_format(set(by_shard.values()))  # pieces of different types: see there
            shards = {f"{target}#{s}" if s is not None else target for s in by_shard}
            expected = {p for p in pieces if p == target or p.startswith(target + "#")}
            if (not isinstance(owner, BlockWeight) or not target.endswith(".weight") or common is None
                    or shards != expected or not gguf_quant.can_keep(common, params[target].shape[1])):
                continue
            owner.keep_blocks(common)
            kept.append(target)
        return kept

    def fp8_layers(self) -> list[Fp8Weight]:
        """The linear layers FP8 applies to: every column- and row-parallel linear of the decoder (not the
        embedding, the LM head or MoE experts)."""
        return [m for m in self.model.modules() if isinstance(m, Fp8Weight)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            if name.endswith(".input_scale"):  # FP8 static activation scales: we scale activations per token
                continue
            target, shard = self._checkpoint_target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            try:
                self._load_full(target, params[target], tensor, shard)
            except ValueError as e:
                raise ValueError(f"weight {name!r} {e}") from None
            loaded.add(f"{target}#{shard}" if shard is not None else target)
        missing = sorted(self._expected_pieces(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _checkpoint_target(self, name: str) -> tuple[str, object]:
        """Our parameter for a checkpoint tensor, and the piece of it the tensor fills (None: all of it)."""
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
        if "experts" in parts and len(parts) >= 3 and parts[-2] in self._expert_parts:
            i = parts.index("experts")
            kind = self._expert_parts[parts[-2]]
            prefix = ".".join(parts[:i])
            return f"{prefix}.{'w2' if kind == 2 else 'w13'}", (int(parts[i + 1]), kind)
        if len(parts) >= 2 and parts[-2] in self._stacked:
            merged, shard = self._stacked[parts[-2]]
            parts[-2] = merged
            return ".".join(parts), shard
        return ".".join(parts), None

    def _expected_pieces(self, params: dict) -> set[str]:
        """Every piece load_weights must see once (fused parameters are filled piece by piece)."""
        expected = set()
        for name in params:
            module, _, leaf = name.rpartition(".")
            fused_leaf = leaf in ("weight", "bias", "weight_scale")
            if fused_leaf and module.endswith("qkv_proj"):
                expected |= {f"{name}#{i}" for i in range(3)}
            elif fused_leaf and module.endswith("gate_up_proj"):
                expected |= {f"{name}#{i}" for i in range(2)}
            elif name.endswith(".w13") or name.endswith(".w2"):
                kinds = (2,) if name.endswith(".w2") else (0, 1)
                experts = range(self._owner(name).num_experts)
                expected |= {f"{name}#{(e, k)}" for e in experts for k in kinds}
            else:
                expected.add(name)
        return expected

    def _owner(self, target: str):
        return self.get_submodule(target.rsplit(".", 1)[0])

    @torch.no_grad()
    def _load_full(self, target: str, param: torch.Tensor, full: torch.Tensor, part=None) -> None:
        """Copies this rank's shard of the full (unsharded) tensor into ``param``; ``part`` picks q/k/v or
        gate/up inside a fused parameter, or (expert, kind) (None: the fused tensor itself)."""
        owner = self._owner(target)
        if isinstance(full, gguf_quant.GGUFBlocks):  # kept as blocks (keep_gguf_blocks) or dequantized here
            full = full.convert(owner.gguf_type).data if param.dtype == torch.uint8 else full.dequantize()
        if (full.dtype == fp8.FP8) != (param.dtype == fp8.FP8):  # an e4m3 value is meaningless without its scale
            raise ValueError(f"is {full.dtype} but the parameter is {param.dtype} (FP8 checkpoints: the decoder's "
                             "linear layers only, all of them)")
        if hasattr(owner, "load_full"):  # the tensor-parallel layers cut their shard
            owner.load_full(param, full, part)
        elif param.shape != full.shape:  # norms: replicated
            raise ValueError(f"has shape {tuple(full.shape)}, expected {tuple(param.shape)}")
        else:
            param.copy_(full)

    def full_shape(self, target: str, param: torch.Tensor) -> tuple:
        """The parameter's shape without tensor parallelism."""
        owner = self._owner(target)
        return owner.full_shape(param) if hasattr(owner, "full_shape") else tuple(param.shape)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights at the config's shapes (benchmarks, tests): normal(0, initializer_range), norms
        ``dummy_norm_value``, biases 0."""
        gen = torch.Generator().manual_seed(seed)
        std = float(getattr(self.config, "initializer_range", 0.02))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(self.dummy_norm_value)
                elif name.endswith(".bias"):
                    p.zero_()
                else:  # drawn at the full shape, so every tp_size gets the same model
                    full = torch.randn(self.full_shape(name, p), generator=gen, dtype=torch.float32) * std
                    self._load_full(name, p, full)
