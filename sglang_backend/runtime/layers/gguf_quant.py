"""GGUF block-quantized weights kept as blocks (Q4_0, Q4_1, Q8_0), with CPU matmuls that dequantize inside.

A converted GGUF checkpoint stores these tensors as llama.cpp does: ``uint8 [rows, row_bytes]``, each row
``K / 32`` blocks (see ``native/gguf_blocks.c`` for the layouts), and names them in the safetensors metadata
(``GGUF_TYPES_METADATA``). ``iterate_weights`` hands such a tensor over as :class:`GGUFBlocks`.

A linear layer or embedding that keeps blocks (``keep_blocks``; the model runner decides: CPU, native kernels
built, ``--quantization auto``) holds a uint8 ``weight`` and ``gguf_type``; :func:`matmul` multiplies float32
activations by it (one to ``MAX_NATIVE_ROWS`` rows in the native kernel, more through a dequantized copy and
torch's sgemm) and :func:`embedding` looks rows up. Otherwise the blocks are dequantized at load, exactly as
gguf-py dequantizes them, and the layer is the plain float one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import native

BLOCK = 32
# name -> (ggml type id, bytes per block of 32)
FORMATS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
# safetensors ``__metadata__`` key: JSON {tensor name: format name} for the tensors stored as blocks
GGUF_TYPES_METADATA = "gguf_block_types"
# Above this many activation rows (prefill) a dequantized copy + sgemm beats the block kernel.
MAX_NATIVE_ROWS = 32


def row_bytes(gguf_type: str, in_features: int) -> int:
    return in_features // BLOCK * FORMATS[gguf_type][1]


def can_keep(gguf_type: str | None, in_features: int) -> bool:
    return gguf_type in FORMATS and in_features % BLOCK == 0


@dataclass
class GGUFBlocks:
    """A checkpoint tensor of ``shape`` (rows, in_features) stored as GGUF blocks in ``data``."""
    gguf_type: str
    data: torch.Tensor  # uint8 [rows, row_bytes]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1] // FORMATS[self.gguf_type][1] * BLOCK)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.gguf_type, self.shape[1])


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


def matmul(x: torch.Tensor, blocks: torch.Tensor, gguf_type: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for float32 ``x [..., K]`` and a block weight ``W`` of ``blocks.shape[0]`` rows."""
    in_features = x.shape[-1]
    rows = x.numel() // in_features if in_features else 0
    kernels = native.kernels()
    if kernels is None or rows > MAX_NATIVE_ROWS or x.dtype != torch.float32:
        return F.linear(x, dequantize(blocks, gguf_type, in_features).to(x.dtype), bias)
    x2 = x.reshape(rows, in_features).contiguous()
    out = torch.empty(rows, blocks.shape[0], dtype=torch.float32)
    if rows:
        kernels.gguf_matmul(FORMATS[gguf_type][0], x2.data_ptr(), rows, in_features, blocks.data_ptr(),
                            blocks.shape[0], out.data_ptr(), torch.get_num_threads())
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], blocks.shape[0])


def embedding(ids: torch.Tensor, blocks: torch.Tensor, gguf_type: str, in_features: int) -> torch.Tensor:
    return dequantize(blocks, gguf_type, in_features, ids).reshape(*ids.shape, in_features)


def quantize(weight: torch.Tensor, gguf_type: str) -> torch.Tensor:
    """float32 [rows, K] -> blocks, with gguf-py's quantizer (tests and tools build quantized models with it)."""
    from gguf import GGMLQuantizationType  # deferred: gguf is slow to import
    from gguf.quants import quantize as gguf_quantize

    blocks = gguf_quantize(weight.detach().float().contiguous().numpy(), GGMLQuantizationType[gguf_type])
    return torch.from_numpy(np.ascontiguousarray(blocks))
