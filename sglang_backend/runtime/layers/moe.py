"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks the top-k experts of each token, each a SiLU-gated
MLP, and their outputs are summed with the router's weights.

Weights as HF transformers holds them: per expert ``w13`` = [gate; up] rows [E, 2 * I, H] and ``w2`` [E, H, I];
the router ``gate.weight`` [E, H]. The forward is HF's arithmetic in torch (softmax in fp32, top-k, optional
renormalisation, weights cast to the activations' dtype; experts visited in ascending order, each one's tokens
gathered, computed and added back), so greedy outputs match HF's on the CPU; a Triton fused-MoE kernel for the
GPU is still to come. Tensor parallelism gives each rank a slice of every expert's intermediate size and sums
the partial outputs with one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size, split_evenly


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported in MoE layers (only silu)")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.full_intermediate = intermediate_size
        self.intermediate = split_evenly(intermediate_size, "moe_intermediate_size")  # this rank's share
        self.inter_start = get_tp_rank() * self.intermediate
        self.tp_size = get_tp_size()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router (replicated)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] in x's dtype)."""
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, opts=None) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        # Tokens grouped by expert: one sort, then each expert's rows as one slice.
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order[start : start + n]
            tokens = token_of[start : start + n]
            start += n
            gate, up = F.linear(x[tokens], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]) * weights.reshape(-1)[rows, None]
            out.index_add_(0, tokens, y)
        return out if self.tp_size == 1 else all_reduce(out)

    # Weight loading (called by the model's loader with the full, unsharded tensors) ---------------------
    def full_shape(self, param: torch.Tensor) -> tuple:
        if param is self.w13:
            return (self.num_experts, 2 * self.full_intermediate, param.shape[2])
        if param is self.w2:
            return (self.num_experts, param.shape[1], self.full_intermediate)
        return tuple(param.shape)

    @torch.no_grad()
    def load_full(self, param: torch.Tensor, full: torch.Tensor, part=None) -> None:
        """``part`` None: the whole stacked tensor; else (expert, 0 gate / 1 up / 2 down) and that expert's
        [rows, cols] matrix as the checkpoint stores it."""
        s, n, inter = self.inter_start, self.intermediate, self.full_intermediate
        if part is None:
            _check(full, self.full_shape(param))
            if param is self.w13:
                param.copy_(torch.cat([full[:, s : s + n], full[:, inter + s : inter + s + n]], dim=1))
            else:
                param.copy_(full[:, :, s : s + n])
            return
        e, kind = part
        if kind == 2:
            _check(full, (param.shape[1], inter))
            param[e].copy_(full[:, s : s + n])
        else:
            _check(full, (inter, param.shape[2]))
            param[e, kind * n : (kind + 1) * n].copy_(full[s : s + n])


def _check(t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"has shape {tuple(t.shape)}, expected {tuple(shape)}")
