"""Tensor-parallel layers (Megatron-style): column-parallel and row-parallel linears, vocab-parallel
embedding and LM head.

Each layer holds only this rank's shard and knows how to cut it from a full (unsharded) checkpoint tensor
(``load_full``). At tp_size 1 the shard is the whole tensor and ``forward`` is the plain ``nn.Linear`` /
``nn.Embedding`` one: no communication, no extra op.

* Column-parallel: output features split, output stays split (feeds attention heads or the MLP's
  activation, which are per-shard anyway). Several logical outputs can share one matmul (q/k/v, gate/up):
  each is cut separately so every rank gets its own q, k and v rows.
* Row-parallel: input features split; the partial products are summed with one all-reduce.
* Vocab-parallel: rows of the embedding split by token id (padded to a multiple of tp_size); out-of-shard
  ids give zeros and the all-reduce adds the one real row. The LM head gathers the logit columns.

A column- or row-parallel linear may hold FP8 weights (``Fp8Weight``, see ``fp8``): an e4m3 ``weight`` plus a
``weight_scale`` per output row.

On the CPU a layer may keep GGUF blocks instead of a float weight (``keep_blocks``, see ``gguf_quant``): its
``weight`` is then uint8 ``[rows, row_bytes]`` and ``forward`` multiplies by it with the block kernels (activations
rounded to 8 bits first when the batch's kernel options say so: ``opts.q8_activations``).

On the GPU a one-token input takes the Triton GEMV when the batch's kernel options say so (``opts.gemv_mode``):
``forward(x, opts)`` picks it by itself. The fused GEMV forms serve a decoder layer at batch 1:
``ColumnParallelLinear.norm_gemv`` folds the RMSNorm before it into its prologue (and SiLU-mul or rotary + KV
store into its epilogue), ``RowParallelLinear.add_into`` the residual add after it into its epilogue.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from ..distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size, split_evenly
from . import fp8, gguf_quant
from .activation import silu_and_mul
from .kernel_options import KernelOptions

try:  # optional: triton (the GPU GEMV)
    from .attention.triton_ops.gemv import gemv
except ImportError:
    gemv = None


def _check_shape(full: torch.Tensor, expected: tuple) -> None:
    if tuple(full.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(full.shape)}, expected {tuple(expected)}")


def _q8(opts: KernelOptions | None) -> bool:
    """Block matmuls round their activations to 8 bits (``--cpu-activation-quant q8``)."""
    return opts is not None and opts.q8_activations


class BlockWeight:
    """Mixin: the layer's weight may be GGUF blocks (``gguf_type`` set) instead of floats."""
    gguf_type: str | None = None

    def keep_blocks(self, gguf_type: str) -> None:
        """From now on ``weight`` holds ``gguf_type`` blocks (filled by load_full from GGUFBlocks rows)."""
        rows, in_features = self.weight.shape
        self.weight = nn.Parameter(torch.empty(rows, gguf_quant.row_bytes(gguf_type, in_features), dtype=torch.uint8),
                                   requires_grad=False)
        self.gguf_type = gguf_type
        self.block_in_features = in_features

    def block_matmul(self, x: torch.Tensor, opts: KernelOptions | None) -> torch.Tensor:
        """``x @ weight.T + bias`` over the blocks, activations rounded to 8 bits when ``opts`` say so."""
        return gguf_quant.matmul(x, self.weight, self.gguf_type, self.bias, q8=_q8(opts))


class Fp8Weight:
    """Mixin: the layer's weight may be FP8 (e4m3) with one fp32 scale per output row (``weight_scale``)."""

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == fp8.FP8

    def keep_fp8(self) -> None:
        """Before loading an FP8 checkpoint: an e4m3 weight and its scales, filled by load_full."""
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=fp8.FP8, device=w.device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(w.shape[0], dtype=torch.float32, device=w.device),
                                         requires_grad=False)

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Online FP8: the loaded float weight becomes e4m3 with per-row scales (its float copy is freed)."""
        q, scale = fp8.quantize_weight(self.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    @torch.no_grad()
    def dequantize_fp8(self, dtype: torch.dtype) -> None:
        """An FP8 checkpoint served unquantized: the float weight back, the scales dropped."""
        self.weight = nn.Parameter(fp8.dequantize(self.weight, self.weight_scale, dtype), requires_grad=False)
        del self.weight_scale

    def fp8_linear(self, x: torch.Tensor, opts: KernelOptions | None, bias: torch.Tensor | None) -> torch.Tensor:
        if opts is not None and opts.use_gemv(x):
            return gemv(x, self.weight, bias, weight_scale=self.weight_scale, configs=opts.configs, pdl=opts.pdl)
        return fp8.linear(x, self.weight, self.weight_scale, bias)

    def load_scale(self, param: torch.Tensor, full: torch.Tensor, rows: tuple[int, int]) -> None:
        """Checkpoint scales of rows ``rows`` = (first, count) of ``param``: one per tensor (a scalar) or per
        row (``[count]`` or ``[count, 1]``)."""
        first, n = rows
        full = full.float().reshape(-1)
        if full.numel() not in (1, n):
            raise ValueError(f"weight_scale has {full.numel()} values, expected 1 or {n}")
        param.narrow(0, first, n).copy_(full.expand(n))


class ColumnParallelLinear(BlockWeight, Fp8Weight, nn.Linear):
    """``parts``: the logical outputs fused into this matmul, as (full size, first row kept, rows kept)."""

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], bias: bool):
        super().__init__(in_features, sum(n for _, _, n in parts), bias=bias)
        self.parts = parts

    def forward(self, x: torch.Tensor, opts: KernelOptions | None = None) -> torch.Tensor:
        if self.gguf_type is not None:
            return self.block_matmul(x, opts)
        if self.is_fp8:
            return self.fp8_linear(x, opts, self.bias)
        if opts is not None and opts.use_gemv(x):
            return gemv(x, self.weight, self.bias, configs=opts.configs, pdl=opts.pdl)
        return super().forward(x)

    def norm_gemv(self, residual: torch.Tensor, norm, opts: KernelOptions, silu_mul: bool = False,
                  rope=None) -> torch.Tensor:
        """One token: ``self(norm(residual))`` in one GEMV (the RMSNorm in its prologue, same roundings as
        the norm kernel); ``silu_mul``: this is a [gate; up] projection and the output is silu(gate) * up;
        ``rope`` (gemv.RopeStore): this is the qkv projection, q and k come out rotated, k and v stored.
        On the CPU (native kernels, no ``rope``) a block weight takes one native call for all of it."""
        if opts.native_cpu:
            if self.gguf_type is not None and self.bias is None:
                return gguf_quant.gemv_fused(residual, self.weight, self.gguf_type, norm=norm, silu_mul=silu_mul,
                                             q8=opts.q8_activations)
            out = self.forward(norm(residual, opts=opts), opts)
            return silu_and_mul(out, opts) if silu_mul else out
        return gemv(residual, self.weight, self.bias, norm_weight=norm.weight, eps=norm.eps, silu_mul=silu_mul,
                    rope=rope, weight_scale=self.weight_scale if self.is_fp8 else None, configs=opts.configs,
                    pdl=opts.pdl)

    @classmethod
    def even(cls, in_features: int, sizes: list[int], bias: bool, what: str) -> "ColumnParallelLinear":
        """Every logical output split evenly across the ranks."""
        rank = get_tp_rank()
        return cls(in_features, [(s, rank * split_evenly(s, what), split_evenly(s, what)) for s in sizes], bias)

    def full_shape(self, param: torch.Tensor) -> tuple:
        return (sum(full for full, _, _ in self.parts),) + tuple(param.shape[1:])

    def load_full(self, param: torch.Tensor, full: torch.Tensor, part: int | None = None) -> None:
        """Copies this rank's rows of ``full`` into ``param``: ``full`` is logical output ``part`` (a q_proj
        weight, say) or, with part None, all of them concatenated. FP8 scales come per part."""
        if param is getattr(self, "weight_scale", None):
            if part is None:
                raise ValueError("a fused weight_scale must come per part (q/k/v, gate/up)")
            _, start, n = self.parts[part]
            return self.load_scale(param, full if full.numel() == 1 else full.reshape(-1).narrow(0, start, n),
                                   (sum(p[2] for p in self.parts[:part]), n))
        if part is None:
            _check_shape(full, self.full_shape(param))
            pieces = full.split([p[0] for p in self.parts], dim=0)
            param.copy_(torch.cat([x.narrow(0, start, n) for x, (_, start, n) in zip(pieces, self.parts)]))
            return
        full_size, start, n = self.parts[part]
        _check_shape(full, (full_size,) + tuple(param.shape[1:]))
        offset = sum(p[2] for p in self.parts[:part])
        param.narrow(0, offset, n).copy_(full.narrow(0, start, n))


class RowParallelLinear(BlockWeight, Fp8Weight, nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, what: str = "in_features"):
        local = split_evenly(in_features, what)
        super().__init__(local, out_features, bias=bias)
        self.tp_size = get_tp_size()
        self.in_start = get_tp_rank() * local
        self.full_in = in_features

    def forward(self, x: torch.Tensor, opts: KernelOptions | None = None) -> torch.Tensor:
        if self.gguf_type is not None:  # kept only at tp_size 1 (CausalLM.keep_gguf_blocks)
            return self.block_matmul(x, opts)
        if self.is_fp8:
            if self.tp_size == 1:
                return self.fp8_linear(x, opts, self.bias)
            out = all_reduce(self.fp8_linear(x, opts, None))
        elif opts is not None and opts.use_gemv(x):
            if self.tp_size == 1:
                return gemv(x, self.weight, self.bias, configs=opts.configs, pdl=opts.pdl)
            out = all_reduce(gemv(x, self.weight, configs=opts.configs, pdl=opts.pdl))
        elif self.tp_size == 1:
            return super().forward(x)
        else:
            out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias  # the bias once, after the sum

    def add_into(self, residual: torch.Tensor, x: torch.Tensor, opts: KernelOptions) -> None:
        """One token: ``residual += self(x)`` in place, the add in the GEMV's epilogue (rounded as
        ``residual + out``) unless the output must be all-reduced first. On the CPU a block weight adds in its
        native call."""
        if self.gguf_type is not None and opts.native_cpu and self.bias is None:
            gguf_quant.gemv_fused(x, self.weight, self.gguf_type, residual=residual, q8=opts.q8_activations)
        elif self.tp_size > 1 or not opts.fused_gemv:
            residual.add_(self.forward(x, opts))
        else:
            gemv(x, self.weight, self.bias, residual=residual, weight_scale=self.weight_scale if self.is_fp8 else None,
                 configs=opts.configs, pdl=opts.pdl)

    def full_shape(self, param: torch.Tensor) -> tuple:
        if param is self.bias or self.gguf_type is not None or param.dim() == 1:  # blocks: tp_size 1, whole rows
            return tuple(param.shape)
        return (param.shape[0], self.full_in)

    def load_full(self, param: torch.Tensor, full: torch.Tensor, part: int | None = None) -> None:
        if param is getattr(self, "weight_scale", None):  # per output row: every rank keeps all of them
            return self.load_scale(param, full, (0, param.shape[0]))
        _check_shape(full, self.full_shape(param))
        param.copy_(full if param is self.bias else full.narrow(1, self.in_start, param.shape[1]))


class VocabParallelEmbedding(BlockWeight, nn.Embedding):
    """Also the LM head's weight holder (``vocab_parallel_logits``): same row split, same padding."""

    def __init__(self, vocab_size: int, dim: int):
        tp = get_tp_size()
        per = -(-vocab_size // tp)
        super().__init__(per, dim)
        self.tp_size = tp
        self.vocab_size = vocab_size
        self.vocab_start = get_tp_rank() * per
        self.vocab_end = min(self.vocab_start + per, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_type is not None:  # kept only at tp_size 1
            return gguf_quant.embedding(ids, self.weight, self.gguf_type, self.block_in_features)
        if self.tp_size == 1:
            return super().forward(ids)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = F.embedding((ids - self.vocab_start) * inside, self.weight)  # foreign ids read row 0 ...
        out.masked_fill_(~inside.unsqueeze(-1), 0)  # ... and are zeroed: the owner's row is the sum
        return all_reduce(out)

    def full_shape(self, param: torch.Tensor) -> tuple:
        return (self.vocab_size, param.shape[1])

    def load_full(self, param: torch.Tensor, full: torch.Tensor, part: int | None = None) -> None:
        _check_shape(full, self.full_shape(param))
        n = self.vocab_end - self.vocab_start
        param[:n].copy_(full[self.vocab_start : self.vocab_end])
        param[n:].zero_()  # padding rows (vocab not divisible by tp_size): their logits are cut off


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                          opts: KernelOptions | None = None, gguf_type: str | None = None) -> torch.Tensor:
    """hidden @ weight.T over the full vocabulary, from this rank's vocab rows of ``weight`` (GGUF blocks
    of ``gguf_type`` when set)."""
    if gguf_type is not None:
        logits = gguf_quant.matmul(hidden, weight, gguf_type, q8=_q8(opts))
    elif opts is not None and opts.use_gemv(hidden):
        logits = gemv(hidden.contiguous(), weight, configs=opts.configs, pdl=opts.pdl)
    else:
        logits = F.linear(hidden, weight)
    if get_tp_size() == 1:
        return logits
    return all_gather_last_dim(logits)[..., :vocab_size]
