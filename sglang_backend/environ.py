"""Every environment variable the package reads, in one typed registry; no other module touches ``os.environ``
(``tests/unit/test_environ.py`` enforces it).

Operators tune the server with ``ServerArgs`` flags. What is left here is where an environment variable is the
right channel: locations and conventions shared with other tools (caches, ``HF_HUB_OFFLINE``,
``CUDA_VISIBLE_DEVICES``, ``TRITON_INTERPRET``) and switches for tests and debugging (fault injection,
profiles). GPU kernel choices are ``ServerArgs`` flags (``--gemv-mode``, ``--disable-fused-ops``,
``--pdl``, ``--attention-merge``, ``--kernel-config``), handed to the kernels as
``layers.kernel_options.KernelOptions``.
Each variable is read when ``get()`` is called, never cached, so a test can set it for one call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    help: str

    def raw(self) -> str | None:
        return os.environ.get(self.name)

    def get(self) -> T:
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        if isinstance(self.default, bool):
            return value.strip().lower() not in _FALSE  # type: ignore[return-value]
        if isinstance(self.default, float):
            try:
                return float(value)  # type: ignore[return-value]
            except ValueError:
                raise ValueError(f"{self.name}={value!r}: expected a number") from None
        return value  # type: ignore[return-value]

    def is_set(self) -> bool:
        return self.name in os.environ


# Locations and shared conventions -----------------------------------------------------------------------------
CACHE_DIR = EnvVar[str | None]("SGLANG_BACKEND_CACHE", None, "Root of the package's caches (models, grammars)")
XDG_CACHE_HOME = EnvVar[str | None]("XDG_CACHE_HOME", None, "The cache root when SGLANG_BACKEND_CACHE is unset")
HF_HUB_OFFLINE = EnvVar[bool]("HF_HUB_OFFLINE", False, "Never download from the Hugging Face Hub")
CUDA_VISIBLE_DEVICES = EnvVar[str | None]("CUDA_VISIBLE_DEVICES", None, "GPUs this process may use")
TRITON_INTERPRET = EnvVar[bool]("TRITON_INTERPRET", False, "Triton's CPU interpreter (no PDL then)")
CC = EnvVar[str | None]("CC", None, "C compiler for the native CPU kernels (default: cc)")

# Process supervision -------------------------------------------------------------------------------------------
DIE_WITH_PARENT = EnvVar[bool]("SGLANG_BACKEND_DIE_WITH_PARENT", False,
                               "The server dies with the process that started it, even a SIGKILLed one")
TP_TIMEOUT_S = EnvVar[float]("SGLANG_BACKEND_TP_TIMEOUT_S", 600.0, "Timeout of tensor-parallel collectives")

# Tests and debugging -------------------------------------------------------------------------------------------
FAULT_INJECTION = EnvVar[str | None]("SGLANG_BACKEND_FAULT_INJECTION", None,
                                     "Test only: JSON fault rules the scheduler applies (managers/fault_injection.py)")
TP_PROFILE = EnvVar[str | None]("SGLANG_BACKEND_TP_PROFILE", None,
                                "Path prefix: each TP follower writes a cProfile of its step loop there at exit")
TP_STATS = EnvVar[bool]("SGLANG_BACKEND_TP_STATS", False, "TP followers print their step statistics at exit")

REGISTRY = {v.name: v for v in list(globals().values()) if isinstance(v, EnvVar)}


def cache_root() -> str:
    """``$SGLANG_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/sglang_backend``, else ``~/.cache/sglang_backend``."""
    env = CACHE_DIR.get()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = XDG_CACHE_HOME.get()
    base = os.path.expanduser(xdg) if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "sglang_backend"))


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment with ``overrides``, for a child process."""
    return {**os.environ, **overrides}


def set_default(name: str, value: str) -> None:
    """Sets ``name`` for this process and its future children unless the user set it (OMP_WAIT_POLICY)."""
    os.environ.setdefault(name, value)
