"""The upstream-programs harness (benchmarks/upstream_programs.py) changes only imports: what it rewrites, and that
upstream's test modules are served rewritten however a program puts them on its path."""

from __future__ import annotations

import importlib
import sys

from benchmarks.upstream_programs import UpstreamFinder, rewrite_imports


def test_rewrite_covers_imports_and_mock_patch_targets_only():
    source = ('import sglang as sgl\nfrom sglang.lang.ir import SglGen\n'
              '@patch("sglang.srt.reasoning_parser.ReasoningParser")\n'
              "with mock.patch.object(x, 'y'), patch('sglang.utils.f'):\n"
              'url = "sglang.io"\n')
    assert rewrite_imports(source) == (
        'import sglang_backend as sgl\nfrom sglang_backend.lang.ir import SglGen\n'
        '@patch("sglang_backend.srt.reasoning_parser.ReasoningParser")\n'
        "with mock.patch.object(x, 'y'), patch('sglang_backend.utils.f'):\n"
        'url = "sglang.io"\n')


def test_upstream_test_modules_are_served_rewritten(tmp_path):
    """``from sglang.test.x import ...`` becomes ``sglang_backend.test.x``, which the finder serves from the upstream
    copy with its imports rewritten; the path finder must not load the file as it is (a program that appends
    upstream's python/ dir to sys.path, as test_skip_tokenizer_srt does, made it find the file unrewritten)."""
    pkg = tmp_path / "python" / "sglang" / "test"
    pkg.mkdir(parents=True)
    (pkg / "harness_probe.py").write_text("from sglang.utils import read_jsonl\nWHERE = read_jsonl.__module__\n")
    finder = UpstreamFinder(str(tmp_path))
    sys.meta_path.append(finder)
    sys.path.append(str(tmp_path / "python"))
    try:
        module = importlib.import_module("sglang_backend.test.harness_probe")
        assert module.WHERE == "sglang_backend.utils"
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(tmp_path / "python"))
        for name in [n for n in sys.modules if n.startswith("sglang_backend.test")]:
            del sys.modules[name]


def test_a_capability_the_served_model_lacks_is_not_a_failure():
    from benchmarks.upstream_programs import classify

    try:
        raise RuntimeError("program failed: Error code: 400 - this model takes no images")
    except RuntimeError as e:
        assert classify(e, "/nowhere") == ("n/a", "the served model takes no images (a text model)")
    try:
        raise KeyError("answer")
    except KeyError as e:
        assert classify(e, "/nowhere")[0] == "fail(error)"
