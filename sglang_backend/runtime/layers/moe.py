"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks the top-k experts of each token, each a SiLU-gated
MLP, and their outputs are summed with the router's weights.

Weights as HF transformers holds them: per expert ``w13`` = [gate; up] rows [E, 2 * I, H] and ``w2`` [E, H, I];
the router ``gate.weight`` [E, H]. The forward is HF's arithmetic in torch (softmax in fp32, top-k, optional
renormalisation, weights cast to the activations' dtype; experts visited in ascending order, each one's tokens
gathered, computed and added back: :func:`torch_moe`), so greedy outputs match HF's on the CPU. On CUDA the
experts run in the Triton fused-MoE kernel (attention/triton_ops/fused_moe.py), whatever ``fused_ops`` says:
the torch loop reads each expert's load on the host, the kernel never syncs, so only the kernel lets a decode
step be captured in a CUDA graph. Tensor parallelism gives each rank a slice of every expert's intermediate
size and sums the partial outputs with one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size, split_evenly
from .linear import _check_shape

try:  # optional: triton (the fused-MoE GPU kernels)
    from .attention.triton_ops.fused_moe import fused_moe, topk_softmax
except ImportError:
    fused_moe = topk_softmax = None


def torch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """HF's expert loop (the CPU path, and the reference of the fused kernel's tests): [T, H] in x's dtype."""
    out = torch.zeros_like(x)
    # Tokens grouped by expert: one sort, then each expert's rows as one slice.
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token_of = order // top_k
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start : start + n]
        tokens = token_of[start : start + n]
        start += n
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights.reshape(-1)[rows, None]
        out.index_add_(0, tokens, y)
    return out


class SparseMoE(nn.Module):
    # Whether a CUDA forward is free of host syncs (CUDA-graph capturable): with triton, the fused kernel.
    cuda_graph_safe = fused_moe is not None

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
        """(top-k expert ids [T, k], their weights [T, k] in x's dtype); on CUDA in one kernel after the router
        GEMM, else HF's torch arithmetic."""
        logits = F.linear(x, self.gate.weight)
        if x.is_cuda and topk_softmax is not None:
            return topk_softmax(logits, self.top_k, self.renormalize, x.dtype)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, opts=None) -> torch.Tensor:
        experts, weights = self.route(x)
        if x.is_cuda and fused_moe is not None:
            out = fused_moe(x.contiguous(), self.w13, self.w2, experts, weights,
                            configs=opts.configs if opts is not None else None)
        else:
            out = torch_moe(x, self.w13, self.w2, experts, weights)
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
            _check_shape(full, self.full_shape(param))
            if param is self.w13:
                param.copy_(torch.cat([full[:, s : s + n], full[:, inter + s : inter + s + n]], dim=1))
            else:
                param.copy_(full[:, :, s : s + n])
            return
        e, kind = part
        if kind == 2:
            _check_shape(full, (param.shape[1], inter))
            param[e].copy_(full[:, s : s + n])
        else:
            _check_shape(full, (inter, param.shape[2]))
            param[e, kind * n : (kind + 1) * n].copy_(full[s : s + n])
