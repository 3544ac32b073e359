"""Logprob helpers for ``return_logprob`` / OpenAI ``logprobs`` / ``select`` scoring.

All logprobs are taken from the RAW model logits (before temperature, penalties, bias or top-k/p), as
``log_softmax`` in float32: the same numbers HF's ``torch.log_softmax(model(...).logits.float(), -1)``
gives, and what upstream SGLang reports by default.
"""

from __future__ import annotations

import torch


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[N, V] logits, [N] token ids -> [N] float32 logprob of each row's token."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64, device=logits.device)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.float32, device=logits.device)
    return _log_softmax(logits).gather(1, token_ids.view(-1, 1)).squeeze(1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] logits -> (values [N, k] float32, ids [N, k] int64), best first. ``k`` is capped at V."""
    k = max(0, min(int(k), logits.shape[-1]))
    values, ids = torch.topk(_log_softmax(logits), k, dim=-1)
    return values, ids


def token_ids_logprobs(logits: torch.Tensor, ids_per_row: list[list[int]]) -> list[list[float]]:
    """Logprobs of the given token ids, per row (rows may ask for different ids, or none)."""
    assert len(ids_per_row) == logits.shape[0], f"{len(ids_per_row)} id lists for {logits.shape[0]} rows"
    if not any(ids_per_row):
        return [[] for _ in ids_per_row]
    logprobs = _log_softmax(logits)
    out: list[list[float]] = []
    for row, ids in enumerate(ids_per_row):
        if not ids:
            out.append([])
            continue
        idx = torch.as_tensor(list(ids), dtype=torch.int64, device=logits.device)
        out.append(logprobs[row, idx].tolist())
    return out
