"""Tensor parallelism across processes: rank 0 launches ranks 1..N-1 and drives them in lockstep.

Rank 0 is the process that owns the scheduler (the Engine's process, or the server's scheduler process). It
alone runs the scheduler, the radix tree and sampling, so every scheduling decision is made once. Before
each forward it sends the other ranks ("followers") everything that forward needs: the batch's index
tensors and every ``req_to_token`` write since the previous forward. A follower replays the writes into its
own table, so it reads and writes exactly the same KV slots in its shard of the KV pool (its KV heads) as
rank 0 does in its own, and then runs the same forward; the collectives inside the model pair up because
all ranks run the same sequence of forwards. Only rank 0 uses the logits.

The messages go down each follower's stdin pipe: a follower waits on it without any timeout while the
server idles, and sees EOF (and exits) as soon as rank 0 is gone.

Run as ``python -m sglang_backend.runtime.distributed.tp_worker`` by rank 0 only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import torch

from ..model_executor.forward_batch import ForwardBatch
from .parallel_state import destroy_tp, init_tp

logger = logging.getLogger(__name__)

# ForwardBatch fields the model runner fills in itself (not sent).
_LOCAL_FIELDS = {"req_to_token_pool", "token_to_kv_pool", "attn_backend"}


class ReqToTokenWriteLog:
    """Rank 0's req_to_token pool, recording each write for the followers; everything else is the pool's."""

    def __init__(self, pool):
        self.pool = pool
        self.writes: list[tuple] = []

    def __getattr__(self, name):  # only reached for names the wrapper does not define
        return getattr(self.pool, name)

    def write(self, idx: int, start: int, locs: torch.Tensor) -> None:
        self.pool.write(idx, start, locs)
        self.writes.append(("row", int(idx), int(start), locs.to("cpu", copy=True)))

    def write_tokens(self, rows: torch.Tensor, cols: torch.Tensor, locs: torch.Tensor) -> None:
        self.pool.write_tokens(rows, cols, locs)
        self.writes.append(("tokens", rows.to("cpu", copy=True), cols.to("cpu", copy=True), locs.to("cpu", copy=True)))

    def take(self) -> list[tuple]:
        writes, self.writes = self.writes, []
        return writes


def replay_writes(pool, writes: list[tuple]) -> None:
    for kind, a, b, locs in writes:
        if kind == "row":
            pool.write(a, b, locs)
        else:
            pool.write_tokens(a, b, locs)


def pack_forward(fb: ForwardBatch) -> dict:
    return {f.name: (v.cpu() if isinstance(v, torch.Tensor) else v)
            for f in dataclasses.fields(fb) if f.name not in _LOCAL_FIELDS for v in [getattr(fb, f.name)]}


def unpack_forward(fields: dict, device: str) -> ForwardBatch:
    return ForwardBatch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in fields.items()})


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPFollowers:
    """Rank 0's handle on ranks 1..N-1: starts them, joins the process group with them, feeds them."""

    def __init__(self, server_args, device: str):
        import sglang_backend

        size = server_args.tp_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(sglang_backend.__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")  # import this very copy of the package
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, env=env)
            pickle.dump((server_args, rank, init_method, torch.get_num_threads()), proc.stdin)
            proc.stdin.flush()
            self.procs.append(proc)
        try:
            init_tp(0, size, init_method, device)
        except BaseException:
            self.shutdown()
            raise

    def send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for proc in self.procs:
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise RuntimeError(f"tensor-parallel rank (pid {proc.pid}) is gone (exit code {proc.poll()})") from None

    def send_forward(self, fb: ForwardBatch, writes: list[tuple]) -> None:
        self.send((writes, pack_forward(fb)))

    def shutdown(self, wait_s: float = 30) -> None:
        """Tells the followers to exit; kills those still running after ``wait_s`` (stuck in a collective)."""
        for proc in self.procs:
            try:
                pickle.dump(None, proc.stdin)
                proc.stdin.close()
            except (BrokenPipeError, ValueError, OSError):
                pass
        deadline = time.monotonic() + wait_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        destroy_tp()


def _exit_with_parent(parent: int) -> None:
    """A follower stuck inside a collective when rank 0 dies would wait for the NCCL timeout: leave now."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def follower_main() -> None:
    from ..engine import load_model_assets
    from ..model_executor.model_runner import ModelRunner, resolve_device

    stdin = sys.stdin.buffer
    server_args, rank, init_method, threads = pickle.load(stdin)
    logging.basicConfig(level=server_args.log_level.upper(), format=f"[tp rank {rank}] %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(threads)
    device = resolve_device(server_args.device)
    if device.startswith("cuda"):
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    init_tp(rank, server_args.tp_size, init_method, device)
    model_dir, config, _ = load_model_assets(server_args)
    runner = ModelRunner(server_args, config, model_dir, tp_rank=rank)
    while True:
        try:
            msg = pickle.load(stdin)
        except EOFError:
            msg = None
        if msg is None:
            break
        writes, fields = msg
        replay_writes(runner.req_to_token_pool, writes)
        runner.forward(unpack_forward(fields, runner.device))
    destroy_tp()


if __name__ == "__main__":
    follower_main()
