"""The project's small C kernels (the ``*.c`` files next to this module), compiled on first use and cached.

``load()`` compiles every ``*.c`` here (with ``native.h``) into one library,
``<cache root>/kernels/sglang_native-<hash>.so``, with the system C compiler (``$CC``, else ``cc``) and returns
it as a ``ctypes.CDLL``: one library, so the kernels share one worker pool (``thread_pool.c``). The hash covers
the sources, the flags and the compiler's version, so an edited kernel or a new compiler builds afresh. Builds
are serialized across processes by a file lock and renamed into place when finished. A build takes about two
seconds; no torch headers are involved.

``kernels()`` is that library's functions with their ctypes signatures (pointers are ``tensor.data_ptr()``).
The library is built for AVX2; a few kernels also have AVX-512 copies that they take at run time where the CPU
runs AVX-512 (``native_wide``: the same results bit for bit; tests switch them off to compare).
Both return None (and log why) when the kernels cannot run here: a CPU without AVX2/FMA/F16C, no C compiler, or
a failed build. Callers then take their torch path.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import types

from .... import environ

logger = logging.getLogger(__name__)

# -ffp-contract=off: a multiply and an add stay two roundings (the reference dequantizes that way).
CFLAGS = ("-O3", "-std=gnu11", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-pthread", "-fPIC", "-shared")
LIBRARY = "sglang_native"
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> str | None:
    return environ.CC.get() or shutil.which("cc") or shutil.which("gcc")


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def kernels_dir() -> str:
    return os.path.join(environ.cache_root(), "kernels")


@functools.cache
def load() -> ctypes.CDLL | None:
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        logger.info("native kernels off: this CPU lacks %s", ", ".join(missing))
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("native kernels off: no C compiler found (set $CC or install gcc); using the torch path")
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(os.path.join(here, n) for n in os.listdir(here) if n.endswith(".c"))
    digest = hashlib.sha256(" ".join(CFLAGS).encode() + _compiler_version(cc).encode())
    for path in sources + [os.path.join(here, "native.h")]:
        with open(path, "rb") as f:
            digest.update(f.read())
    out_dir = kernels_dir()
    target = os.path.join(out_dir, f"{LIBRARY}-{digest.hexdigest()[:16]}.so")
    try:
        return _build(cc, sources, here, out_dir, target)
    except OSError as exc:  # an unwritable cache, a full disk
        logger.warning("native kernels off: cannot build into %s: %s; using the torch path", out_dir, exc)
        return None


def _build(cc: str, sources: list[str], here: str, out_dir: str, target: str) -> ctypes.CDLL | None:
    os.makedirs(out_dir, exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same file
        if not os.path.exists(target):
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
            os.close(fd)
            try:
                proc = subprocess.run([cc, *CFLAGS, *sources, "-o", tmp, "-lm"], capture_output=True, text=True,
                                      timeout=300)
                error = proc.stderr[-2000:] if proc.returncode != 0 else None
            except (OSError, subprocess.SubprocessError) as exc:  # $CC missing or hung
                error = str(exc)
            if error is not None:
                os.unlink(tmp)
                logger.warning("native kernels off: compiling %s with %s failed; using the torch path\n%s",
                               here, cc, error)
                return None
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
    try:
        return ctypes.CDLL(target)
    except OSError as exc:
        logger.warning("native kernels off: loading %s failed: %s", target, exc)
        return None


# The library's entry points: name -> argument types (i: int64, p: pointer, f: float32, t: thread count, int).
_SIGNATURES = {
    "gguf_matmul": "tpiipipt",
    "gguf_dequantize_rows": "tpipipt",
    "paged_attention": "ppppippiiiiffipt",
    "rmsnorm": "pppiifpt",
    "rope_store_kv": "piiiipppppt",
    "gguf_gemv_fused": "tpipiptpfttt",
    "gguf_matmul_q8": "tpiipipt",
    "gguf_quantize_q8": "piippp",
    "decoder_one_token": "piiiiipppppppfptt",
    "native_wide": "t",
}
_CTYPES = {"i": ctypes.c_int64, "p": ctypes.c_void_p, "f": ctypes.c_float, "t": ctypes.c_int}


@functools.cache
def kernels() -> types.SimpleNamespace | None:
    lib = load()
    if lib is None:
        return None
    functions = {}
    for name, signature in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [_CTYPES[c] for c in signature]
        functions[name] = fn
    return types.SimpleNamespace(**functions)
