"""Rank 0's side of tensor parallelism and the step protocol both sides speak (see ``tp_worker`` for the whole
design): ``TPFollowers`` starts ranks 1..N-1 and feeds them each step; ``ReqToTokenWriteLog`` records rank 0's
slot-table writes for them; ``encode_step``/``decode_step``/``receive_step`` are the wire format.

Below the model executor: ``model_runner`` imports this module; ``tp_worker`` (the follower process, which
builds a ``ModelRunner``) imports both. Nothing here imports the executor.
"""

from __future__ import annotations

import gc
import logging
import os
import pathlib
import pickle
import socket
import subprocess
import sys
import threading
import time

import torch

from ... import environ
from ..model_executor.forward_batch import ForwardBatch, ForwardMode
from .parallel_state import broadcast_device, broadcast_object, destroy_tp, init_tp

logger = logging.getLogger(__name__)

# The follower process's module (run with ``python -m``); named, not imported: it imports the model runner.
FOLLOWER_MODULE = "sglang_backend.runtime.distributed.tp_worker"
# This copy of the package's parent folder, put on the followers' PYTHONPATH.
PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[3])

# The step header: HEADER_INTS int64, the first _META of them these fields, then the host integers inline.
HEADER_INTS = 1024
(H_KIND, H_MODE, H_TOKENS, H_BS, H_LOGITS, H_MM, H_PREFIX_LENS, H_EXTEND_LENS, H_WRITES, H_CPU_INTS,
 H_SHARED_FIRST_SLOT) = range(11)
_META = 11
INLINE_INTS = HEADER_INTS - _META
EXIT, FORWARD = 0, 1
_MODES = [ForwardMode.EXTEND, ForwardMode.DECODE]
# Table writes, flattened: [ROW_WRITE, row, start, n, *locs] or [TOKEN_WRITES, n, *rows, *cols, *locs].
ROW_WRITE, TOKEN_WRITES = 0, 1


def _ints(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", torch.int64, copy=True)  # the slots are host tensors already: a memcpy, no device sync


class ReqToTokenWriteLog:
    """Rank 0's req_to_token pool, recording each write (flattened, on the host) for the followers; everything
    else is the pool's. The slots come from the host-side allocator, so recording them copies no device data."""

    def __init__(self, pool):
        self.pool = pool
        self.writes: list[torch.Tensor] = []

    def __getattr__(self, name):  # only reached for names the wrapper does not define
        return getattr(self.pool, name)

    def write(self, idx: int, start: int, locs: torch.Tensor) -> None:
        self.pool.write(idx, start, locs)
        self.writes += [_ints([ROW_WRITE, int(idx), int(start), len(locs)]), _host_copy(locs)]

    def write_tokens(self, rows: torch.Tensor, cols: torch.Tensor, locs: torch.Tensor) -> None:
        self.pool.write_tokens(rows, cols, locs)
        self.writes += [_ints([TOKEN_WRITES, len(locs)])] + [_host_copy(t) for t in (rows, cols, locs)]

    def take(self) -> torch.Tensor:
        """Every write since the last call, as one flat int64 tensor."""
        writes, self.writes = self.writes, []
        return torch.cat(writes) if writes else torch.empty(0, dtype=torch.int64)


def replay_writes(pool, writes: torch.Tensor) -> None:
    i, end = 0, len(writes)
    while i < end:
        if int(writes[i]) == ROW_WRITE:
            row, start, n = writes[i + 1 : i + 4].tolist()
            pool.write(row, start, writes[i + 4 : i + 4 + n])
            i += 4 + n
        else:
            n = int(writes[i + 1])
            rows, cols, locs = writes[i + 2 : i + 2 + 3 * n].view(3, n)
            pool.write_tokens(rows, cols, locs)
            i += 2 + 3 * n


# One step: header + host integers + device payload ------------------------------------------------------------------
def _device_fields(fb: ForwardBatch) -> list[torch.Tensor]:
    fields = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens]
    return fields + ([fb.logits_indices] if fb.logits_indices is not None else [])


def encode_step(fb: ForwardBatch, writes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(header, overflow, payload): the host integers go in the header when they fit, else in ``overflow``;
    ``payload`` is on the batch's device (one concatenation there, no host copy)."""
    host = torch.cat([_ints(fb.seq_lens_cpu), _ints(fb.extend_prefix_lens_cpu), _ints(fb.extend_seq_lens_cpu),
                      writes])
    header = torch.zeros(HEADER_INTS, dtype=torch.int64)
    header[:_META] = _ints([
        FORWARD, _MODES.index(fb.forward_mode), len(fb.input_ids), fb.batch_size,
        -1 if fb.logits_indices is None else len(fb.logits_indices), fb.mm_inputs is not None,
        len(fb.extend_prefix_lens_cpu), len(fb.extend_seq_lens_cpu), len(writes), len(host), fb.shares_prefix])
    inline = len(host) <= INLINE_INTS
    if inline:
        header[_META : _META + len(host)] = host
    parts = []
    for t in _device_fields(fb):
        t = t.reshape(-1).to(torch.int64)
        parts.append(t)
        if len(t) % 2:  # every field starts 16-byte aligned (Triton specialises kernels on pointer alignment)
            parts.append(t.new_zeros(1))
    payload = torch.cat(parts)
    return header, (torch.empty(0, dtype=torch.int64) if inline else host), payload


def _padded(n: int) -> int:
    return n + n % 2


def _field_sizes(header: torch.Tensor) -> list[int]:
    tokens, bs, logits = header[H_TOKENS : H_LOGITS + 1].tolist()
    return [tokens, tokens, tokens, bs, bs] + ([logits] if logits >= 0 else [])


def payload_len(header: torch.Tensor) -> int:
    return sum(_padded(n) for n in _field_sizes(header))


def decode_step(header: torch.Tensor, overflow: torch.Tensor, payload: torch.Tensor,
                mm_inputs=None) -> tuple[ForwardBatch, torch.Tensor]:
    """The inverse of ``encode_step``: (the ForwardBatch, the flat table writes)."""
    (_, mode, tokens, bs, logits, _, n_prefix, n_extend, n_writes, n_host, shared) = header[:_META].tolist()
    host = header[_META : _META + n_host] if n_host <= INLINE_INTS else overflow
    seq_lens_cpu, prefix_lens, extend_lens, writes = host.split([bs, n_prefix, n_extend, n_writes])
    sizes = _field_sizes(header)
    fields = [f[:n] for f, n in zip(payload.split([_padded(n) for n in sizes]), sizes)]
    fb = ForwardBatch(_MODES[mode], *fields[:5], seq_lens_cpu=seq_lens_cpu.tolist(),
                      extend_prefix_lens_cpu=prefix_lens.tolist(), extend_seq_lens_cpu=extend_lens.tolist(),
                      logits_indices=fields[5] if logits >= 0 else None, mm_inputs=mm_inputs,
                      shares_prefix=bool(shared))
    return fb, writes


def send_step(pipes, fb: ForwardBatch, writes: torch.Tensor) -> None:
    """Rank 0: the step to every follower (``receive_step`` on their side); ``pipes``: their stdin."""
    header, overflow, payload = encode_step(fb, writes)
    data = header.numpy().tobytes() + overflow.numpy().tobytes()
    for pipe in pipes:
        pipe.write(data)
        pipe.flush()
    if fb.mm_inputs is not None:
        broadcast_object(fb.mm_inputs)
    broadcast_device(payload)


def send_exit(pipes) -> None:
    header = torch.zeros(HEADER_INTS, dtype=torch.int64)
    header[H_KIND] = EXIT
    for pipe in pipes:
        pipe.write(header.numpy().tobytes())
        pipe.flush()


def _read_ints(pipe, n: int) -> torch.Tensor | None:
    """Exactly ``n`` int64 from the pipe; None at its end (rank 0 is gone)."""
    buf = bytearray(8 * n)
    view, got = memoryview(buf), 0
    while got < len(buf):
        k = pipe.readinto(view[got:])
        if not k:
            return None
        got += k
    return torch.frombuffer(buf, dtype=torch.int64)


def receive_step(pipe, device: str) -> tuple[ForwardBatch, torch.Tensor] | None:
    """Followers: waits (without timeout) for rank 0's next step on ``pipe`` (stdin); None when rank 0 says
    exit or is gone."""
    header = _read_ints(pipe, HEADER_INTS)
    if header is None or int(header[H_KIND]) == EXIT:
        return None
    n_host = int(header[H_CPU_INTS])
    overflow = None
    if n_host > INLINE_INTS:
        overflow = _read_ints(pipe, n_host)
        if overflow is None:
            return None
    mm_inputs = broadcast_object() if int(header[H_MM]) else None
    payload = broadcast_device(torch.empty(payload_len(header), dtype=torch.int64, device=device))
    return decode_step(header, overflow, payload, mm_inputs)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPFollowers:
    """Rank 0's handle on ranks 1..N-1: starts them, joins the process group with them, feeds them."""

    def __init__(self, server_args, device: str):
        size = server_args.tp_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        env = environ.child_env()
        env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")  # import this very copy of the package
        self.procs: list[subprocess.Popen] = []
        # Set by the model runner once every rank has built its model (the start-up collectives are done):
        # from then on the followers wait for step headers, and an exit header reaches them.
        self.ready = False
        # The followers die with this process (PR_SET_PDEATHSIG) when started from its main thread. The kernel
        # signals them when the *thread* that started them exits, and an Engine may be built on a short-lived
        # thread: then they rely on _exit_with_parent (and the end of their pipe) alone.
        pdeathsig = threading.current_thread() is threading.main_thread()
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", FOLLOWER_MODULE, str(os.getpid()), str(int(pdeathsig))],
                                    stdin=subprocess.PIPE, env=env)
            pickle.dump((server_args, rank, init_method, torch.get_num_threads()), proc.stdin)
            proc.stdin.flush()
            self.procs.append(proc)
        try:
            init_tp(0, size, init_method, device)
        except BaseException:
            self.shutdown()
            raise

    def send_forward(self, fb: ForwardBatch, writes: torch.Tensor) -> None:
        try:
            send_step([p.stdin for p in self.procs], fb, writes)
        except (RuntimeError, BrokenPipeError, ValueError) as e:
            gone = [f"pid {p.pid} exit code {p.returncode}" for p in self.procs if p.poll() is not None]
            if gone:
                raise RuntimeError(f"tensor-parallel rank is gone ({', '.join(gone)})") from e
            raise

    def shutdown(self, wait_s: float = 30) -> None:
        """Tells the followers to exit and leaves the process group together with them (NCCL tears a
        communicator down collectively: a rank that waited for the others to exit first would wait in vain);
        kills those still running after ``wait_s`` (stuck in a collective), or at once while they are still
        starting up (they may be inside a start-up collective, where an exit header would not reach them)."""
        graceful = self.ready and bool(self.procs)
        leave = threading.Thread(target=self._exit_and_destroy, args=([p.stdin for p in self.procs],), daemon=True)
        if graceful:
            leave.start()  # a thread: a stuck follower must not block rank 0's shutdown
        deadline = time.monotonic() + (wait_s if graceful else 0)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not graceful:
            for proc in self.procs:
                try:
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
        self.procs = []
        self.ready = False
        if not graceful:
            destroy_tp()
            return
        leave.join(timeout=10)  # returns (or fails) once the followers are gone
        if leave.is_alive():
            logger.warning("the tensor-parallel process group did not shut down; left behind")

    @staticmethod
    def _exit_and_destroy(pipes) -> None:
        for pipe in pipes:
            try:
                send_exit([pipe])
                pipe.close()
            except (BrokenPipeError, ValueError, OSError):  # a follower already gone
                pass
        destroy_tp()


def release_graphs(runner) -> None:
    """Drops the runner's CUDA graphs before the process group goes: the graphs hold the NCCL collectives
    captured in them, and tearing the communicator down under them left it hanging on the GPU (the follower
    had to be killed, rank 0 aborted at exit)."""
    if runner.graph_runner is None:
        return
    runner.graph_runner = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
