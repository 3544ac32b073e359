"""Reliability fixtures: real ``sglang-backend serve`` subprocesses on 127.0.0.1, each serving the tiny dummy Llama
(vocab 512, 512 positions) so that thousands of requests take seconds on two CPU cores.

* ``rel_server`` (session scope): default limits, two API keys (``KEY_A``, ``KEY_B``: two clients whose request
  ids must stay apart). After every test that used it: alive, ``/health`` 200, KV pool whole.
* ``start_server(tmp_path_factory, tiny_dir, *flags, env=...)``: a dedicated server (fault injection, overload
  limits, a server the test kills); the caller stops it (``stop()`` returns orphaned descendants, if any).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import httpx
import pytest

_spec = importlib.util.spec_from_file_location(
    "_integration_conftest", os.path.join(os.path.dirname(__file__), os.pardir, "integration", "conftest.py"))
_integration = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _integration  # dataclasses look their module up there
_spec.loader.exec_module(_integration)
ServerHandle = _integration.ServerHandle
descendants = _integration.descendants
still_alive = _integration.still_alive

KEY_A = "sk-reliability-a"
KEY_B = "sk-reliability-b"


def start_server(tmp_path_factory, model_dir: str, *flags: str, env: dict | None = None) -> ServerHandle:
    handle = ServerHandle("", KEY_A, log_dir=str(tmp_path_factory.mktemp("rel_server")),
                          # a later --api-key wins in argparse: the server accepts both keys, the handle sends KEY_A
                          extra_args=["--model-path", model_dir, "--api-key", f"{KEY_A},{KEY_B}", *flags],
                          extra_env=dict(env or {}))
    handle.start()
    return handle


def rss_kib(pids) -> int:
    """Resident memory of these processes together (KiB, from /proc)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def server_pids(handle: ServerHandle) -> list[int]:
    return [handle.proc.pid, *descendants(handle.proc.pid)]


def assert_healthy_and_whole(handle: ServerHandle) -> None:
    assert handle.is_alive(), f"the server died:\n{handle.log_tail()}"
    assert httpx.get(handle.url + "/health", timeout=10).status_code == 200, handle.log_tail()
    handle.assert_pool_whole(timeout=60)


@pytest.fixture(scope="session")
def rel_server(tmp_path_factory, tiny_gqa_dir):
    handle = start_server(tmp_path_factory, tiny_gqa_dir)
    try:
        yield handle
    finally:
        orphans = handle.stop()
    assert not orphans, f"server left orphan processes {orphans}:\n{handle.log_tail()}"


@pytest.fixture(autouse=True)
def _rel_server_whole_after_test(request):
    yield
    if "rel_server" in request.fixturenames:
        assert_healthy_and_whole(request.getfixturevalue("rel_server"))


@pytest.fixture(scope="session")
def rel(tmp_path_factory, tiny_gqa_dir):
    """The helpers above for test modules (conftest modules are not importable by name)."""
    import functools
    import types

    return types.SimpleNamespace(start_server=functools.partial(start_server, tmp_path_factory, tiny_gqa_dir),
                                 descendants=descendants, still_alive=still_alive, proc_table=_integration._proc_table,
                                 assert_healthy_and_whole=assert_healthy_and_whole, rss_kib=rss_kib, server_pids=server_pids)
