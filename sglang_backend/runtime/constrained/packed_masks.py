"""A batch's grammar masks applied on an accelerator in one go, from packed bits.

Masking a row at a time on a GPU costs a kernel launch and a cached 0/-inf row per mask (llguidance's
``fill_mask``); with 64 constrained requests and more distinct masks than that cache holds, rows are rebuilt and
uploaded every step. Here each row's mask travels as llguidance's packed bits (1 bit per token: 16 kB per row at
a 128k vocabulary), stacked into one pinned buffer, copied once and unpacked on the device, where one
``masked_fill`` applies them all (as vLLM and upstream SGLang apply xgrammar's bitmasks)."""

from __future__ import annotations

import numpy as np
import torch

from ...utils import to_device_async

_SHIFTS: dict[torch.device, torch.Tensor] = {}  # per device: the 8 bit positions of a byte


def apply_packed_masks(logits: torch.Tensor, rows: list[int], packed: list[np.ndarray], vocab_size: int) -> None:
    """Sets ``logits[rows[k], t]`` to -inf where bit ``t`` of ``packed[k]`` (uint8, little-endian bit order) is
    clear (or past the row's end), and at every column from ``vocab_size`` on (the model may have more logits than
    the grammar's vocabulary). In place."""
    if not rows:
        return
    device = logits.device
    host = np.zeros((len(rows), max(len(p) for p in packed)), dtype=np.uint8)  # rows may differ by spare words
    for k, p in enumerate(packed):
        host[k, :len(p)] = p
    bits = to_device_async(torch.from_numpy(host), device)  # [n, bytes]
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)  # [n, bytes * 8], one column per token
    width = logits.shape[-1]
    n = min(width, vocab_size, allowed.shape[1])
    whole = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
    index = None if whole else to_device_async(torch.tensor(rows, dtype=torch.int64), device)
    sub = logits if whole else logits.index_select(0, index)
    sub[:, :n].masked_fill_(allowed[:, :n] == 0, float("-inf"))
    if width > n:
        sub[:, n:] = float("-inf")
    if not whole:
        logits.index_copy_(0, index, sub)
