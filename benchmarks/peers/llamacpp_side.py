"""llama.cpp's side of the CPU peer benchmark (``benchmarks.peers.cpu``): installing ``llama-cpp-python`` on
demand into the user cache, and the workloads run through it.

Install (``ensure_llama_cpp``, in the parent, before any timing): ``llama_cpp`` importable already -> nothing
to do. Otherwise the package goes to ``<cache_root()>/peers/llama_cpp`` (never into the venv), from a wheel in
``<cache_root()>/wheels/`` -- built there with ``pip wheel`` first when there is none (a source build: PyPI has
no binary wheel of 0.3.36; about 20 minutes on 2 cores). Never in CI. The child process that runs llama.cpp
puts that directory first on ``sys.path`` (``import_llama_cpp``).

Workloads (``LlamaSide``, in the child), all on token ids from our tokenizer, greedy, EOS ignored:

* ``decode_stream``: the high-level ``Llama.generate`` (one sequence), each token's arrival time recorded.
* ``batched``: the low-level batched API as llama.cpp's ``examples/batched`` does it -- one context with
  ``n_seq_max`` sequences, every prompt in one ``llama_decode`` call (seq ids 0..n-1, logits only for each
  prompt's last token), then one decode step per output token carrying one token per sequence, greedy argmax
  of each sequence's logits row. With a shared prefix: the prefix is decoded once in seq 0 and
  ``llama_memory_seq_cp`` gives it to the other sequences (unified KV cache, so the cells are shared, not
  copied), then the suffixes go in one call.
* ``sequential``: the high-level ``Llama`` serving requests one after another, as a user would; it reuses the
  longest common prefix of the previous prompt's KV by itself.
"""

from __future__ import annotations

import fcntl
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

LLAMA_CPP_VERSION = "0.3.36"
DEPS = {"diskcache": "diskcache", "jinja2": "jinja2", "numpy": "numpy", "typing_extensions": "typing-extensions"}


# Install ----------------------------------------------------------------------------------------------------------
def _cache_root() -> str:
    from sglang_backend.runtime.model_loader.embedded import cache_root

    return cache_root()


def install_dir() -> str:
    return os.path.join(_cache_root(), "peers", "llama_cpp")


def wheels_dir() -> str:
    return os.path.join(_cache_root(), "wheels")


def _say(msg: str) -> None:
    print(f"[cpu peers] {msg}", file=sys.stderr, flush=True)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def find_wheel(directory: str) -> str | None:
    wheels = sorted(glob.glob(os.path.join(directory, f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl")))
    return wheels[-1] if wheels else None


def ensure_llama_cpp() -> str | None:
    """Makes ``llama_cpp`` importable for the child; returns the directory to put on its ``sys.path`` (None:
    importable as is). Builds the wheel only when no cached one exists."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return None
    target = install_dir()
    if os.path.isfile(os.path.join(target, "llama_cpp", "__init__.py")):
        return target
    if os.environ.get("CI"):
        raise RuntimeError("llama_cpp is not installed and CI is set: this benchmark does not build or install "
                           "llama-cpp-python in CI")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "a+") as lock:  # two benchmarks starting at once build/install once
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(target, "llama_cpp", "__init__.py")):
            return target
        wheel = find_wheel(wheels_dir())
        if wheel is None:
            _say(f"WARNING: no cached llama-cpp-python wheel in {wheels_dir()}: building llama-cpp-python=="
                 f"{LLAMA_CPP_VERSION} from source now. This takes about 20 minutes on 2 cores (once; the wheel "
                 f"is kept for later runs).")
            os.makedirs(wheels_dir(), exist_ok=True)
            _pip("wheel", f"llama-cpp-python=={LLAMA_CPP_VERSION}", "--no-deps", "-w", wheels_dir())
            wheel = find_wheel(wheels_dir())
            if wheel is None:
                raise RuntimeError(f"pip wheel finished but left no llama_cpp_python wheel in {wheels_dir()}")
        # Installed into a temporary sibling, then renamed: a killed install never looks finished.
        tmp = tempfile.mkdtemp(prefix=".llama_cpp-", dir=os.path.dirname(target))
        try:
            _say(f"installing {os.path.basename(wheel)} into {target}")
            _pip("install", "--quiet", "--no-deps", "--target", tmp, wheel)
            missing = [dist for mod, dist in DEPS.items() if importlib.util.find_spec(mod) is None]
            if missing:
                _pip("install", "--quiet", "--no-deps", "--target", tmp, *missing)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def import_llama_cpp(path: str | None):
    if path and path not in sys.path:
        sys.path.insert(0, path)
    import llama_cpp

    return llama_cpp


# Workloads --------------------------------------------------------------------------------------------------------
class BatchedContext:
    """A llama.cpp context of ``n_seq`` sequences on ``model`` (the high-level ``Llama``'s model) and a batch
    of ``n_batch`` tokens, for ``generate``."""

    def __init__(self, lc, llm, n_seq: int, n_ctx: int, n_batch: int, unified: bool, threads: int):
        import numpy as np

        self.lc, self.np = lc, np
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, n_batch, min(n_batch, 512)
        p.n_seq_max, p.kv_unified = n_seq, unified
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type = llm.context_params.flash_attn_type  # as the high-level object's context
        p.type_k, p.type_v = llm.context_params.type_k, llm.context_params.type_v
        p.no_perf = True
        self.ctx = lc.llama_init_from_model(llm._model.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx={n_ctx}, n_seq_max={n_seq})")
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.n_batch, self.n_vocab = n_batch, llm.n_vocab()
        self.info = dict(n_ctx=lc.llama_n_ctx(self.ctx), n_batch=n_batch, n_ubatch=p.n_ubatch, n_seq_max=n_seq,
                         kv_unified=unified, flash_attn_type=p.flash_attn_type)

    def close(self) -> None:
        if self.ctx:
            self.lc.llama_batch_free(self.batch)
            self.lc.llama_free(self.ctx)
            self.ctx = None

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``items`` = (token, pos, seq, wants_logits)."""
        b = self.batch
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} tokens exceed n_batch {self.n_batch}")
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, n_rows: int) -> list[int]:
        # The logits of the tokens that asked for them, in batch order: one row per sequence here.
        rows = self.np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx), shape=(n_rows * self.n_vocab,))
        return rows.reshape(n_rows, self.n_vocab).argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], n_new: int, prefix: list[int] | None = None) -> list[list[int]]:
        """Greedy ``n_new`` tokens for every prompt (sequence i = prompt i), after ``prefix`` (shared, decoded
        once in seq 0 and copied) when given. The last sampled token is not decoded (as our engine)."""
        lc = self.lc
        lc.llama_memory_clear(self.mem, True)
        start = 0
        if prefix:
            for i in range(0, len(prefix), self.n_batch):
                self._decode([(t, i + j, 0, False) for j, t in enumerate(prefix[i:i + self.n_batch])])
            for s in range(1, len(prompts)):
                lc.llama_memory_seq_cp(self.mem, 0, s, -1, -1)
            start = len(prefix)
        items = [(t, start + j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        self._decode(items)
        outs = [[t] for t in self._argmax(len(prompts))]
        pos = [start + len(p) for p in prompts]
        for step in range(n_new - 1):
            self._decode([(o[-1], pos[s] + step, s, True) for s, o in enumerate(outs)])
            for o, t in zip(outs, self._argmax(len(prompts))):
                o.append(t)
        return outs


class LlamaSide:
    """The high-level ``Llama`` on ``gguf`` (``n_threads = n_threads_batch = threads``) plus batched contexts
    made on demand; ``extra`` goes to ``Llama(...)``."""

    name = "llamacpp"

    def __init__(self, gguf: str, threads: int, n_ctx: int, install_path: str | None, extra: dict):
        self.lc = import_llama_cpp(install_path)
        self.threads = threads
        kw = dict(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
        kw.update(extra)
        if kw.pop("use_extra_bufts", True) is False:
            self._no_extra_buffers()
        t0 = time.perf_counter()
        self.llm = self.lc.Llama(model_path=gguf, **kw)
        self.init_s = time.perf_counter() - t0
        self.contexts: dict[str, BatchedContext] = {}
        self.vocab = self.llm.n_vocab()

    def _no_extra_buffers(self) -> None:
        """``--llamacpp-arg use_extra_bufts=false``: the model's weights in plain CPU buffers, no AMX or repacked
        copies (``Llama`` has no keyword for it, so its default model params are wrapped). Needed where ggml
        built -march=native uses AMX tiles that the VM does not grant: the batched prefill dies of SIGILL."""
        default = self.lc.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        self.lc.llama_cpp.llama_model_default_params = params  # what Llama.__init__ calls

    def info(self) -> dict:
        cp = self.llm.context_params
        return dict(version=getattr(self.lc, "__version__", None), init_s=self.init_s, n_vocab=self.vocab,
                    n_ctx=cp.n_ctx, n_batch=cp.n_batch, n_ubatch=cp.n_ubatch, n_threads=cp.n_threads,
                    n_threads_batch=cp.n_threads_batch, flash_attn_type=cp.flash_attn_type,
                    batched_contexts={k: c.info for k, c in self.contexts.items()},
                    system_info=self._system_info())

    def _system_info(self) -> str | None:
        try:
            raw = self.lc.llama_print_system_info()
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception:  # noqa: BLE001 - informational only
            return None

    def close(self) -> None:
        for c in self.contexts.values():
            c.close()
        self.contexts.clear()
        self.llm.close()

    def _stream(self, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
        """Greedy tokens of ``prompt`` through ``Llama.generate`` (prefix reuse as the object does it) and each
        token's arrival time."""
        out, times = [], []
        gen = self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
        for tok in gen:
            times.append(time.perf_counter())
            out.append(int(tok))
            if len(out) == n_new:
                break
        gen.close()
        return out, times

    def decode_stream(self, prompt: list[int], n_new: int) -> tuple[float, list[int], list[float]]:
        """(start time, tokens, arrival times) of one fresh generation (KV cleared: no reuse across runs)."""
        self.llm.reset()
        t0 = time.perf_counter()
        out, times = self._stream(prompt, n_new)
        return t0, out, times

    def sequential(self, prompts: list[list[int]], n_new: int) -> tuple[float, list[list[int]], list[float]]:
        """The requests one after another on the one ``Llama`` (KV cleared first, then reused between requests
        as far as prompts agree): (start time, outputs, each request's finish time)."""
        self.llm.reset()
        t0 = time.perf_counter()
        outs, done = [], []
        for p in prompts:
            outs.append(self._stream(p, n_new)[0])
            done.append(time.perf_counter())
        return t0, outs, done

    def context(self, key: str, n_seq: int, n_ctx: int, n_batch: int, unified: bool) -> BatchedContext:
        if key not in self.contexts:
            self.contexts[key] = BatchedContext(self.lc, self.llm, n_seq, n_ctx, n_batch, unified, self.threads)
        return self.contexts[key]

    def batched(self, key: str, prompts: list[list[int]], n_new: int, prefix: list[int] | None = None,
                unified: bool = False, size_new: int | None = None) -> tuple[float, list[list[int]], float]:
        """(start, outputs, end) of one batched generation of all ``prompts`` in context ``key`` (made on first
        use, sized for ``size_new`` output tokens, default ``n_new``; unified KV when a prefix is shared)."""
        n = len(prompts)
        lp = len(prefix or [])
        longest = max(len(p) for p in prompts)
        room = longest + max(n_new, size_new or 0)
        if unified:  # one buffer: the prefix once plus every sequence's own tokens (llama.cpp pads to 256)
            n_ctx = lp + n * room + 256
        else:  # split evenly per sequence, each share a multiple of 256
            n_ctx = n * (-(-(lp + room) // 256) * 256)
        n_batch = max(lp, sum(len(p) for p in prompts), n)
        ctx = self.context(key, n, n_ctx, n_batch, unified)
        t0 = time.perf_counter()
        outs = ctx.generate(prompts, n_new, prefix)
        return t0, outs, time.perf_counter()
