"""README.md's code blocks run as printed.

Every fenced code block of README.md carries a marker: an HTML comment (invisible when rendered) on one of the
3 lines before its opening fence (the nearest wins):

    <!-- readme-test: run [| expect: TEXT]... -->          run it; each TEXT must appear in what it prints
                                                           (python: stdout; bash: stdout or stderr)
    <!-- readme-test: run server [| expect: TEXT]... -->   the same, with a server on 127.0.0.1:30000 (see below)
    <!-- readme-test: skip REASON -->                      not run; REASON (required) is the pytest skip message

A block without a marker, with an unknown one, or a ``run`` marker on a block that is neither ``python`` nor
``bash`` fails, so new README code cannot go untested silently. Only ``python`` and ``bash`` blocks can run:

* python: written to a temp file and run with this interpreter (``sys.executable``) from the repository root;
* bash: run with ``bash -euo pipefail`` from the repository root, with ``sys.executable``'s directory first on
  PATH, so ``sglang-backend``, ``python`` and ``pip`` are the project virtualenv's (as after
  ``source .venv/bin/activate``).

Each runs in a subprocess with a timeout and must exit 0. ``run server`` blocks share one server (started at
the first of them, stopped at the end of this module): ``python -m sglang_backend.cli serve --port 30000
--max-total-tokens 8192`` with the embedded SmolLM2; if port 30000 is taken the tests fail saying so. Blocks
that run commands writing into benchmarks/results/ must not change a file there that existed before; the files
they add (smoke results) are removed afterwards.

Also checked: every extra the README installs (``".[name]"``) is defined in pyproject.toml, and every
``make`` target it names exists in the Makefile.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

from sglang_backend.utils import pdeathsig_preexec

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO_ROOT, "README.md")
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
SERVER_HOST, SERVER_PORT = "127.0.0.1", 30000
SERVER_ARGS = ["--max-total-tokens", "8192"]
STARTUP_TIMEOUT_S = 180
BLOCK_TIMEOUT_S = 300
MARKER_LOOKBACK = 3  # lines before the opening fence searched for the marker

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # the marker's text after "readme-test:", None when missing
    kind: str = ""  # run | run server | skip | invalid
    reason: str = ""  # skip reason, or what is wrong with the marker
    expects: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.lang or 'text'}-{self.kind.replace(' ', '_')}"


def _parse_marker(block: Block) -> None:
    text = block.marker
    if text is None:
        block.kind, block.reason = "invalid", "no <!-- readme-test: ... --> marker on the 3 lines before the fence"
        return
    head, *rest = [part.strip() for part in text.split("|")]
    if head.startswith("skip"):
        block.kind, block.reason = "skip", head[len("skip"):].strip()
        if not block.reason or rest:
            block.kind, block.reason = "invalid", f"a skip marker needs a reason (and no '|' parts): {text!r}"
        return
    if head not in ("run", "run server"):
        block.kind, block.reason = "invalid", f"unknown marker {text!r} (run, run server, or skip REASON)"
        return
    if block.lang not in ("python", "bash"):
        block.kind, block.reason = "invalid", f"only python and bash blocks can run, not {block.lang or 'text'!r}"
        return
    block.kind = head
    for part in rest:
        if not part.startswith("expect:") or not part[len("expect:"):].strip():
            block.kind, block.reason = "invalid", f"bad marker part {part!r} (expected 'expect: TEXT')"
            return
        block.expects.append(part[len("expect:"):].strip())


def parse_readme(path: str = README) -> list[Block]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"README.md line {start + 1}: code block never closed")
        marker = None
        for k in range(start - 1, max(-1, start - 1 - MARKER_LOOKBACK), -1):
            found = _MARKER.search(lines[k])
            if found:
                marker = found.group(1)
                break
        block = Block(start + 1, m.group(1), "\n".join(lines[start + 1:j]) + "\n", marker)
        _parse_marker(block)
        blocks.append(block)
        i = j + 1
    return blocks


BLOCKS = parse_readme()
# In-process blocks first, then the ones that need the server (so it is up only for those).
ORDERED = sorted(BLOCKS, key=lambda b: (b.kind == "run server", b.line))


# The server -----------------------------------------------------------------------------------------------------
def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server, then make sure nothing of its process group (scheduler, detokenizer) is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anyone left in the group we created?
        except ProcessLookupError:
            return
        time.sleep(0.25)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    if _port_in_use(SERVER_HOST, SERVER_PORT):
        pytest.fail(f"port {SERVER_PORT} on {SERVER_HOST} is taken: the README's server examples need it free "
                    f"(stop whatever listens there, e.g. a `sglang-backend serve` left running)", pytrace=False)
    from sglang_backend.runtime.model_loader.embedded import default_model_path

    default_model_path()  # converts the embedded GGUF once (cached) before the start-up clock runs
    log_path = str(tmp_path_factory.mktemp("readme_server") / "server.log")
    threads = os.environ.get("SGLANG_TEST_SERVER_THREADS", "1")
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", SGLANG_BACKEND_DIE_WITH_PARENT="1")  # dies with a SIGKILLed pytest
    cmd = [sys.executable, "-m", "sglang_backend.cli", "serve", "--host", SERVER_HOST, "--port", str(SERVER_PORT),
           "--log-level", "warning", *SERVER_ARGS]
    url = f"http://{SERVER_HOST}:{SERVER_PORT}"

    def log_tail() -> str:
        with open(log_path, errors="replace") as f:
            return "".join(f.readlines()[-40:])

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode} during start-up:\n{log_tail()}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not healthy after {STARTUP_TIMEOUT_S} s:\n{log_tail()}", pytrace=False)
            time.sleep(0.5)
        yield url
        assert proc.poll() is None, f"the server died during the README examples:\n{log_tail()}"
    finally:
        _stop(proc)


# Running a block ------------------------------------------------------------------------------------------------
def _results_snapshot() -> dict[str, tuple[float, int]]:
    out = {}
    for root, _, files in os.walk(RESULTS_DIR):
        for name in files:
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[path] = (st.st_mtime, st.st_size)
    return out


def _remove_new_results(before: dict[str, tuple[float, int]]) -> list[str]:
    """Deletes files added to benchmarks/results/ since ``before`` (and directories left empty); returns the
    pre-existing files that changed."""
    after = _results_snapshot()
    for path in sorted(set(after) - set(before)):
        os.remove(path)
    for root, dirs, files in os.walk(RESULTS_DIR, topdown=False):
        if root != RESULTS_DIR and not os.listdir(root):
            os.rmdir(root)
    return sorted(p for p, v in before.items() if p in after and after[p] != v)


def run_block(block: Block, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    else:
        script = tmp_path / "block.sh"
        script.write_text(block.code)
        cmd = ["bash", "-euo", "pipefail", str(script)]
    before = _results_snapshot()
    try:
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                              preexec_fn=pdeathsig_preexec())  # dies with a SIGKILLed pytest
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"README.md line {block.line}: still running after {BLOCK_TIMEOUT_S} s\n"
                    f"--- stdout ---\n{_tail(e.stdout)}\n--- stderr ---\n{_tail(e.stderr)}", pytrace=False)
    finally:
        changed = _remove_new_results(before)
        assert not changed, f"README.md line {block.line} overwrote committed benchmark results: {changed}"


def _tail(text, n: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


@pytest.mark.parametrize("block", ORDERED, ids=[b.id for b in ORDERED])
def test_readme_block(block: Block, request, tmp_path):
    if block.kind == "invalid":
        pytest.fail(f"README.md line {block.line} ({block.lang or 'text'} block): {block.reason}", pytrace=False)
    if block.kind == "skip":
        pytest.skip(block.reason)
    if block.kind == "run server":
        request.getfixturevalue("readme_server")
    done = run_block(block, tmp_path)
    where = f"README.md line {block.line} ({block.lang})"
    report = f"\n--- stdout ---\n{_tail(done.stdout)}\n--- stderr ---\n{_tail(done.stderr)}"
    assert done.returncode == 0, f"{where} exited with {done.returncode}{report}"
    printed = done.stdout if block.lang == "python" else done.stdout + done.stderr  # benchmarks report on stderr
    missing = [e for e in block.expects if e not in printed]
    assert not missing, f"{where}: expected {missing} in its output{report}"


def test_every_block_has_a_valid_marker():
    assert BLOCKS, "no code blocks found in README.md"
    bad = [f"line {b.line} ({b.lang or 'text'}): {b.reason}" for b in BLOCKS if b.kind == "invalid"]
    assert not bad, "README.md code blocks without a valid readme-test marker:\n" + "\n".join(bad)


def test_readme_extras_and_make_targets_exist():
    """The extras the README tells people to install, and the make targets it names, exist."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"].get("optional-dependencies", {}))
    with open(README, encoding="utf-8") as f:
        text = f.read()
    named = {e.strip() for group in re.findall(r'-e "\.\[([^\]]+)\]"', text) for e in group.split(",")}
    assert named, "the README names no extras"
    assert not named - extras, f"README.md installs extras missing from pyproject.toml: {sorted(named - extras)}"

    with open(os.path.join(REPO_ROOT, "Makefile"), encoding="utf-8") as f:
        targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", f.read(), flags=re.M))
    used = {t for b in BLOCKS if b.lang == "bash" for t in re.findall(r"^\s*make\s+([\w.-]+)", b.code, flags=re.M)}
    assert used <= targets, f"README.md runs make targets missing from the Makefile: {sorted(used - targets)}"


if __name__ == "__main__":  # a quick listing: python tests/docs/test_readme.py
    for b in BLOCKS:
        print(f"{b.id:28} {b.reason or ' | '.join(b.expects)}")
