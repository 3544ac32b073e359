"""Tensor parallelism: the process group (``parallel_state``) and the lockstep launcher (``tp_worker``)."""

from .parallel_state import get_tp_rank, get_tp_size

__all__ = ["get_tp_rank", "get_tp_size"]
