"""GGUF block-quantized weights kept as blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K,
Q6_K), with CPU matmuls that dequantize inside.

A converted GGUF checkpoint stores these tensors as llama.cpp does: ``uint8 [rows, row_bytes]``, each row
``K / block_columns`` blocks (32 columns, 256 for the K-quants; see ``native/gguf_blocks.c`` for the layouts),
and names them in the safetensors metadata (``GGUF_TYPES_METADATA``). ``iterate_weights`` hands such a tensor
over as :class:`GGUFBlocks`.

A linear layer or embedding that keeps blocks (``keep_blocks``; the model runner decides: CPU, native kernels
built, ``--quantization auto``) holds a uint8 ``weight`` and ``gguf_type``; :func:`matmul` multiplies float32
activations by it (one to ``MAX_NATIVE_ROWS`` rows in the native kernel, more through a dequantized copy and
torch's sgemm) and :func:`embedding` looks rows up. Opt-in (``q8``, ``--cpu-activation-quant q8``) the native
kernel first rounds the activations to 8 bits per block of 32, as llama.cpp does, and multiplies in integers
(``Q8_ACTIVATION_FORMATS``; the other formats and the many-row path keep float32 activations). Otherwise the
blocks are dequantized at load, exactly as gguf-py dequantizes them, and the layer is the plain float one.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import native

# name -> (ggml type id, columns per block, bytes per block), as gguf-py's GGML_QUANT_SIZES
FORMATS = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}
# safetensors ``__metadata__`` key: JSON {tensor name: format name} for the tensors stored as blocks
GGUF_TYPES_METADATA = "gguf_block_types"
# Formats with an integer kernel for 8-bit activations (gguf_blocks.c gguf_matmul_q8).
Q8_ACTIVATION_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# Above this many activation rows (prefill) a dequantized copy + sgemm beats the block kernel.
MAX_NATIVE_ROWS = 32


def block_columns(gguf_type: str) -> int:
    return FORMATS[gguf_type][1]


def row_bytes(gguf_type: str, in_features: int) -> int:
    return in_features // block_columns(gguf_type) * FORMATS[gguf_type][2]


def can_keep(gguf_type: str | None, in_features: int) -> bool:
    return gguf_type in FORMATS and in_features % block_columns(gguf_type) == 0


@dataclass
class GGUFBlocks:
    """A checkpoint tensor of ``shape`` (rows, in_features) stored as GGUF blocks in ``data``."""
    gguf_type: str
    data: torch.Tensor  # uint8 [rows, row_bytes]

    @property
    def shape(self) -> tuple[int, int]:
        _, columns, nbytes = FORMATS[self.gguf_type]
        return (self.data.shape[0], self.data.shape[1] // nbytes * columns)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.gguf_type, self.shape[1])

    def convert(self, gguf_type: str) -> "GGUFBlocks":
        """The same weights as ``gguf_type`` blocks: these, or Q8_0 ones from Q4_0 / Q5_0 (see common_format)."""
        if gguf_type == self.gguf_type:
            return self
        if gguf_type != "Q8_0" or self.gguf_type not in _INTO_Q8_0:
            raise ValueError(f"{self.gguf_type} blocks do not convert into {gguf_type} exactly")
        rows, columns = self.shape
        scale = self.data.reshape(rows, columns // 32, -1)[..., :2]  # the same fp16 d leads both formats
        d = scale.contiguous().view(torch.float16).float()
        w = self.dequantize().reshape(rows, columns // 32, 32)  # d * q, exact, so w / d is q again
        q = torch.where(d != 0, w / d, 0.0).round().to(torch.int8)
        return GGUFBlocks("Q8_0", torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(rows, -1))


# Formats whose weights are all Q8_0 weights too, with the same fp16 scale (symmetric, quants within int8).
_INTO_Q8_0 = ("Q4_0", "Q5_0")


def common_format(types: set[str]) -> str | None:
    """The format one weight made of checkpoint pieces of ``types`` (a fused q/k/v) keeps: their one format; Q8_0
    when the others convert into it exactly (Gemma 3's Q4_K_M GGUF has Q5_0 q and k with a Q8_0 v); else None."""
    if len(types) == 1:
        return next(iter(types))
    return "Q8_0" if "Q8_0" in types and types <= {"Q8_0", *_INTO_Q8_0} else None


def read_block_types(metadata: dict[str, str] | None) -> dict[str, str]:
    return json.loads((metadata or {}).get(GGUF_TYPES_METADATA, "{}"))


def kernels_available() -> bool:
    return native.kernels() is not None


def _reference_dequantize(blocks: torch.Tensor, gguf_type: str, in_features: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType  # deferred: gguf is slow to import
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(blocks.numpy(), GGMLQuantizationType[gguf_type])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(blocks.shape[0], in_features)


def dequantize(blocks: torch.Tensor, gguf_type: str, in_features: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """float32 rows of a block weight (all of them, or ``ids``), rounded as gguf-py's dequantize rounds."""
    kernels = native.kernels()
    if kernels is None:
        full = _reference_dequantize(blocks, gguf_type, in_features)
        return full if ids is None else full[ids]
    blocks = blocks.contiguous()
    if ids is not None:
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= blocks.shape[0]):
            raise IndexError(f"row id out of range for a weight of {blocks.shape[0]} rows")
    n = blocks.shape[0] if ids is None else ids.numel()
    out = torch.empty(n, in_features, dtype=torch.float32)
    kernels.gguf_dequantize_rows(FORMATS[gguf_type][0], blocks.data_ptr(), in_features,
                                 None if ids is None else ids.data_ptr(), n, out.data_ptr(), torch.get_num_threads())
    return out


def matmul(x: torch.Tensor, blocks: torch.Tensor, gguf_type: str, bias: torch.Tensor | None = None,
           q8: bool = False) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for float32 ``x [..., K]`` and a block weight ``W`` of ``blocks.shape[0]`` rows; ``q8``:
    x rounded to 8 bits per block of 32 first (native kernel, ``Q8_ACTIVATION_FORMATS`` only)."""
    kernels = native.kernels()
    flat = x.dim() == 2 and x.is_contiguous()  # a decode batch: no reshapes (each costs a few us of a ~50 us call)
    in_features = x.shape[-1]
    rows = x.shape[0] if flat else (x.numel() // in_features if in_features else 0)
    if kernels is None or rows > MAX_NATIVE_ROWS or x.dtype != torch.float32:
        return F.linear(x, dequantize(blocks, gguf_type, in_features).to(x.dtype), bias)
    x2 = x if flat else x.reshape(rows, in_features).contiguous()
    out = torch.empty(rows, blocks.shape[0], dtype=torch.float32)
    if rows:
        kernel = kernels.gguf_matmul_q8 if q8 and gguf_type in Q8_ACTIVATION_FORMATS else kernels.gguf_matmul
        kernel(FORMATS[gguf_type][0], x2.data_ptr(), rows, in_features, blocks.data_ptr(), blocks.shape[0],
               out.data_ptr(), torch.get_num_threads())
    if bias is not None:
        out += bias
    return out if flat else out.reshape(*x.shape[:-1], blocks.shape[0])


def embedding(ids: torch.Tensor, blocks: torch.Tensor, gguf_type: str, in_features: int) -> torch.Tensor:
    return dequantize(blocks, gguf_type, in_features, ids).reshape(*ids.shape, in_features)


def quantize(weight: torch.Tensor, gguf_type: str) -> torch.Tensor:
    """float32 [rows, K] -> blocks (tests and tools build quantized models with it): gguf-py's quantizer, or for
    the K-quants, which gguf-py cannot quantize, a plain one of ours (see :func:`_quantize_k`)."""
    w = weight.detach().float().contiguous().numpy()
    if gguf_type in _K_QUANTIZERS:
        if w.shape[-1] % 256:
            raise ValueError(f"{gguf_type} rows hold whole blocks of 256 columns, not {w.shape[-1]}")
        blocks = _K_QUANTIZERS[gguf_type](w.reshape(-1, 256)).reshape(*w.shape[:-1], -1)
        return torch.from_numpy(np.ascontiguousarray(blocks))
    from gguf import GGMLQuantizationType  # deferred: gguf is slow to import
    from gguf.quants import quantize as gguf_quantize

    return torch.from_numpy(np.ascontiguousarray(gguf_quantize(w, GGMLQuantizationType[gguf_type])))


# K-quants: valid blocks from each sub-block's range, scales rounded up so the quants fit. llama.cpp searches
# for the scales that minimise the error; these are a little less accurate, which tests do not mind.

def _steps(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """ceil(values / unit) in [0, top] (0 where unit is 0), as uint8."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(unit > 0, np.ceil(values / unit), 0).clip(0, top).astype(np.uint8)


def _nearest(values: np.ndarray, step: np.ndarray, low: int, high: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step > 0, np.round(values / step), 0).clip(low, high).astype(np.int32)


def _quantize_k(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K (levels 15) / Q5_K (31): [n, 256] -> (d, dmin, the 12 bytes of 6-bit scales and mins: [n, 16] bytes;
    quants [n, 8, 32]), w = d sc q - dmin mn per sub-block of 32."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / levels, -low
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    sc, mn = _steps(scale, d.astype(np.float32), 63), _steps(mins, dmin.astype(np.float32), 63)
    step = d.astype(np.float32) * sc
    q = _nearest(sub + (dmin.astype(np.float32) * mn)[..., None], step[..., None], 0, levels)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], axis=-1)
    head = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed], axis=-1)
    return head, q


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K quants [n, 8, 32] -> 128 bytes: sub-blocks 2p and 2p + 1 in the low and high halves of 32."""
    return ((q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4).astype(np.uint8).reshape(len(q), 128)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _quantize_k(blocks, 15)
    return np.concatenate([head, _nibble_pairs(q)], axis=-1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _quantize_k(blocks, 31)
    qh = ((q >> 4) << np.arange(8).reshape(1, 8, 1)).sum(axis=1).astype(np.uint8)  # bit s of byte i: sub-block s
    return np.concatenate([head, qh, _nibble_pairs(q)], axis=-1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> Q6_K: int8 scales per sub-block of 16, w = d sc (q - 32), symmetric."""
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = _steps(scale, d.astype(np.float32), 127)
    u = (_nearest(sub, (d.astype(np.float32) * sc)[..., None], -32, 31) + 32).reshape(-1, 2, 4, 32)  # [h, g, i]
    ql = (u[:, :, :2] & 15) | (u[:, :, 2:] & 15) << 4  # column 128 h + 32 g + i: byte 64 h + 32 (g % 2) + i
    qh = ((u >> 4) << (2 * np.arange(4)).reshape(1, 1, 4, 1)).sum(axis=2)  # bits 2g of byte 32 h + i
    n = len(sub)
    return np.concatenate([ql.astype(np.uint8).reshape(n, 128), qh.astype(np.uint8).reshape(n, 64),
                           sc.view(np.int8).view(np.uint8), d.view(np.uint8)], axis=-1)


_K_QUANTIZERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def gemv_fused(x: torch.Tensor, blocks: torch.Tensor, gguf_type: str, *, norm=None, silu_mul: bool = False,
               residual: torch.Tensor | None = None, q8: bool = False) -> torch.Tensor:
    """One float32 row ``x [1, K]`` through a block weight of N rows in one native call, the layer's neighbours
    folded in (the CPU's one-token decoder path): ``norm`` (an RMSNorm) applied to x first; ``silu_mul``: the
    weight is [gate; up] and the result silu(gate) * up ``[1, N/2]``; ``residual``: the result is added into it
    in place and it is returned; ``q8``: the (normed) row is rounded to 8 bits per block of 32 and multiplied in
    integers (``Q8_ACTIVATION_FORMATS`` only). Needs the native kernels."""
    n = blocks.shape[0] // 2 if silu_mul else blocks.shape[0]
    out = residual if residual is not None else torch.empty(1, n, dtype=torch.float32)
    status = native.kernels().gguf_gemv_fused(
        FORMATS[gguf_type][0], x.data_ptr(), x.shape[-1], blocks.data_ptr(), blocks.shape[0], out.data_ptr(),
        torch.get_num_threads(), None if norm is None else norm.weight.data_ptr(), 0.0 if norm is None else norm.eps,
        int(silu_mul), int(residual is not None), int(q8 and gguf_type in Q8_ACTIVATION_FORMATS))
    if status != 0:
        raise ValueError(f"gemv_fused: {gguf_type} blocks of {x.shape[-1]} columns are not supported")
    return out


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 ``x [M, K]`` as the q8 kernels round it (tests): int8 quants ``[M, K]``, per block of 32 the scale d
    and the sum s = d * sum(q) ``[M, K / 32]``. Needs the native kernels."""
    x = x.float().contiguous()
    rows, columns = x.shape
    q = torch.empty(rows, columns, dtype=torch.int8)
    d = torch.empty(rows, columns // 32, dtype=torch.float32)
    s = torch.empty_like(d)
    if native.kernels().gguf_quantize_q8(x.data_ptr(), rows, columns, q.data_ptr(), d.data_ptr(), s.data_ptr()):
        raise ValueError(f"quantize_activations_q8: {columns} columns are not whole blocks of 32")
    return q, d, s


class OneTokenLayer(ctypes.Structure):
    """One decoder layer for :func:`decoder_one_token`: the C ``struct one_token_layer`` (native/one_token.c)."""
    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("qkv_type", ctypes.c_int64), ("o_type", ctypes.c_int64),
                ("gate_up_type", ctypes.c_int64), ("down_type", ctypes.c_int64), ("qkv_rows", ctypes.c_int64),
                ("gate_up_rows", ctypes.c_int64), ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_buf", ctypes.c_void_p), ("v_buf", ctypes.c_void_p), ("window", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("logit_cap", ctypes.c_float),
                ("unused", ctypes.c_float)]


def one_token_layer(qkv, o, gate_up, down, input_norm, post_norm, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    scale: float, window: int | None = None, logit_cap: float | None = None) -> OneTokenLayer | None:
    """A Llama decoder layer as :func:`decoder_one_token` runs it, from its four linears (each with a ``weight`` of
    GGUF blocks, ``gguf_type`` and ``bias``), its two RMSNorms (``weight``, ``eps``, one eps for both) and its
    float32 KV buffers ``[pool rows, Hkv, D]``; None when the layer does not fit (a linear kept in float, a
    bias, norms of different eps, another KV dtype)."""
    linears = (qkv, o, gate_up, down)
    if any(getattr(lin, "gguf_type", None) is None or lin.bias is not None for lin in linears):
        return None
    if input_norm.eps != post_norm.eps or k_buf.dtype != torch.float32 or v_buf.dtype != torch.float32:
        return None
    if not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        return None
    return OneTokenLayer(
        qkv.weight.data_ptr(), o.weight.data_ptr(), gate_up.weight.data_ptr(), down.weight.data_ptr(),
        *(FORMATS[lin.gguf_type][0] for lin in linears), qkv.weight.shape[0], gate_up.weight.shape[0],
        input_norm.weight.data_ptr(), post_norm.weight.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), window or 0,
        input_norm.eps, scale, logit_cap or 0.0, 0.0)


def decoder_one_token(layers, residual: torch.Tensor, heads: tuple[int, int, int], position: torch.Tensor,
                      rope_table: torch.Tensor, out_loc: torch.Tensor, slots: torch.Tensor, token_len: torch.Tensor,
                      final_norm=None, q8: bool = False) -> torch.Tensor:
    """One token through the decoder layers ``layers`` (a ctypes array of :class:`OneTokenLayer`) in one native
    call, each as ``LlamaDecoderLayer.forward_one_token`` runs it: ``residual [1, hidden]`` (contiguous float32)
    is updated in place and returned, or with ``final_norm`` (an RMSNorm) that norm of it, as the native RMSNorm
    computes it. ``heads``: (H, Hkv, D); ``position``, ``out_loc``, ``token_len``: int64 [1] (the token's position,
    its KV pool row, how many positions it sees); ``slots``: int64, the request's pool rows by position; ``q8`` as
    in :func:`gemv_fused`. Needs the native kernels."""
    H, Hkv, D = heads
    out = residual if final_norm is None else torch.empty_like(residual)
    status = native.kernels().decoder_one_token(
        ctypes.addressof(layers), len(layers), residual.shape[-1], H, Hkv, D, residual.data_ptr(),
        position.data_ptr(), rope_table.data_ptr(), out_loc.data_ptr(), slots.data_ptr(), token_len.data_ptr(),
        None if final_norm is None else final_norm.weight.data_ptr(), 0.0 if final_norm is None else final_norm.eps,
        out.data_ptr(), int(q8), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"decoder_one_token: a layer's kernels failed (status {status})")
    return out
