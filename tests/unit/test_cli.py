"""The command line: ``--version``, ``python -m sglang_backend``, ``serve --help`` (each default shown once)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)


def test_version():
    import sglang_backend

    r = run("-m", "sglang_backend", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"sglang-backend {sglang_backend.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", sglang_backend.__version__)


def test_python_dash_m_runs_the_cli():
    r = run("-m", "sglang_backend", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: sglang-backend")
    for command in ("demo", "serve", "bench"):
        assert command in r.stdout
    r = run("-m", "sglang_backend")  # no command: a usage error, not a traceback
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


def option_blocks(help_text: str) -> dict[str, str]:
    """``--flag`` -> its help text (argparse wraps it over several lines)."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.split("options:", 1)[1].splitlines():
        m = re.match(r"  (-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(2)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_help_shows_each_default_once(command):
    r = run("-m", "sglang_backend", command, "--help")
    assert r.returncode == 0, r.stderr
    blocks = option_blocks(r.stdout)
    assert {"--model-path", "--max-total-tokens", "--port", "--request-timeout"} <= set(blocks)
    twice = {flag: text for flag, text in blocks.items() if len(re.findall(r"default", text, re.I)) > 1}
    assert not twice, twice
    assert "(default: 30000)" in blocks["--port"]  # appended where the help text does not say it
    assert "(default: None)" not in r.stdout


def test_first_conversion_says_what_it_does(tmp_path, monkeypatch, capsys):
    from sglang_backend.runtime.model_loader import dummy_config, save_dummy_hf_model
    from sglang_backend.runtime.model_loader.embedded import converted_gguf_path
    from tests.unit.test_model_loader import _write_gguf_from_hf

    monkeypatch.setenv("SGLANG_BACKEND_CACHE", str(tmp_path / "cache"))
    src = save_dummy_hf_model(dummy_config(), str(tmp_path / "src"))
    gguf = str(tmp_path / "tiny.gguf")
    _write_gguf_from_hf(src, gguf)
    capsys.readouterr()
    target = converted_gguf_path(gguf)
    err = capsys.readouterr().err
    assert f"sglang-backend: converting {gguf} to a Hugging Face directory in {target} (first run only) ..." in err
    assert re.search(r"sglang-backend: done in \d+ s", err)
    assert "converting tensors" in err  # the progress bar
    assert converted_gguf_path(gguf) == target
    assert capsys.readouterr().err == ""  # later runs: silent


def demo_cmd(model_dir: str, *extra: str) -> list[str]:
    return ["-m", "sglang_backend", "demo", "--model-path", model_dir, "--max-total-tokens", "4096", *extra]


def test_demo_explains_the_cache_and_next_steps(tiny_gqa_dir):
    r = run(*demo_cmd(tiny_gqa_dir, "--max-new-tokens", "8"))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith(f"loading {tiny_gqa_dir} ...\n")
    assert out.count("Q: ") == 2 and out.count("A: ") == 2
    m = re.search(r"Asked again: (\d+) of (\d+) and (\d+) of (\d+) prompt tokens came from the radix cache", out)
    assert m, out
    assert int(m.group(1)) == int(m.group(2)) - 1 and int(m.group(3)) == int(m.group(4)) - 1
    assert "sglang-backend serve" in out and "curl http://127.0.0.1:30000/v1/chat/completions" in out
    assert "make test" in out
    assert "Traceback" not in r.stderr and "INFO" not in r.stderr  # a quiet demo: no engine log lines


def test_demo_ctrl_c_is_one_line(tiny_gqa_dir):
    import signal

    # As a terminal's shell starts a foreground job: SIGINT at its default. A test run started as a background job
    # (`.ci/run &`) ignores SIGINT, which children inherit, and the demo would then never see the Ctrl-C.
    proc = subprocess.Popen([sys.executable, *demo_cmd(tiny_gqa_dir)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().startswith("loading ")  # building the Engine now
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip() == "sglang-backend: interrupted (Ctrl-C)", err
