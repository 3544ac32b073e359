"""The grammar mask on a CPU logits row in one C call (``mask_row.c``), for ``LLGuidanceMatcher.fill_mask``.

On the scheduler's critical path the mask is a few microseconds of memory traffic behind several numpy calls,
each slow on the cold caches a forward pass leaves: ``benchmarks/bench_grammar.py`` measured 27-33 us a step
through numpy (``logits_row.numpy()``, then a fill and scattered writes, or a 0/-inf row added), ~12 us through
this kernel, which reads llguidance's packed mask (6 kB at 49k tokens) and touches only the 64-token words that
forbid something. It is built like the native CPU kernels (``layers/native``: the system C compiler, the same
flags, cached by a hash of the source, flags and compiler) into a library of its own: a Python extension module
where Python's headers are installed (a call costs ~5 us less than through ctypes on a cold cache), else a plain
library called through ctypes. ``kernel()`` is None where neither can run (no AVX2, no compiler, a failed build,
the source missing from an install); callers then keep their numpy path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig

from ..layers import native

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mask_row.c")
MODULE = "grammar_mask_row"  # the extension's name (PyInit_grammar_mask_row in mask_row.c)


@functools.cache
def kernel():
    """``mask_row(row_ptr: int, width: int, bits: bytes, n_bits: int)`` (``grammar_mask_row`` in ``mask_row.c``:
    -inf at row[j] where bit j is 0 and at every j >= n_bits, j < width), or None."""
    cc = native._compiler()  # the native kernels' choice ($CC, else cc or gcc)
    why = ("no AVX2" if "avx2" not in native.cpu_flags() else "no C compiler" if cc is None
           else f"{SOURCE} missing" if not os.path.exists(SOURCE) else None)
    if why:
        logger.info("grammar mask kernel off (%s); masks go through numpy", why)
        return None
    include = sysconfig.get_paths().get("include") or ""
    extension = load(include) if os.path.exists(os.path.join(include, "Python.h")) else None
    return extension or load(None)


def load(include: str | None):
    """The kernel as an extension module built against the Python headers in ``include``, or (None) through
    ctypes; None where it cannot be built (``kernel()`` checked the CPU and the compiler)."""
    cc = native._compiler()
    if cc is None:
        return None
    extension = include is not None
    flags = ["-DMASK_ROW_PYTHON", f"-I{include}"] if extension else []
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read())
    for part in (*native.CFLAGS, *flags, native._compiler_version(cc), sys.version if extension else ""):
        digest.update(part.encode())
    out_dir = native.kernels_dir()
    target = os.path.join(out_dir, f"{MODULE}-{digest.hexdigest()[:16]}.so")
    try:
        # native's build (file lock, rename into place); the flags go before the source on its command line.
        lib = native._build(cc, [*flags, SOURCE], os.path.dirname(SOURCE), out_dir, target)
    except OSError as e:  # an unwritable cache, a full disk
        logger.warning("grammar mask kernel off: cannot build into %s: %s", out_dir, e)
        return None
    if lib is None:  # _build logged why
        return None
    if extension:
        loader = importlib.machinery.ExtensionFileLoader(MODULE, target)
        try:
            module = importlib.util.module_from_spec(importlib.util.spec_from_loader(MODULE, loader))
            loader.exec_module(module)
        except ImportError as e:  # e.g. headers of another Python than this one
            logger.warning("grammar mask kernel: the extension %s does not load (%s); trying ctypes", target, e)
            return None
        return module.mask_row
    # PyDLL keeps the GIL over the call (a few microseconds): released, the scheduler could wait for the mask
    # thread to hand it back.
    fn = ctypes.PyDLL(target).grammar_mask_row
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
    fn.restype = None
    return fn
