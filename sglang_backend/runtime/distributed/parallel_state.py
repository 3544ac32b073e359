"""The tensor-parallel group of this process: rank, size, and the few collectives the model needs.

Before ``init_tp`` runs (and always at tp_size 1) the rank is 0 and the size 1, and every helper returns its
input untouched without touching ``torch.distributed``: a single-GPU run does no extra work.

Two groups when tp_size > 1:

* the *device group* (NCCL on GPUs, gloo on CPU) carries the activations (all-reduce after row-parallel
  layers, all-gather of vocab-parallel logits) and each step's index tensors (``broadcast_device``: on the
  GPU an NCCL broadcast queued on the stream, so rank 0 never waits for it on the host);
* the *CPU group* (gloo) carries the rare pickled extras of a step (``broadcast_object``: multimodal inputs)
  and start-up agreements (``all_reduce_min``). Each step's header goes down the followers' stdin pipes
  (tp_worker.py), where an idle follower waits with no timeout; group ops are only issued once a header has
  arrived, so the device group's timeout (``SGLANG_BACKEND_TP_TIMEOUT_S``, default 600 s) bounds how long a
  rank waits for the others inside a forward, never an idle period.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ... import environ

_RANK = 0
_SIZE = 1
_DEVICE_GROUP = None
_CPU_GROUP = None

INIT_TIMEOUT = timedelta(minutes=10)  # joining the group (the other ranks import torch and build the model)


def _device_group_timeout() -> timedelta:
    return timedelta(seconds=environ.TP_TIMEOUT_S.get())
# torch 2.13 renamed all_gather_into_tensor (older releases, as on the GPU machines, have only the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def get_tp_rank() -> int:
    return _RANK


def get_tp_size() -> int:
    return _SIZE


def init_tp(rank: int, size: int, init_method: str, device: str) -> None:
    """Joins the process group (rank 0 hosts the TCP store at ``init_method``)."""
    global _RANK, _SIZE, _DEVICE_GROUP, _CPU_GROUP
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; one tensor-parallel "
                           "engine per process")
    # The default group only meets the ranks; the two groups below do the work, each with its own timeout.
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=INIT_TIMEOUT)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    _RANK, _SIZE = rank, size
    _DEVICE_GROUP = dist.new_group(backend=backend, timeout=_device_group_timeout())
    _CPU_GROUP = dist.new_group(backend="gloo", timeout=INIT_TIMEOUT)  # start-up agreements wait for model loads


def destroy_tp() -> None:
    global _RANK, _SIZE, _DEVICE_GROUP, _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _DEVICE_GROUP, _CPU_GROUP = 0, 1, None, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place (row-parallel outputs, vocab-parallel embedding)."""
    if _SIZE > 1:
        dist.all_reduce(x, group=_DEVICE_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's ``x`` along the last dimension (vocab-parallel logits)."""
    if _SIZE == 1:
        return x
    x = x.contiguous()
    out = torch.empty((_SIZE * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=_DEVICE_GROUP)  # ranks stacked along dim 0
    return torch.cat(out.chunk(_SIZE, dim=0), dim=-1)


def broadcast_device(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` into every rank's ``t`` over the device group (NCCL: queued on the current stream)."""
    dist.broadcast(t, src=0, group=_DEVICE_GROUP)
    return t


def broadcast_object(obj=None):
    """Rank 0 sends ``obj`` to every rank; every rank returns it (pickled over the gloo CPU group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_CPU_GROUP)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's ``value`` (ranks must agree on e.g. the KV pool size)."""
    if _SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())


def split_evenly(total: int, what: str) -> int:
    """This rank's share of ``total`` (heads, intermediate size); must divide evenly."""
    if total % _SIZE:
        raise ValueError(f"{what} ({total}) is not divisible by tp_size ({_SIZE})")
    return total // _SIZE


def kv_head_range(num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, count) this rank holds. KV heads are split when tp_size divides them, and replicated
    (each rank keeps the one head its query heads attend to) when there are fewer KV heads than ranks."""
    if num_kv_heads % _SIZE == 0:
        per = num_kv_heads // _SIZE
        return _RANK * per, per
    if _SIZE % num_kv_heads == 0:
        return _RANK // (_SIZE // num_kv_heads), 1
    raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tp_size ({_SIZE}): one must divide the other")


def check_tp_config(config, tp_size: int) -> None:
    """Raises ValueError, before any process starts, when the model cannot be split ``tp_size`` ways."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    problems = []
    if heads % tp_size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by tp_size")
    if kv % tp_size and tp_size % kv:
        problems.append(f"num_key_value_heads ({kv}) and tp_size: one must divide the other")
    if config.intermediate_size % tp_size:
        problems.append(f"intermediate_size ({config.intermediate_size}) is not divisible by tp_size")
    if problems:
        raise ValueError(f"cannot shard this model over tp_size={tp_size}: " + "; ".join(problems))
