"""Upstream SGLang's frontend programs, unchanged but for the import, on our three backends (issue 28).

    python -m benchmarks.upstream_programs --sglang-repo PATH [--backend engine|endpoint|openai|all] [--only NAME]
        [--stub-missing-aliases] [--timeout SECONDS] [--output FILE]

PATH is a checkout of sgl-project/sglang, or a copy of just the files below at their repository paths. Every file
is read from PATH and executed with ``import sglang as sgl`` / ``from sglang...`` (and the module path of a
``mock.patch("sglang....")`` target) rewritten to ``sglang_backend``, nothing else changed. What runs:

* ``python/sglang/test/test_programs.py``: the ``test_*`` functions that upstream's ``test/lang/test_srt_backend.py``
  calls (on the engine and endpoint backends) and that ``test/lang/test_openai_backend.py`` calls (on the openai
  backend, with the model name that file gives the backend it sets), with the arguments they pass; both files are
  read as syntax trees, not run.
* the other ``test/lang/test_*.py``: each TestCase method, with the class's ``backend`` (and ``engine``) set to the
  backend under test; ``setUpClass`` is not called (it starts upstream's own server). A file without TestCase runs
  as a script.
* ``examples/frontend_language/{quick_start,usage}/*.py``: the module is executed (not as ``__main__``), then the
  body of its ``if __name__ == "__main__":`` block, which calls its drivers the way upstream's would.

The backend under test replaces the one a program names: while a program runs, ``sgl.Runtime(...)``,
``sgl.RuntimeEndpoint(url)`` and ``sgl.OpenAI(model)`` return it. On the openai backend ``OpenAI(model)`` keeps the
name it was given (chat or completion model) and points at our server; ``Runtime``/``RuntimeEndpoint`` give
``OpenAI("gpt-3.5-turbo-instruct")``. Module strings ``http://localhost:30000`` are replaced by our server's URL.
Modules a program imports that neither sglang_backend nor the environment has are served from PATH with the same
rewrite: sibling examples (``from json_decode import ...``) and upstream's test package ``sglang_backend.test.*``
(``test_utils`` by a stand-in: ``CustomTestCase`` is ``unittest.TestCase``).

Statuses: ``pass``; ``fail(knowledge)``: an AssertionError raised in the upstream file (the reason quotes its line:
read it, a shape assert there would be a real failure); ``fail(error)``: anything else (exception type, message,
where); ``skip``: upstream's own ``unittest.skip``; ``n/a``: not run on that backend (the offline ``Engine`` API
only in-process, raw-HTTP scripts only against the server, functions upstream does not call on that backend), or
a capability the served model lacks (``MODEL_LIMITS``: images for a text model). ``LONG_PROGRAMS`` get a multiple
of ``--timeout``.
One server (``sglang-backend serve --max-total-tokens 8192``) serves the endpoint and openai backends.
``--stub-missing-aliases`` stands in for the few upstream names sglang_backend lacks that fail a whole file at its
import (``stub_missing_aliases``), to see the programs behind them; without it those files fail(error) as a whole.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.abc
import importlib.util
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
import unittest
from dataclasses import dataclass, field
from typing import Any, Callable

import sglang_backend as sgl
from benchmarks.common import default_output, env_info, format_table, write_json

NAME = "upstream_programs"
BACKENDS = ("engine", "endpoint", "openai")
COMPLETION_MODEL = "gpt-3.5-turbo-instruct"  # the openai backend for programs that name a Runtime/RuntimeEndpoint
UPSTREAM_URL = "http://localhost:30000"  # the server URL upstream's examples name
TEST_PROGRAMS = "python/sglang/test/test_programs.py"
EXAMPLE_DIRS = ("examples/frontend_language/quick_start", "examples/frontend_language/usage")
TEST_DIR = "test/lang"
# Third-party APIs we cannot run, models we do not serve, files that are not programs, and the two backend tests
# (read for their calls, not run).
SKIP = re.compile(r"anthropic|gemini|azure|together|openrouter|orcarouter|vertex|litellm|llava|yi_vl|openvla|video|"
                  r"triton|shortfin|ipynb|run_suite|run_all|/app\.py$|test_srt_backend\.py$|test_openai_backend\.py$")
ONLY_ON = {  # program -> the backends it is for
    "usage/srt_engine.py": {"engine"},  # the offline sgl.Engine API: in-process only
    "test/lang/test_srt_engine.py": {"engine"},
    "usage/json_logprobs.py": {"endpoint"},  # raw HTTP to /generate and /v1/completions: the server itself
}
# Programs that run longer than --timeout on a small CPU, by design: the limit is multiplied for them.
LONG_PROGRAMS = {
    "usage/cot_decoding.py": 4,  # 10 paths, each up to 1024 greedy tokens with top-2 logprobs, one after another
}
# Errors that say the served model lacks a capability a program needs (the CI model is a small text model).
MODEL_LIMITS = {"this model takes no images": "the served model takes no images (a text model)"}
_IMPORT = re.compile(r"^(\s*)(import sglang as sgl\b|from sglang(?=[.\s]))", re.M)
# unittest.mock targets name modules by their import path: patch("sglang.srt.x.Name") is an import too.
_PATCH_TARGET = re.compile(r"""(\bpatch(?:\.object|\.dict)?\(\s*(?P<q>["']))sglang\.""")


class NotApplicable(Exception):
    """The program is not for this backend."""


def rewrite_imports(source: str) -> str:
    """``import sglang as sgl`` -> ``import sglang_backend as sgl``; ``from sglang[.x] import`` likewise; and the
    module path of a ``unittest.mock.patch("sglang....")`` target."""
    source = _IMPORT.sub(lambda m: m.group(1) + m.group(2).replace("sglang", "sglang_backend", 1), source)
    return _PATCH_TARGET.sub(lambda m: m.group(1) + "sglang_backend.", source)


def exec_upstream(path: str, module: types.ModuleType) -> types.ModuleType:
    with open(path, encoding="utf-8") as f:
        code = compile(rewrite_imports(f.read()), path, "exec")
    module.__file__ = path
    exec(code, module.__dict__)
    return module


def load_program(path: str, server_url: str | None) -> types.ModuleType:
    """Executes an upstream file as a fresh module (``__name__`` is not ``"__main__"``)."""
    name = "upstream_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module = types.ModuleType(name)
    sys.modules[name] = module  # pydantic models and dataclasses look their module up
    exec_upstream(path, module)
    if server_url:
        for key, value in list(vars(module).items()):
            if isinstance(value, str) and value.rstrip("/") == UPSTREAM_URL:
                setattr(module, key, server_url)
    return module


# Modules served out of PATH ----------------------------------------------------------------------------------------
class _UpstreamLoader(importlib.abc.Loader):
    def __init__(self, path: str | None):
        self.path = path

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if self.path is not None:
            exec_upstream(self.path, module)
        elif module.__name__.endswith(".test_utils"):  # upstream's test_utils starts servers: only what tests use
            module.CustomTestCase = unittest.TestCase
            module.DEFAULT_MODEL_NAME_FOR_TEST = "default"


class UpstreamFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: modules nothing else provides, from the upstream copy, imports rewritten."""

    def __init__(self, repo: str):
        self.test_pkg = os.path.join(repo, "python/sglang/test")
        self.dirs = [os.path.join(repo, d) for d in (*EXAMPLE_DIRS, TEST_DIR)]

    def find_spec(self, name, path=None, target=None):
        if name == "sglang_backend.test":
            spec = importlib.util.spec_from_loader(name, _UpstreamLoader(None), is_package=True)
            # No search path: the path finder would load its modules unrewritten; this finder serves them below.
            spec.submodule_search_locations = []
            return spec
        if name == "sglang_backend.test.test_utils":
            return importlib.util.spec_from_loader(name, _UpstreamLoader(None))
        if name.startswith("sglang_backend.test."):
            candidates = [os.path.join(self.test_pkg, *name.split(".")[2:]) + ".py"]
        elif "." not in name:
            candidates = [os.path.join(d, name + ".py") for d in self.dirs]
        else:
            return None
        for file in candidates:
            if os.path.isfile(file):
                return importlib.util.spec_from_file_location(name, file, loader=_UpstreamLoader(file))
        return None


# What upstream's backend tests call ----------------------------------------------------------------------------
@dataclass
class Call:
    function: str  # a test_programs.py function
    kwargs: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # the OpenAI model of the backend the test sets (test_openai_backend.py)
    skipped: bool = False  # upstream's @unittest.skip


def upstream_calls(path: str) -> list[Call]:
    """The test_programs calls in one of upstream's backend test files, read from its syntax tree."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {a.asname or a.name: a.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("test_programs")
                for a in node.names}
    models = {}  # cls.chat_backend = OpenAI("gpt-3.5-turbo")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args
                and isinstance(node.value.args[0], ast.Constant) and isinstance(node.targets[0], ast.Attribute)):
            models[node.targets[0].attr] = node.value.args[0].value
    calls = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for method in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")):
            skipped = any("skip" in ast.unparse(d) for d in method.decorator_list)
            model, found = None, []
            for node in ast.walk(method):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                if node.func.id == "set_default_backend" and isinstance(node.args[0], ast.Attribute):
                    model = models.get(node.args[0].attr)
                elif node.func.id in imported:
                    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                    found.append(Call(imported[node.func.id], kwargs, None, skipped))
            calls += [Call(c.function, c.kwargs, model, c.skipped) for c in found]
    return calls


def stub_missing_aliases() -> list[str]:
    """``--stub-missing-aliases``: stands in for the upstream module names that sglang_backend lacks and that stop a
    whole file at its import, so the programs after them run. Only names still missing are stubbed (none once the
    library has them); the run records which."""
    # Here, not at the top: only this option needs them (requests for the http_request stand-in).
    import requests

    import sglang_backend.srt.hf_transformers_utils as hf_utils
    import sglang_backend.srt.utils as srt_utils
    import sglang_backend.utils as utils

    stubbed = []
    if not hasattr(srt_utils, "is_hip"):  # test_programs.py: from sglang.srt.utils import is_hip
        srt_utils.is_hip = lambda: False
        stubbed.append("sglang_backend.srt.utils.is_hip")
    try:
        importlib.import_module("sglang_backend.srt.utils.hf_transformers_utils")
    except ImportError:
        sys.modules["sglang_backend.srt.utils.hf_transformers_utils"] = hf_utils  # test_gen_min_new_tokens
        stubbed.append("sglang_backend.srt.utils.hf_transformers_utils")
    if not hasattr(utils, "http_request"):  # json_logprobs.py: from sglang.utils import http_request
        utils.http_request = lambda url, json=None, **kwargs: requests.post(url, json=json, timeout=600)
        stubbed.append("sglang_backend.utils.http_request")
    return stubbed


# Backends ------------------------------------------------------------------------------------------------------
def openai_backend(model: str, server_url: str):
    backend = sgl.OpenAI(model, base_url=server_url + "/v1", api_key="none")
    backend.shutdown = lambda: None  # a program's runtime.shutdown() must not end the run
    return backend


@contextlib.contextmanager
def programs_use(column: str, backend, server_url: str | None):
    """While a program runs, the backends it constructs are the one under test (see the module docstring)."""
    real_openai = sgl.OpenAI  # resolved before the patch below hides it

    def named_runtime(*args, **kwargs):
        return openai_backend(COMPLETION_MODEL, server_url) if column == "openai" else backend

    def named_openai(model_name, *args, **kwargs):
        if column != "openai":
            return backend
        b = real_openai(model_name, base_url=server_url + "/v1", api_key="none")
        b.shutdown = lambda: None
        return b

    def named_engine(*args, **kwargs):
        if column != "engine":
            raise NotApplicable("the offline Engine API")
        return backend.engine

    patches = {"Runtime": named_runtime, "RuntimeEndpoint": named_runtime, "OpenAI": named_openai,
               "Engine": named_engine}
    for key, value in patches.items():
        setattr(sgl, key, value)
    try:
        yield
    finally:
        for key in patches:
            delattr(sgl, key)  # back to the lazy module attribute


@contextlib.contextmanager
def own_server(log_dir: str):
    """``sglang-backend serve --max-total-tokens 8192`` on a free loopback port; stopped (SIGTERM) on exit."""
    import httpx  # the server's client dependency, only needed when a server runs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_backend", "serve", "--max-total-tokens", "8192", "--port", str(port),
           "--host", "127.0.0.1", "--log-level", "warning"]
    log = open(os.path.join(log_dir, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, SGLANG_BACKEND_DIE_WITH_PARENT="1", PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up; log: {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after 300 s; log: {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# Running one program -------------------------------------------------------------------------------------------
def _on_alarm(signum, frame):
    raise TimeoutError("ran past the time limit")


def classify(exc: BaseException, repo: str) -> tuple[str, str]:
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    upstream = [f for f in frames if os.path.abspath(f.filename).startswith(repo)]
    in_test = last is not None and (last in upstream or last.filename.endswith(os.path.join("unittest", "case.py")))
    message = (str(exc).strip().splitlines() or [""])[0][:160]
    limit = next((why for text, why in MODEL_LIMITS.items() if text in str(exc)), None)
    if limit is not None:
        return "n/a", limit
    if isinstance(exc, AssertionError) and upstream and in_test:
        return "fail(knowledge)", f"{upstream[-1].line} -> {message}"
    where = f"{os.path.relpath(last.filename)}:{last.lineno}" if last else "?"
    return "fail(error)", f"{type(exc).__name__}: {message} ({where})"


def run_one(name: str, column: str, body: Callable[[], None], repo: str, limit: float) -> dict:
    out = io.StringIO()
    t0 = time.perf_counter()
    status, reason, tb = "pass", "", ""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(int(limit))
    try:
        with contextlib.redirect_stdout(out):
            body()
    except NotApplicable as e:
        status, reason = "n/a", str(e)
    except unittest.SkipTest as e:
        status, reason = "skip", str(e)
    except Exception as e:  # any failure of an upstream program is a result, not a crash of the harness
        status, reason = classify(e, repo)
        tb = "".join(traceback.format_exception(e)[-6:])
    finally:
        signal.alarm(0)
    row = {"program": name, "backend": column, "status": status, "reason": reason,
           "seconds": round(time.perf_counter() - t0, 1), "output_tail": out.getvalue()[-1500:]}
    if tb:
        row["traceback_tail"] = tb
    print(f"  {name:<62} {column:<8} {status:<16} {row['seconds']:>6.1f}s  {reason[:110]}", file=sys.stderr)
    return row


def _main_block(module: types.ModuleType) -> Callable[[], None]:
    """Runs the body of the module's ``if __name__ == "__main__":`` block in the module's namespace."""
    with open(module.__file__, encoding="utf-8") as f:
        tree = ast.parse(rewrite_imports(f.read()))
    bodies = [n.body for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]

    def run():
        for body in bodies:
            argv, sys.argv = sys.argv, [module.__file__]  # a block that parses arguments sees none
            try:
                exec(compile(ast.Module(body=body, type_ignores=[]), module.__file__, "exec"), module.__dict__)
            finally:
                sys.argv = argv

    return run


# The programs of one backend -----------------------------------------------------------------------------------
@dataclass
class Column:
    name: str  # engine | endpoint | openai
    backend: Any  # the backend under test
    server_url: str | None
    repo: str
    image_dir: str  # holds example_image.png (test_image_qa opens it from the working directory)
    limit: float
    only: str | None

    def wanted(self, program: str) -> bool:
        return self.only is None or self.only in program

    def run(self, program: str, body: Callable[[], None]) -> dict:
        def in_context():
            sgl.set_default_backend(self.backend)
            with programs_use(self.name, self.backend, self.server_url):
                body()

        return run_one(program, self.name, in_context, self.repo, self.limit * LONG_PROGRAMS.get(program, 1))


def test_programs_rows(col: Column) -> list[dict]:
    """test_programs.py's functions as upstream's test_srt_backend.py / test_openai_backend.py call them."""
    by_file = {f: upstream_calls(os.path.join(col.repo, TEST_DIR, f))
               for f in ("test_srt_backend.py", "test_openai_backend.py")}
    mine = "test_openai_backend.py" if col.name == "openai" else "test_srt_backend.py"
    path = os.path.join(col.repo, TEST_PROGRAMS)
    with open(path, encoding="utf-8") as f:
        defined = {n.name for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef)}
    rows = []
    for function in sorted({c.function for calls in by_file.values() for c in calls}):
        program = f"test_programs::{function}"
        if not col.wanted(program):
            continue
        calls = [c for c in by_file[mine] if c.function == function]
        if function not in defined or not calls or calls[0].skipped:
            why = ("not in test_programs.py" if function not in defined else
                   f"{mine} does not call it" if not calls else f"{mine} skips it (unittest.skip)")
            rows.append({"program": program, "backend": col.name, "status": "skip" if calls else "n/a",
                         "reason": why, "seconds": 0.0})
            continue
        rows.append(col.run(program, lambda call=calls[0]: _call_test_program(col, path, call)))
    return rows


def _call_test_program(col: Column, path: str, call: Call) -> None:
    if col.name == "openai":
        sgl.set_default_backend(openai_backend(call.model or COMPLETION_MODEL, col.server_url))
    module = load_program(path, col.server_url)
    cwd = os.getcwd()
    os.chdir(col.image_dir)
    try:
        getattr(module, call.function)(**call.kwargs)
    finally:
        os.chdir(cwd)


def file_rows(col: Column, rel: str) -> list[dict]:
    """An example script (module, then its __main__ block) or a test/lang file (each TestCase method)."""
    path = os.path.join(col.repo, rel)
    program = rel.replace("examples/frontend_language/", "")
    if not col.wanted(program):
        return []
    if col.name not in ONLY_ON.get(program, BACKENDS):
        return [{"program": program, "backend": col.name, "status": "n/a",
                 "reason": f"only for {'/'.join(sorted(ONLY_ON[program]))}", "seconds": 0.0}]
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        tree = ast.parse(source)
    except SyntaxError as e:  # a broken copy of the file: its row says so, the run goes on
        return [{"program": program, "backend": col.name, "status": "fail(error)",
                 "reason": f"the upstream file does not parse: {e.msg} (line {e.lineno})", "seconds": 0.0}]
    has_cases = any(isinstance(n, ast.ClassDef) and "TestCase" in ast.unparse(n) for n in tree.body)
    if not has_cases:
        return [col.run(program, lambda: _main_block(load_program(path, col.server_url))())]
    loaded = {}
    row = col.run(program + "::<import>", lambda: loaded.update(module=load_program(path, col.server_url)))
    if "module" not in loaded:
        return [row]
    rows = []
    for cls in [c for c in vars(loaded["module"]).values() if isinstance(c, type) and issubclass(c, unittest.TestCase)
                and c.__module__ == loaded["module"].__name__]:
        cls.backend = col.backend  # what upstream's setUpClass would have set
        cls.engine = getattr(col.backend, "engine", None)
        for method in unittest.TestLoader().getTestCaseNames(cls):
            rows.append(col.run(f"{program}::{method}", lambda c=cls, m=method: _run_test_method(c, m)))
    return rows


def _run_test_method(cls: type, method: str) -> None:
    case = cls(method)
    case.setUp()
    try:
        getattr(case, method)()
    finally:
        case.tearDown()


def upstream_files(repo: str) -> tuple[list[str], list[str]]:
    """(files to run, files skipped), relative to the repository root."""
    found = []
    for d in (*EXAMPLE_DIRS, TEST_DIR):
        if os.path.isdir(os.path.join(repo, d)):
            found += [f"{d}/{f}" for f in sorted(os.listdir(os.path.join(repo, d))) if f.endswith((".py", ".ipynb"))]
    run = [f for f in found if not SKIP.search(f) and (not f.startswith(TEST_DIR + "/") or "/test_" in f)]
    return run, [f for f in found if f not in run]


def run_column(col: Column) -> list[dict]:
    print(f"== {col.name}", file=sys.stderr)
    shutdown = getattr(col.backend, "shutdown", None)
    col.backend.shutdown = lambda: None  # a program's runtime.shutdown() must not end the run
    try:
        rows = test_programs_rows(col)
        for rel in upstream_files(col.repo)[0]:
            rows += file_rows(col, rel)
    finally:
        col.backend.shutdown = shutdown
    return rows


# Report --------------------------------------------------------------------------------------------------------
def report(rows: list[dict], columns: tuple[str, ...]) -> str:
    programs = sorted({r["program"] for r in rows})
    cell = {(r["program"], r["backend"]): r["status"] for r in rows}
    table = format_table(["program", *columns], [[p, *(cell.get((p, c), "-") for c in columns)] for p in programs])
    failures = [f"  {r['program']} [{r['backend']}] {r['status']}: {r['reason']}" for r in rows
                if r["status"].startswith("fail")]
    return table + ("\n\nfailures:\n" + "\n".join(failures) if failures else "")


def _example_image(workdir: str, repo: str) -> str:
    """A directory holding upstream's test/lang/example_image.png, or a drawn stand-in when the copy lacks it."""
    from PIL import Image, ImageDraw  # only for the stand-in picture

    target = os.path.join(workdir, "example_image.png")
    source = os.path.join(repo, TEST_DIR, "example_image.png")
    if os.path.isfile(source):
        with open(source, "rb") as f, open(target, "wb") as g:
            g.write(f.read())
    else:
        image = Image.new("RGB", (320, 200), "skyblue")
        draw = ImageDraw.Draw(image)
        draw.rectangle((60, 90, 260, 150), fill="yellow")  # a yellow car-ish box on a road
        draw.rectangle((0, 150, 320, 200), fill="gray")
        image.save(target)
    return workdir


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sglang-repo", required=True, help="a checkout (or partial copy) of sgl-project/sglang")
    p.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    p.add_argument("--only", default=None, help="run the programs whose name contains this")
    p.add_argument("--stub-missing-aliases", action="store_true",
                   help="stand in for the upstream names sglang_backend lacks that stop whole files at import")
    p.add_argument("--timeout", type=float, default=420, help="seconds per program")
    p.add_argument("--output", default=None,
                   help=f"JSON results (default: benchmarks/results/{NAME}.json for a full run, none with --only)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    repo = os.path.abspath(args.sglang_repo)
    sys.meta_path.append(UpstreamFinder(repo))
    stubbed = stub_missing_aliases() if args.stub_missing_aliases else []
    columns = BACKENDS if args.backend == "all" else (args.backend,)
    workdir = tempfile.mkdtemp(prefix="upstream-programs-")
    image_dir = _example_image(workdir, repo)
    t0 = time.time()
    rows = []

    def column(name, backend, url):
        return Column(name, backend, url, repo, image_dir, args.timeout, args.only)

    if "engine" in columns:
        backend = sgl.EngineBackend(max_total_tokens=8192)
        try:
            rows += run_column(column("engine", backend, None))
        finally:
            backend.shutdown()
    if set(columns) - {"engine"}:
        with own_server(workdir) as url:
            for name in (c for c in columns if c != "engine"):
                backend = sgl.RuntimeEndpoint(url) if name == "endpoint" else openai_backend(COMPLETION_MODEL, url)
                rows += run_column(column(name, backend, url))
    print(report(rows, columns))
    output = args.output or (None if args.only else default_output(NAME))
    if output:
        summary = {c: {s: sum(1 for r in rows if r["backend"] == c and r["status"] == s)
                       for s in sorted({r["status"] for r in rows})} for c in columns}
        result = {"name": NAME, "env": env_info(), "config": {**vars(args), "sglang_repo": repo},
                  "wall_s": round(time.time() - t0, 1), "stubbed": stubbed, "files_skipped": upstream_files(repo)[1],
                  "summary": summary, "results": rows}
        print(f"wrote {write_json(result, output)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
