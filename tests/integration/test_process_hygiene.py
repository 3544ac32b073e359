"""Process hygiene of ``sglang-backend serve`` (on the tiny dummy Llama, so each server starts in seconds):

* SIGKILL the server's main process: its pipeline processes (scheduler, detokenizer) die with it within 5 s
  (PR_SET_PDEATHSIG), even ones that cannot look for their parent (here: SIGSTOPped);
* SIGKILL the process that started the server with ``SGLANG_BACKEND_DIE_WITH_PARENT=1`` (what a test fixture
  does; here a stand-in "pytest" process): the whole server tree dies within 5 s;
* Ctrl-C (SIGINT to the process group, as a terminal sends it) with a stream in flight: the stream ends with an
  error event, the server exits with 130 within 15 s, prints one line and no traceback, and leaves no child;
  SIGTERM (a supervisor) lets the stream finish, then the server exits with 0;
* tensor-parallel followers die with rank 0, but not with a short-lived thread that built the Engine; the
  ``--dp`` launcher's helper (``pdeathsig_preexec``) and the start-up race of ``die_with_parent``.

The process table is read from /proc (Linux), as the pipeline processes are re-parented once the server is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.integration.conftest import REPO_ROOT, descendants, free_port
from tests.integration.conftest import _proc_table as proc_table
from tests.integration.conftest import still_alive as alive
from tests.sse import BackgroundStream

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG and /proc are Linux-only")

STARTUP_TIMEOUT_S = 120
GONE_WITHIN_S = 5


def wait_gone(procs: dict[int, str], timeout: float) -> list[str]:
    """Waits until none of ``procs`` runs; returns the command lines of those still running after ``timeout``
    (and SIGKILLs them)."""
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(procs)
    names = [f"{pid}: {cmdline(pid)}" for pid in left]
    for pid in left:  # ours: clean up before failing
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return names


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


# The server -------------------------------------------------------------------------------------------------------
def serve_cmd(model_dir: str, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang_backend", "serve", "--model-path", model_dir, "--load-format", "auto",
            "--port", str(port), "--max-total-tokens", "4096", "--log-level", "warning"]


def server_env() -> dict[str, str]:
    # One thread each (2 shared cores); and the servers die with this pytest process whatever happens to it.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "SGLANG_BACKEND_DIE_WITH_PARENT": "1"}


def read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def wait_healthy(url: str, proc: subprocess.Popen, log, running=None) -> None:
    """Polls /health until 200; fails if the server exits first (``running()``: whether it still runs, by default
    ``proc`` is alive)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if running is None:
            assert proc.poll() is None, f"exited with {proc.returncode} during start-up:\n{read(log)[-3000:]}"
        else:
            assert running(), f"the server exited during start-up:\n{read(log)[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not healthy after {STARTUP_TIMEOUT_S} s:\n{read(log)[-3000:]}"
        time.sleep(0.2)


def pipeline(pid: int) -> dict[int, str]:
    kids = descendants(pid)
    assert len(kids) >= 2, f"expected the scheduler and detokenizer processes, found {[cmdline(p) for p in kids]}"
    return kids


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


# Tests ------------------------------------------------------------------------------------------------------------
def test_sigkilled_server_leaves_no_pipeline_processes(tiny_gqa_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(serve_cmd(tiny_gqa_dir, port), stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=server_env(), start_new_session=True)
    try:
        wait_healthy(url, proc, log)
        kids = pipeline(proc.pid)
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        # Stopped pipeline processes stand for ones that cannot look for their parent themselves: loading a
        # model, inside a long forward, blocked sending to a peer that is gone. The kernel kills them anyway.
        for pid in info["pipeline_pids"].values():
            os.kill(pid, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_gone(kids, GONE_WITHIN_S)
        assert not left, f"still running {GONE_WITHIN_S} s after the server was SIGKILLed: {left}"
    finally:
        stop(proc)


def test_server_dies_with_a_sigkilled_parent(tiny_gqa_dir, tmp_path):
    """What a pytest session killed with SIGKILL does to the servers its fixtures started."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    fake_pytest = ("import os, subprocess, sys, time\n"
                   f"log = open({str(log)!r}, 'w')\n"
                   f"p = subprocess.Popen({serve_cmd(tiny_gqa_dir, port)!r}, stdout=log, stderr=subprocess.STDOUT,\n"
                   "                     env=dict(os.environ, SGLANG_BACKEND_DIE_WITH_PARENT='1'))\n"
                   "print(p.pid, flush=True)\n"
                   "time.sleep(600)\n")
    env = {k: v for k, v in server_env().items() if k != "SGLANG_BACKEND_DIE_WITH_PARENT"}  # only its child has it
    parent = subprocess.Popen([sys.executable, "-c", fake_pytest], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                              env=env, start_new_session=True)
    tree: dict[int, str] = {}
    try:
        server_pid = int(parent.stdout.readline())
        wait_healthy(url, parent, log,
                     running=lambda: parent.poll() is None and server_pid in descendants(parent.pid))
        pipeline(server_pid)
        tree = descendants(parent.pid)  # the server and its pipeline processes
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        left = wait_gone(tree, GONE_WITHIN_S)
        assert not left, (f"still running {GONE_WITHIN_S} s after the server's parent was SIGKILLed: "
                          f"{left}")
    finally:
        stop(parent)
        wait_gone(tree, 0)


def stop_with_a_stream_in_flight(model_dir: str, tmp_path, send_signal,
                                 extra_args: tuple[str, ...] = ()) -> tuple[int, float, str, list[str]]:
    """Starts a server, starts a long stream, calls ``send_signal(pid)`` once the stream has output; returns the
    server's exit status, seconds from the signal to its exit, its stderr and the stream's events. Checks
    that no pipeline process outlives it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([*serve_cmd(model_dir, port), *extra_args], stdout=o, stderr=e, cwd=REPO_ROOT,
                                env=server_env(),
                                start_new_session=True)  # its own process group, as a shell gives a command
    try:
        wait_healthy(url, proc, err)
        kids = pipeline(proc.pid)
        stream = BackgroundStream(url, {"input_ids": [5, 6, 7, 8], "stream": True,
                                         "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}},
                                  timeout=30).start()
        assert stream.started.wait(20), "the stream produced nothing"
        send_signal(proc.pid)
        t0 = time.monotonic()
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 15 s after the signal:\n{read(err)[-3000:]}")
        took = time.monotonic() - t0
        stream.thread.join(timeout=10)
        left = wait_gone(kids, GONE_WITHIN_S)
        assert not left, f"still running after the server exited: {left}"
        return code, took, read(err), stream.events
    finally:
        stop(proc)


def no_traceback(stderr: str) -> None:
    bad = [line for line in stderr.splitlines() if "Traceback" in line or "KeyboardInterrupt" in line]
    assert not bad, f"a traceback:\n{stderr}"


def test_ctrl_c_is_clean(tiny_gqa_dir, tmp_path):
    # What Ctrl-C in a terminal does: SIGINT to the whole foreground process group.
    code, took, stderr, events = stop_with_a_stream_in_flight(tiny_gqa_dir, tmp_path,
                                                              lambda pid: os.killpg(pid, signal.SIGINT))
    assert code in (0, 130), f"exit status {code}:\n{stderr[-3000:]}"
    no_traceback(stderr)
    assert stderr.count("sglang-backend: shutting down (Ctrl-C)") == 1, stderr
    # The request in flight was ended at once with an error (not cut off, not left to run out a grace period).
    assert events and events[-1] == "[DONE]", events[-3:]
    assert "error" in json.loads(events[-2]) and "shutting down" in events[-2], events[-3:]
    assert took < 10, f"exited {took:.1f} s after Ctrl-C"


def test_sigterm_lets_requests_finish_and_exits_0(tiny_gqa_dir, tmp_path):
    # What a supervisor (systemd, Kubernetes) does: SIGTERM to the main process.
    code, took, stderr, events = stop_with_a_stream_in_flight(tiny_gqa_dir, tmp_path,
                                                              lambda pid: os.kill(pid, signal.SIGTERM))
    assert code == 0, f"exit status {code}:\n{stderr[-3000:]}"
    no_traceback(stderr)
    assert stderr.count("sglang-backend: shutting down (SIGTERM)") == 1, stderr
    # The request in flight (a second or two of work) was let finish.
    assert events and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "length", last
    assert last["meta_info"]["completion_tokens"] == 480


def test_sigterm_ends_what_outlives_the_graceful_shutdown_timeout(tiny_gqa_dir, tmp_path):
    # A request longer than --graceful-shutdown-timeout (480 tokens take the tiny model a second or two): it gets
    # a well-formed error, and the server exits 0.
    code, took, stderr, events = stop_with_a_stream_in_flight(
        tiny_gqa_dir, tmp_path, lambda pid: os.kill(pid, signal.SIGTERM), extra_args=("--graceful-shutdown-timeout", "0.1"))
    assert code == 0, f"exit status {code}:\n{stderr[-3000:]}"
    no_traceback(stderr)
    assert events and events[-1] == "[DONE]", events[-3:]
    assert "error" in json.loads(events[-2]) and "shutting down" in events[-2], events[-3:]
    assert took < 5, f"exited {took:.1f} s after SIGTERM with a 0.1 s graceful-shutdown timeout"


# The helpers for other children: tensor-parallel followers, the --dp launcher's workers and router ------------------
def test_pdeathsig_preexec_kills_an_exec_d_program_with_its_parent():
    """``utils.pdeathsig_preexec`` (the --dp launcher starts its workers and sglang-router with it)."""
    script = ("import subprocess, time\n"
              "from sglang_backend.utils import pdeathsig_preexec\n"
              "p = subprocess.Popen(['sleep', '120'], preexec_fn=pdeathsig_preexec())\n"
              "print(p.pid, flush=True)\n"
              "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        sleeper = {child: proc_table()[child][2]}
        os.kill(child, signal.SIGSTOP)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        left = wait_gone(sleeper, GONE_WITHIN_S)
        assert not left, left
    finally:
        stop(parent)


def test_die_with_parent_exits_when_the_parent_is_already_gone():
    """The race: the parent died before the child's prctl, so no signal will come; the child sees that it has
    been re-parented and exits at once instead of running on."""
    r = subprocess.run([sys.executable, "-c", "import os\nfrom sglang_backend.utils import die_with_parent\n"
                        "die_with_parent(os.getppid() + 100000)\nprint('still running')"],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert r.returncode == 1 and "still running" not in r.stdout, (r.returncode, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-c", "import os, signal\nfrom sglang_backend.utils import die_with_parent\n"
                        "die_with_parent(os.getppid())\nprint(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "True", (r.returncode, r.stdout, r.stderr)


def test_tp_follower_dies_with_rank_0(tiny_gqa_dir):
    script = ("import time\n"
              "from sglang_backend import Engine\n"
              f"engine = Engine(model_path={tiny_gqa_dir!r}, tp_size=2, max_total_tokens=1024)\n"
              "print(engine.scheduler.model_runner.tp_followers.procs[0].pid, flush=True)\n"
              "time.sleep(120)\n")
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                             env=server_env(), start_new_session=True)
    try:
        line = rank0.stdout.readline()
        assert line.strip().isdigit(), f"rank 0 failed to start (exit {rank0.poll()})"
        follower = {int(line): proc_table()[int(line)][2]}
        os.kill(int(line), signal.SIGSTOP)  # one that cannot notice by itself (as inside a collective)
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(timeout=10)
        left = wait_gone(follower, GONE_WITHIN_S)
        assert not left, left
    finally:
        stop(rank0)


def test_tp_followers_outlive_the_thread_that_built_the_engine(tiny_gqa_dir):
    """PR_SET_PDEATHSIG fires when the parent *thread* exits: an Engine built on a short-lived thread must keep
    its followers (they are not given it then)."""
    from sglang_backend import Engine

    built: list = []
    t = threading.Thread(target=lambda: built.append(Engine(model_path=tiny_gqa_dir, tp_size=2, max_total_tokens=1024)))
    t.start()
    t.join()
    assert built, "the engine failed to build"
    engine = built[0]
    try:
        procs = list(engine.scheduler.model_runner.tp_followers.procs)
        time.sleep(1.0)
        assert [p.poll() for p in procs] == [None]
        out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert len(out["output_ids"]) == 4
    finally:
        engine.shutdown()
