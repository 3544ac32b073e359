"""Tensor parallelism across processes: rank 0 launches ranks 1..N-1 and drives them in lockstep.

Rank 0 is the process that owns the scheduler (the Engine's process, or the server's scheduler process). It
alone runs the scheduler, the radix tree and sampling, so every scheduling decision is made once. Before
each forward it sends the other ranks ("followers") everything that forward needs: the batch and every
``req_to_token`` write since the previous forward. A follower replays the writes into its own table, so it
reads and writes exactly the same KV slots in its shard of the KV pool (its KV heads) as rank 0 does in its
own, and then runs the same forward (the same CUDA graph for a decode batch); the collectives inside the
model pair up because all ranks run the same sequence of forwards. Only rank 0 uses the logits.

One step is, without pickling and without any device-to-host copy on rank 0:

* a fixed-size int64 *header*, written to each follower's stdin pipe (a few microseconds; a gloo broadcast
  of the same 8 KB cost rank 0 about 0.4 ms per step on 2xH200): what the step is (a forward, or exit), the
  forward mode, the token count, the batch size, which optional tensors are present, and the host-side
  integers (``seq_lens_cpu``, ``extend_*_cpu`` and the table writes, whose values rank 0 has on the host).
  They ride inside the header when they fit (every decode step up to a few hundred requests); otherwise
  exactly their length follows on the pipe;
* the batch's device tensors (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens and
  logits_indices) concatenated into one int64 buffer and broadcast over the device group: on GPUs an NCCL
  broadcast queued on rank 0's stream (rank 0 does not wait for it); followers slice it back into fields;
* multimodal inputs (rare, variable) alone go pickled (``broadcast_object``).

An idle follower blocks reading its pipe, which has no timeout, so an idle server never loses its
followers; the pipe first carries the start-up arguments. Shutdown is an "exit" header; a follower whose
parent dies sees the pipe's end (or leaves on its own, ``_exit_with_parent``, when stuck in a collective).

The protocol and rank 0's launcher live in ``followers`` (below the model executor); this module is
the follower process itself. Run as ``python -m sglang_backend.runtime.distributed.tp_worker PARENT_PID PDEATHSIG`` by rank 0 only.
"""

from __future__ import annotations

import cProfile
import logging
import os
import pickle
import pstats
import sys
import threading
import time

import torch

from ... import environ
from ...utils import die_with_parent
from ..model_executor.model_runner import ModelRunner, resolve_device
from ..model_loader.loader import load_model_assets
from .followers import (  # noqa: F401 - re-exported: the protocol's names were long imported from here
    HEADER_INTS,
    INLINE_INTS,
    ReqToTokenWriteLog,
    decode_step,
    encode_step,
    receive_step,
    release_graphs,
    replay_writes,
)
from .parallel_state import destroy_tp, init_tp

logger = logging.getLogger(__name__)


def _exit_with_parent(parent: int) -> None:
    """A follower stuck inside a collective when rank 0 dies would wait for the timeout: leave now."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def follower_main() -> None:
    # argv: rank 0's pid, and 1 if rank 0 started us from its main thread (see TPFollowers). SIGINT is ignored:
    # rank 0 stops the followers.
    die_with_parent(int(sys.argv[1]), pdeathsig=sys.argv[2] == "1")
    pipe = sys.stdin.buffer  # the start-up arguments, then one header per step
    server_args, rank, init_method, threads = pickle.load(pipe)
    logging.basicConfig(level=server_args.log_level.upper(), format=f"[tp rank {rank}] %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(int(sys.argv[1]),), daemon=True).start()
    torch.set_num_threads(threads)
    device = resolve_device(server_args.device)
    if device.startswith("cuda"):
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    init_tp(rank, server_args.tp_size, init_method, device)
    model_dir, config, _ = load_model_assets(server_args)
    runner = ModelRunner(server_args, config, model_dir, tp_rank=rank)
    steps = graphed = 0
    busy = 0.0  # host seconds from a step's arrival until its forward returns (on a GPU: is queued)
    profile_path = environ.TP_PROFILE.get()  # cProfile of the step loop, written at exit
    profiler = None
    if profile_path:
        profiler = cProfile.Profile()
        profiler.enable()
    while (step := receive_step(pipe, runner.device)) is not None:
        t0 = time.perf_counter()
        fb, writes = step
        replay_writes(runner.req_to_token_pool, writes)
        steps += 1
        graphed += runner.graph_runner is not None and runner.graph_runner.can_run(fb)
        runner.forward(fb)  # the same path as rank 0's: CUDA graph replay for decode batches
        busy += time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        with open(f"{profile_path}.rank{rank}.txt", "w") as f:
            for key in ("tottime", "cumulative"):
                pstats.Stats(profiler, stream=f).sort_stats(key).print_stats(30)
    msg = (f"tp rank {rank}: {steps} forwards ({graphed} by CUDA graph), "
           f"{1e6 * busy / max(steps, 1):.0f} us host time each after its header arrived")
    if environ.TP_STATS.get():
        print(msg, file=sys.stderr, flush=True)
    logger.info(msg)
    release_graphs(runner)
    destroy_tp()


if __name__ == "__main__":
    follower_main()
