"""The environment-variable registry (``sglang_backend/environ.py``) is the only reader of ``os.environ``."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import sglang_backend
from sglang_backend import environ

PACKAGE = pathlib.Path(sglang_backend.__file__).parent


def environment_access(tree: ast.AST) -> list[int]:
    """Lines that touch the process environment: ``os.environ``, ``os.getenv``/``putenv``/``unsetenv``, or
    ``from os import environ``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv", "putenv") for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_registry_reads_the_environment():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "environ.py":
            continue
        lines = environment_access(ast.parse(path.read_text(), str(path)))
        if lines:
            offenders[str(path.relative_to(PACKAGE))] = lines
    assert not offenders, f"read the environment through sglang_backend.environ instead: {offenders}"


def test_the_check_sees_every_form():
    code = "import os\nfrom os import environ\na = os.environ.get('X')\nb = os.getenv('Y')\nos.environ['Z'] = '1'\n"
    assert environment_access(ast.parse(code)) == [2, 3, 4, 5]


def test_every_package_variable_is_registered():
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bSGLANG_BACKEND_[A-Z0-9_]+\b", path.read_text()))
    assert named <= set(environ.REGISTRY), f"not in the registry: {sorted(named - set(environ.REGISTRY))}"
    for var in environ.REGISTRY.values():
        assert var.help, var.name


def test_values_are_parsed_when_read(monkeypatch):
    monkeypatch.delenv("SGLANG_BACKEND_TP_STATS", raising=False)
    assert environ.TP_STATS.get() is False
    for off in ("0", "false", "no", "off", ""):
        monkeypatch.setenv("SGLANG_BACKEND_TP_STATS", off)
        assert environ.TP_STATS.get() is False
    monkeypatch.setenv("SGLANG_BACKEND_TP_STATS", "1")
    assert environ.TP_STATS.get() is True
    monkeypatch.setenv("SGLANG_BACKEND_TP_TIMEOUT_S", "12.5")
    assert environ.TP_TIMEOUT_S.get() == 12.5
    monkeypatch.setenv("SGLANG_BACKEND_TP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="SGLANG_BACKEND_TP_TIMEOUT_S='soon': expected a number"):
        environ.TP_TIMEOUT_S.get()
    monkeypatch.setenv("SGLANG_BACKEND_TP_PROFILE", "/tmp/prof")
    assert environ.TP_PROFILE.get() == "/tmp/prof"
    assert environ.child_env(EXTRA="1")["EXTRA"] == "1"


def test_kernel_choices_are_server_args_not_environment():
    """GPU kernel choices are ServerArgs flags handed to the kernels (issue 22), not environment variables."""
    from sglang_backend.runtime.server_args import ServerArgs

    for gone in ("GEMV", "PDL", "FUSED_MERGE", "DISABLE_FUSED_OPS"):
        assert f"SGLANG_BACKEND_{gone}" not in environ.REGISTRY and not hasattr(environ, gone)
    fields = set(ServerArgs.__dataclass_fields__)
    assert {"gemv_mode", "disable_fused_ops", "pdl", "attention_merge", "kernel_config"} <= fields
