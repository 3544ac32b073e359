"""The shape of the code base, checked from its source with ``ast``: imports run one way (no cycles between
modules of ``sglang_backend``), and no function is longer than a screenful or two.

A cycle means two modules can only be understood (and imported) together; a 500-line function means its
pieces cannot be tested apart. Both crept in before; these tests keep them out.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 120


def module_files(package: str = "sglang_backend") -> dict[str, pathlib.Path]:
    files = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def imported_modules(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """Modules of the package that ``name`` imports, anywhere in its body (function-local imports count:
    they are still a dependency). ``from pkg import sub`` depends on ``pkg.sub`` only, not on ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in known]
            targets = subs if len(subs) == len(node.names) else [module, *subs]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    known = module_files()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_import_of_a_submodule_is_not_an_edge_to_the_package(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .sub import x\n")
    (pkg / "sub.py").write_text("from . import other\n")
    (pkg / "other.py").write_text("")
    known = {"pkg": pkg / "__init__.py", "pkg.sub": pkg / "sub.py", "pkg.other": pkg / "other.py"}
    assert imported_modules("pkg.sub", pkg / "sub.py", known) == {"pkg.other"}
    assert imported_modules("pkg", pkg / "__init__.py", known) == {"pkg.sub"}


def test_imports_of_sglang_backend_form_a_dag():
    graph = import_graph()
    assert len(graph) > 50  # the walk really found the package
    cycles = find_cycles(graph)
    details = []
    for cycle in cycles:
        members = set(cycle)
        details.append("; ".join(f"{a} -> {b}" for a in cycle for b in sorted(graph[a] & members)))
    assert not cycles, "import cycles:\n" + "\n".join(details)


def long_functions(path: pathlib.Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{path}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_the_limit():
    paths = [p for root in ("sglang_backend", "adapters") for p in sorted((ROOT / root).rglob("*.py"))]
    assert len(paths) > 50
    found = [line for path in paths for line in long_functions(path)]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_length_check_counts_every_line(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    ok, too_long = tmp_path / "ok.py", tmp_path / "long.py"
    ok.write_text(f"def fits():\n{body}\n")  # def line + 119 = 120 lines
    too_long.write_text(f"async def spills():\n{body}\n    return x0\n")
    assert long_functions(ok) == []
    assert long_functions(too_long) == [f"{too_long}:1 spills (121 lines)"]


# Runtime packages from the top of a request's path to the bottom; a module may import only its own
# package or packages below it. (model_loader sits below the executor; distributed beside it.)
LAYERS = ["entrypoints", "managers", "model_executor", "models", "layers"]


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[:2] == ["sglang_backend", "runtime"] and parts[2] in LAYERS:
        return LAYERS.index(parts[2])
    return None


def test_runtime_layers_import_only_downwards():
    upward = []
    for module, deps in import_graph().items():
        here = layer_of(module)
        if here is None:
            continue
        upward += [f"{module} -> {dep}" for dep in sorted(deps) if (layer_of(dep) or 99) < here]
    assert not upward, "imports that point up the stack:\n" + "\n".join(upward)


def unexplained_local_imports(path: pathlib.Path) -> list[str]:
    """Imports inside functions with no comment saying why (optional dependency, deferred heavy import, ...):
    on the import's line, on the line above it, or on the first of a run of consecutive imports."""
    lines = path.read_text().splitlines()
    found = []
    for func in ast.walk(ast.parse("\n".join(lines), str(path))):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = sorted((n for n in ast.walk(func) if isinstance(n, (ast.Import, ast.ImportFrom))),
                         key=lambda n: n.lineno)
        explained_until = -1  # last line of a run of imports covered by a comment
        for node in imports:
            own = lines[node.lineno - 1:node.end_lineno]
            above = lines[node.lineno - 2] if node.lineno >= 2 else ""
            if any("#" in line for line in own) or "#" in above or node.lineno == explained_until + 1:
                explained_until = node.end_lineno
            else:
                found.append(f"{path}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return found


def test_function_local_imports_say_why():
    paths = [p for root in ("sglang_backend", "adapters") for p in sorted((ROOT / root).rglob("*.py"))]
    found = [line for path in paths for line in unexplained_local_imports(path)]
    assert not found, "function-local imports without a comment saying why:\n" + "\n".join(found)


def test_local_import_check_wants_a_comment(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import json\n\n\ndef g():\n    # optional: only g needs them\n"
                    "    import av\n    import PIL\n    x = 1\n    import os\n")
    assert unexplained_local_imports(path) == [f"{path}:2 import json", f"{path}:10 import os"]
