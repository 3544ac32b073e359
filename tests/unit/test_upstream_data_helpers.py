"""Upstream's ``sglang.utils.download_and_cache_file`` and ``read_jsonl`` (``test_programs.py`` imports both at
its top, for its HellaSwag program), against a real HTTP server on loopback."""

from __future__ import annotations

import functools
import http.server
import threading
import urllib.error

import pytest

from sglang_backend.utils import download_and_cache_file, read_jsonl


@pytest.fixture
def file_server(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    (root / "data.jsonl").write_text('{"a": 1}\n# a comment\n\n{"a": [2, "x"]}\n', encoding="utf-8")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    httpd.shutdown()
    httpd.server_close()


def test_downloads_once_into_the_cache_then_reads_the_lines(file_server, tmp_path, monkeypatch):
    url, httpd = file_server
    monkeypatch.setenv("SGLANG_BACKEND_CACHE", str(tmp_path / "cache"))
    path = download_and_cache_file(f"{url}/data.jsonl")
    assert path == str(tmp_path / "cache" / "downloads" / "data.jsonl")
    assert list(read_jsonl(path)) == [{"a": 1}, {"a": [2, "x"]}]
    httpd.shutdown()  # the second call must not need the server
    assert download_and_cache_file(f"{url}/data.jsonl") == path


def test_an_explicit_filename_and_a_missing_file(file_server, tmp_path):
    url, _ = file_server
    target = tmp_path / "sub" / "mine.jsonl"
    assert download_and_cache_file(f"{url}/data.jsonl", filename=str(target)) == str(target)
    assert target.read_text(encoding="utf-8").startswith('{"a": 1}')
    with pytest.raises(urllib.error.HTTPError):
        download_and_cache_file(f"{url}/absent.jsonl", filename=str(tmp_path / "absent.jsonl"))
    assert not (tmp_path / "absent.jsonl").exists() and not (tmp_path / "absent.jsonl.part").exists()
