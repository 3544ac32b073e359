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
    monkeypatch.delenv("SGLANG_BACKEND_PDL", raising=False)
    assert environ.PDL.get() is True
    for off in ("0", "false", "no", "off", ""):
        monkeypatch.setenv("SGLANG_BACKEND_PDL", off)
        assert environ.PDL.get() is False
    monkeypatch.setenv("SGLANG_BACKEND_PDL", "1")
    assert environ.PDL.get() is True
    monkeypatch.setenv("SGLANG_BACKEND_TP_TIMEOUT_S", "12.5")
    assert environ.TP_TIMEOUT_S.get() == 12.5
    monkeypatch.setenv("SGLANG_BACKEND_TP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="SGLANG_BACKEND_TP_TIMEOUT_S='soon': expected a number"):
        environ.TP_TIMEOUT_S.get()
    monkeypatch.setenv("SGLANG_BACKEND_GEMV", "fused")
    assert environ.GEMV.get() == "fused"
    assert environ.child_env(EXTRA="1")["EXTRA"] == "1"
