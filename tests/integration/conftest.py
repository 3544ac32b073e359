"""Integration fixtures: ONE real ``sglang-backend serve`` subprocess for the whole session.

* ``server`` (session): starts ``python -m sglang_backend.cli serve`` with the embedded SmolLM2 on a free
  127.0.0.1 port, with ``--api-key`` (so the same server also serves the auth tests), waits for ``/health``
  (180 s), yields a :class:`ServerHandle`, and on teardown terminates it and asserts that none of its
  descendant processes (scheduler, detokenizer, multiprocessing's resource tracker) outlive it.
* After every test that used the server: it is still alive and ``GET /check_pool`` reports the KV pool
  whole (polled until the scheduler is idle, since aborted or disconnected requests may still be draining).
  If a test killed the server (a request that crashes a pipeline process is a bug), that test fails and a
  fresh server is started before the next test that needs one, so one crash does not fail every later test.

Environment knobs (all optional):
  SGLANG_TEST_SERVER_URL      reuse a running server instead of starting one (development); no teardown check
  SGLANG_TEST_API_KEY         its API key (default: the key the fixture starts the server with)
  SGLANG_TEST_SERVER_THREADS  OMP/torch threads of the server's processes (default 1: on a small shared CPU,
                              more threads than free cores makes every decode step several times slower)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests import memory_report

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "sk-integration-test-key"
STARTUP_TIMEOUT_S = 180
POOL_TIMEOUT_S = 90
SHUTDOWN_TIMEOUT_S = 20


# Process bookkeeping (psutil if installed, else /proc) ------------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, start time) for every live process."""
    try:
        import psutil  # type: ignore

        table = {}
        for p in psutil.process_iter(["pid", "ppid", "status", "create_time"]):
            info = p.info
            table[info["pid"]] = (info["ppid"], "Z" if info["status"] == psutil.STATUS_ZOMBIE else "R",
                                  str(info["create_time"]))
        return table
    except ImportError:
        pass
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ..." ; comm may contain spaces/parens: split after the last ')'.
        rest = stat[stat.rfind(")") + 2:].split()
        table[int(name)] = (int(rest[1]), rest[0], rest[19])
    return table


def descendants(pid: int) -> dict[int, str]:
    """Live descendants of ``pid``: pid -> start time (to tell a reused pid apart)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(p)
    out, todo = {}, list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out[p] = table[p][2]
        todo.extend(children.get(p, []))
    return out


def still_alive(procs: dict[int, str]) -> list[int]:
    table = _proc_table()
    return [p for p, start in procs.items() if p in table and table[p][2] == start and table[p][1] != "Z"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The handle tests get ----------------------------------------------------------------------------------------------
@dataclass
class ServerHandle:
    url: str
    api_key: str
    proc: subprocess.Popen | None = None
    log_path: str | None = None
    seen_children: dict[int, str] = field(default_factory=dict)
    log_dir: str | None = None
    starts: int = 0
    needs_restart: bool = False
    extra_args: list[str] = field(default_factory=list)  # more `serve` flags (e.g. --model-path of a tiny model)
    extra_env: dict[str, str] = field(default_factory=dict)

    # Process life cycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        from sglang_backend.runtime.model_loader.embedded import default_model_path

        default_model_path()  # converts the embedded GGUF once (cached) before the start-up clock runs
        port = free_port()
        self.starts += 1
        self.log_path = os.path.join(self.log_dir, f"server-{self.starts}.log")
        env = dict(os.environ)
        threads = os.environ.get("SGLANG_TEST_SERVER_THREADS", "1")
        # SGLANG_BACKEND_DIE_WITH_PARENT: a SIGKILLed pytest takes its servers with it (no orphans).
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false", SGLANG_BACKEND_DIE_WITH_PARENT="1", **self.extra_env)
        cmd = [sys.executable, "-m", "sglang_backend.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--api-key", self.api_key, "--log-level", "warning",
               # A 540 MiB KV pool (SmolLM2: 46 KiB a token), not the 2 GiB default; extra_args may override it.
               "--max-total-tokens", "12288", *self.extra_args]  # no --model-path: the embedded default
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            self.seen_children.update(descendants(self.proc.pid))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop(check=False)
                raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")
            time.sleep(0.5)
        self.seen_children.update(descendants(self.proc.pid))

    def stop(self, check: bool = True) -> list[int]:
        """SIGTERM, wait; returns the descendants still alive afterwards (orphans), after killing them."""
        proc = self.proc
        if proc is None:
            return []
        if proc.poll() is None:
            self.seen_children.update(descendants(proc.pid))
            memory_report.record_server([proc.pid, *descendants(proc.pid)])
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                if check:
                    raise AssertionError(f"server did not exit within {SHUTDOWN_TIMEOUT_S} s of SIGTERM "
                                         f"(killed):\n{self.log_tail()}")
        # The pipeline processes die with the server (PR_SET_PDEATHSIG); give the kernel and reaping a moment.
        deadline = time.monotonic() + 15
        while still_alive(self.seen_children) and time.monotonic() < deadline:
            time.sleep(0.25)
        orphans = still_alive(self.seen_children)
        for pid in orphans:  # ours: clean up before reporting
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return orphans

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def async_client(self, timeout: float = 120.0, max_connections: int = 64) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout, limits=limits)

    def openai(self, **kwargs):
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, **kwargs)

    def log_tail(self, n: int = 60) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def is_alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def stats(self) -> dict:
        with self.client(timeout=30) as c:
            r = c.get("/get_stats")
            r.raise_for_status()
            return r.json()

    def wait_idle(self, timeout: float = POOL_TIMEOUT_S) -> dict:
        """Polls /get_stats until nothing runs or waits; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["num_running"] == 0 and s["num_waiting"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s: {s}")
            time.sleep(0.2)

    def assert_pool_whole(self, timeout: float = POOL_TIMEOUT_S) -> None:
        """GET /check_pool until whole. "not idle" is polled through; any other problem must clear too."""
        deadline = time.monotonic() + timeout
        last = None
        with self.client(timeout=30) as c:
            while True:
                r = c.get("/check_pool")
                assert r.status_code == 200, r.text
                last = r.json()
                if last["whole"]:
                    assert last["problem"] is None
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"KV pool not whole after {timeout}s: {last['problem']}\n{self.log_tail()}")
                time.sleep(0.2)


# Fixtures ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def server(tmp_path_factory):
    external = os.environ.get("SGLANG_TEST_SERVER_URL")
    if external:
        yield ServerHandle(external.rstrip("/"), os.environ.get("SGLANG_TEST_API_KEY", API_KEY))
        return
    handle = ServerHandle("", API_KEY, log_dir=str(tmp_path_factory.mktemp("server")))
    handle.start()
    try:
        yield handle
    finally:
        orphans = handle.stop()
    assert handle.seen_children, "the server spawned no pipeline processes (expected scheduler + detokenizer)"
    assert not orphans, f"server left orphan processes {orphans}:\n{handle.log_tail()}"


@pytest.fixture
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture
def oai(server):
    client = server.openai()
    yield client
    client.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item._call_failed = report.failed


@pytest.fixture(autouse=True)
def _server_healthy_and_pool_whole(request):
    """Around each test that uses the server: before, replace a server an earlier test killed; after, the
    process is alive, /health is 200 and the KV pool is whole."""
    uses_server = "server" in request.fixturenames
    if uses_server:
        srv: ServerHandle = request.getfixturevalue("server")
        if srv.needs_restart:  # lazily, so a crash in the session's last test costs no restart
            orphans = srv.stop(check=False)
            srv.start()
            srv.needs_restart = False
            assert not orphans, f"the dead server left orphan processes {orphans}"
    yield
    if not uses_server:
        return
    healthy = srv.is_alive()
    if healthy:
        try:
            healthy = httpx.get(srv.url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            healthy = False
    if not healthy:
        if srv.proc is not None:
            srv.needs_restart = True
        if not getattr(request.node, "_call_failed", False):  # a failing test already said so
            raise AssertionError(f"the server is unhealthy after this test:\n{srv.log_tail()}")
        return
    srv.assert_pool_whole()
