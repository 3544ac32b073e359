"""Data parallelism on one host: ``sglang-backend serve --dp N``.

Starts N ordinary workers (``sglang-backend serve``) on ports port+1 .. port+N (loopback; on GPUs each gets
its own ``tp_size`` GPUs through CUDA_VISIBLE_DEVICES) and the real
``sglang-router`` (PyPI ``sglang-router``, Rust) on ``--host``:``--port`` in front of them, with its
cache-aware policy by default: requests sharing a prefix go to the worker whose radix cache already holds
it, and load is balanced when workers drift apart. We write no router of our own.

Across hosts, run the workers yourself and point the router at them (see the README, "Scale-out").
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import subprocess
import sys
import time

import requests
import torch

from ... import environ
from ...utils import pdeathsig_preexec
from ..server_args import ServerArgs

logger = logging.getLogger(__name__)

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
WORKER_STARTUP_TIMEOUT_S = 600


def worker_argv(server_args, port: int) -> list[str]:
    """``sglang-backend serve`` flags reproducing ``server_args`` (only the non-defaults), on loopback:port."""
    argv = [sys.executable, "-m", "sglang_backend.cli", "serve"]
    for f in dataclasses.fields(ServerArgs):
        value = getattr(server_args, f.name)
        if f.name in ("host", "port") or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv + ["--host", "127.0.0.1", "--port", str(port)]


ROUTER_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error", "critical": "error"}


def router_argv(worker_urls: list[str], host: str, port: int, policy: str, prometheus_port: int,
                log_level: str = "info", api_key: str | None = None) -> list[str]:
    # With an API key the router uses it for its own calls to the workers (and forwards each client's
    # Authorization header with the client's requests).
    auth = ["--api-key", api_key] if api_key else []
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-port", str(prometheus_port),
            "--log-level", ROUTER_LOG_LEVELS.get(log_level.lower(), "info"),
            # Notice a dead worker within seconds (the defaults check once a minute); stop promptly.
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
            "--shutdown-grace-period-secs", "5"] + auth


def gpu_split(server_args, dp: int) -> list[dict]:
    """Per worker, the environment that gives it its own tp_size GPUs (nothing when on CPU or too few GPUs)."""
    if server_args.device == "cpu":
        return [{} for _ in range(dp)]
    visible = environ.CUDA_VISIBLE_DEVICES.get()
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    per = server_args.tp_size
    if len(gpus) < dp * per:
        if gpus:
            logger.warning("%d GPUs for %d workers x tp_size %d: workers share GPUs", len(gpus), dp, per)
        return [{} for _ in range(dp)]
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])} for i in range(dp)]


def free_ports_after(port: int, n: int) -> list[int]:
    """The first ``n`` ports above ``port`` that nothing listens on or holds (a port next to the router's may
    be a client connection's ephemeral port: binding it would fail the worker's start)."""
    found = []
    for candidate in range(port + 1, min(port + 1000, 65536)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        found.append(candidate)
        if len(found) == n:
            return found
    raise RuntimeError(f"no {n} free ports above {port}")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = WORKER_STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {url} exited with code {proc.returncode} during start-up")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {url} not healthy after {timeout:.0f}s")
        time.sleep(0.5)


def serve_dp(server_args, dp: int, policy: str = "cache_aware") -> int:
    """Runs N workers + the router until SIGINT/SIGTERM or until the router exits; stops them all."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise SystemExit("--dp needs sglang-router: pip install 'sglang-backend[router]'") from None
    if policy not in ROUTER_POLICIES:
        raise SystemExit(f"--router-policy must be one of {ROUTER_POLICIES}")
    logging.basicConfig(level=server_args.log_level.upper(), format="[dp] %(levelname)s %(message)s")
    *ports, metrics_port = free_ports_after(server_args.port, dp + 1)  # the workers', then the router's metrics
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # Workers and router die with this process even if it is SIGKILLed (PR_SET_PDEATHSIG, set between fork and
    # exec, so it also covers their start-up; started from this main thread, which lives as long as they do).
    # The router ignores Ctrl-C (it would print a KeyboardInterrupt traceback): the finally below stops it.
    die, die_no_sigint = pdeathsig_preexec(), pdeathsig_preexec(ignore_sigint=True)
    try:
        workers = [subprocess.Popen(worker_argv(server_args, p), env=environ.child_env(**extra), preexec_fn=die)
                   for p, extra in zip(ports, gpu_split(server_args, dp))]
        procs += workers
        for url, proc in zip(urls, workers):
            try:
                wait_healthy(url, proc)
            except RuntimeError:
                if stopping:  # Ctrl-C during start-up: the workers got it too and exited
                    return 0
                raise
        logger.info("%d workers up: %s", dp, " ".join(urls))
        router = subprocess.Popen(router_argv(urls, server_args.host, server_args.port, policy,
                                              metrics_port, server_args.log_level, server_args.api_key),
                                  preexec_fn=die_no_sigint)
        procs.append(router)
        logger.info("sglang-router (%s) on http://%s:%d", policy, server_args.host, server_args.port)
        while not stopping and router.poll() is None:
            time.sleep(0.5)  # a dead worker is the router's business: it routes around it
        return 0 if stopping else 1
    finally:
        for proc in reversed(procs):  # router first, so it stops sending work
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
