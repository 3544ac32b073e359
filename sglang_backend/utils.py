"""Small helpers shared across the package."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
from typing import AsyncIterator, Callable, Iterator, TypeVar

from . import environ

T = TypeVar("T")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DIE_WITH_PARENT_ENV = environ.DIE_WITH_PARENT.name


async def iterate_in_thread(it: Iterator[T]) -> AsyncIterator[T]:
    """An async iterator over a blocking iterator: each ``next`` runs in a worker thread."""
    sentinel = object()
    while True:
        item = await asyncio.to_thread(next, it, sentinel)
        if item is sentinel:
            return
        yield item


def _pdeathsig_setter() -> Callable[[], int] | None:
    """A function doing ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (returns 0 on success), or None if not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # the process's own libc (glibc or musl)
    except (OSError, AttributeError):
        return None
    args = (ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
            ctypes.c_ulong(0))  # prctl is variadic: pass the unsigned longs it reads, not C ints
    return lambda: prctl(*args)


def die_with_parent(expected_parent_pid: int | None = None, *, ignore_sigint: bool = True,
                    pdeathsig: bool = True) -> None:
    """Makes this process die (SIGKILL) when its parent dies, whenever that happens; call it first thing.

    On Linux this is ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; elsewhere only the check below runs. Then, because
    the parent may have died before the ``prctl`` (the kernel would not signal us for that), the parent is
    checked to still be ``expected_parent_pid`` and the process exits at once if it is not. By default that pid
    is the one multiprocessing recorded for a multiprocessing child (its creator), else ``os.getppid()``.

    Caveat: the kernel sends the signal when the parent *thread* that started this process exits, not the
    parent process. Start such children from a thread that lives as long as they should: the server's
    pipeline processes are started by the HTTP process's main thread (``launch_server`` blocks in it until the
    server stops), so they live exactly as long as the server.

    ``ignore_sigint``: a Ctrl-C in a terminal goes to the whole process group; children leave it to their
    parent, which stops them as part of its own clean shutdown (no KeyboardInterrupt tracebacks from them).
    ``pdeathsig=False``: only that and the check (a parent thread that may exit before the parent does).
    """
    if ignore_sigint:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: leave SIGINT alone
            pass
    if expected_parent_pid is None:
        parent = multiprocessing.parent_process()
        expected_parent_pid = parent.pid if parent is not None else os.getppid()
    set_pdeathsig = _pdeathsig_setter() if pdeathsig else None
    if set_pdeathsig is not None and set_pdeathsig() != 0:
        print(f"sglang-backend: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
    if os.getppid() != expected_parent_pid:  # the parent died before the prctl: we have been re-parented
        os._exit(1)


def die_with_parent_if_requested() -> None:
    """``die_with_parent(os.getppid())`` when ``SGLANG_BACKEND_DIE_WITH_PARENT=1``: for a process whose
    parent supervises it (a test fixture), so that it cannot outlive the parent even when that is SIGKILLed.
    Ctrl-C keeps working as usual (SIGINT is not ignored). The parent must start it from a thread that lives
    as long as it should run (a pytest fixture: the main thread); see ``die_with_parent``."""
    if environ.DIE_WITH_PARENT.get():
        die_with_parent(os.getppid(), ignore_sigint=False)


def pdeathsig_preexec(ignore_sigint: bool = False) -> Callable[[], None] | None:
    """For ``subprocess.Popen(preexec_fn=...)``: the new process (the setting survives ``exec``) gets SIGKILL
    when the thread calling ``Popen`` exits (see ``die_with_parent``), also for programs that are not ours.
    ``ignore_sigint``: it also ignores SIGINT (a terminal's Ctrl-C; the parent stops it). None where
    unsupported (not Linux). Everything is resolved here, before the fork: between fork and exec the child
    only calls ``prctl``, ``getppid`` and (``ignore_sigint``) ``signal``."""
    set_pdeathsig = _pdeathsig_setter()
    if set_pdeathsig is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        set_pdeathsig()
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def to_device_async(t, device):
    """Host tensor -> ``device``; to a GPU through pinned memory without blocking, so the copy does not wait for the
    work already queued on the stream. Elsewhere a plain ``.to``."""
    if not str(device).startswith("cuda"):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def release_freed_memory() -> None:
    """Hands freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere). Python frees a failed
    large computation's objects, but glibc keeps the pages: without this a grammar that hit its budget left
    its peak resident memory behind."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own symbols include libc's
    except (OSError, AttributeError):  # musl has no malloc_trim
        return None


class TimeLimitExceeded(Exception):
    """Raised inside a ``time_limit`` block that ran past its limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Interrupts the Python code of this block (an asynchronous ``TimeLimitExceeded`` in this thread) once it has
    run ``seconds``. Only bytecode is interrupted: a single long C call finishes first. For code that has no
    budget of its own, such as a Jinja template's loops."""
    tid = ctypes.c_ulong(threading.get_ident())
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def interrupt():
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(tid, ctypes.py_object(TimeLimitExceeded))

    timer = threading.Timer(seconds, interrupt)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["fired"]:  # the block ended just as the limit passed: drop the exception if still pending
                ctypes.pythonapi.PyThreadState_SetAsyncExc(tid, None)


def download_and_cache_file(url: str, filename: str | None = None) -> str:
    """Upstream's ``sglang.utils.download_and_cache_file`` (its benchmark programs fetch data sets with it): the
    file at ``url`` saved as ``filename`` (default: its last path part, under our cache root's ``downloads/``),
    downloaded once with a progress bar; later calls return the saved path. An HTTP error raises."""
    import shutil  # deferred, as the rest: only upstream's benchmark programs call this
    import urllib.request

    from tqdm import tqdm  # deferred: a dependency, but not one every process needs

    from .runtime.model_loader.embedded import cache_root  # deferred: utils is imported by every process

    if filename is None:
        filename = os.path.join(cache_root(), "downloads", url.rstrip("/").split("/")[-1])
    if os.path.exists(filename):
        return filename
    os.makedirs(os.path.dirname(os.path.abspath(filename)), exist_ok=True)
    partial = f"{filename}.part"
    with urllib.request.urlopen(url) as resp, open(partial, "wb") as out:
        total = int(resp.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(filename)) as bar:
            while chunk := resp.read(1 << 16):
                out.write(chunk)
                bar.update(len(chunk))
    shutil.move(partial, filename)  # only a whole download is ever found by a later call
    return filename


def read_jsonl(filename: str) -> Iterator:
    """Upstream's ``sglang.utils.read_jsonl``: the JSON value of each line, skipping blank and ``#`` lines."""
    import json  # deferred: rarely needed

    with open(filename, encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                yield json.loads(line)


class HttpResponse:
    """What ``http_request`` returns: upstream's shape (``status_code``, ``json()``, ``text``, ``iter_lines()``)."""

    def __init__(self, status_code: int, body):
        self.status_code = status_code
        self._body = body  # bytes, or (stream=True) the open response to read lines from

    @property
    def text(self) -> str:
        return self._body.decode("utf-8") if isinstance(self._body, bytes) else self._body.read().decode("utf-8")

    def json(self):
        import json  # deferred: only the upstream-compatible helper needs it

        return json.loads(self.text)

    def iter_lines(self) -> Iterator[bytes]:
        lines = self._body.splitlines() if isinstance(self._body, bytes) else self._body
        for line in lines:
            yield line.rstrip(b"\r\n")


def http_request(url: str, json=None, stream: bool = False, api_key: str | None = None, verify=None,
                 method: str | None = None) -> HttpResponse:
    """Upstream's ``sglang.utils.http_request`` (its examples call a server with it): a JSON POST (GET without a
    body), with an ``Authorization: Bearer`` header given ``api_key``; an HTTP error status is returned, not
    raised, as upstream's. ``stream=True`` leaves the body open for ``iter_lines()``; ``verify``: a CA file."""
    import json as json_lib  # deferred: the helpers above are imported by every process, this rarely
    import ssl
    import urllib.error
    import urllib.request

    data = None if json is None else json_lib.dumps(json).encode("utf-8")
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json; charset=utf-8")
    if api_key is not None:
        req.add_header("Authorization", f"Bearer {api_key}")
    context = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else None
    try:
        resp = urllib.request.urlopen(req, context=context)
    except urllib.error.HTTPError as e:
        return HttpResponse(e.code, e.read())
    return HttpResponse(resp.status, resp if stream else resp.read())
