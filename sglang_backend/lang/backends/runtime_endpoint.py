"""DSL backends over HTTP: ``RuntimeEndpoint`` (a running sglang_backend server) and ``Runtime`` (starts
one as a subprocess and tears it down)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import requests

from ... import environ
from ...runtime.server_args import ServerArgs
from ..chat_template import get_chat_template, guess_chat_template
from .base import NativeAPIBackend, image_data_url


class RuntimeEndpoint(NativeAPIBackend):
    def __init__(self, base_url: str, api_key: str | None = None, chat_template: str | None = None, timeout: float = 600,
                 fork_hints: bool = True):
        self.fork_hints = fork_hints  # False: no prefix hints before forks, selects and run_batch (ablation)
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        info = self._get("/get_model_info")
        self.model_info = info
        self._tokenizer = None
        if chat_template:
            self.chat_template = get_chat_template(chat_template)
        else:
            self.chat_template = guess_chat_template(self._hf_chat_template(), info.get("model_path"))

    def _hf_chat_template(self) -> str | None:
        try:
            return getattr(self.tokenizer, "chat_template", None)
        except Exception:  # noqa: BLE001 - the tokenizer may not be readable from here
            return None

    @property
    def tokenizer(self):
        """The server's tokenizer, loaded from its model path when that path is readable from here."""
        if self._tokenizer is None:
            from ...runtime.model_loader.loader import load_tokenizer  # deferred: transformers is slow to import

            self._tokenizer = load_tokenizer(self.model_info["tokenizer_path"])
        return self._tokenizer

    def _get(self, path: str):
        r = self.session.get(self.base_url + path, timeout=self.timeout)
        self._raise(r)
        return r.json()

    @staticmethod
    def _raise(r) -> None:
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001
                message = r.text
            raise RuntimeError(f"server returned {r.status_code}: {message}")

    def tokenize(self, text: str) -> list[int]:
        r = self.session.post(self.base_url + "/tokenize", json={"prompt": text}, timeout=self.timeout)
        self._raise(r)
        return r.json()["tokens"]

    def _encode_images(self, images: list) -> list:
        """Local files and in-memory images (video frames) travel as PNG data URLs: the server does not read
        the client's files. Strings that are not local files (data URLs, base64) pass through."""
        return [image_data_url(item) for item in images]

    def _send(self, payload: dict):
        r = self.session.post(self.base_url + "/generate", json=payload, timeout=self.timeout)
        self._raise(r)
        return r.json()

    def _send_stream(self, payload: dict):
        with self.session.post(self.base_url + "/generate", json=payload, stream=True, timeout=self.timeout) as r:
            self._raise(r)
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "stream error"))
                yield chunk

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

    def get_model_name(self) -> str:
        """The server's model path (upstream's name; programs load its tokenizer from it)."""
        return self.model_info["model_path"]

    def flush_cache(self) -> None:
        self.session.post(self.base_url + "/flush_cache", timeout=self.timeout)

    def end_session(self, session_id: str) -> bool:
        r = self.session.post(self.base_url + "/end_session", json={"session_id": session_id}, timeout=self.timeout)
        r.raise_for_status()
        return bool(r.json().get("released", False))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runtime(RuntimeEndpoint):
    """Launches ``sglang-backend serve`` with the given ServerArgs fields; ``shutdown()`` stops it."""

    def __init__(self, model_path: str | None = None, startup_timeout: float = 600, **server_kwargs):
        server_kwargs.setdefault("port", _free_port())
        args = ServerArgs.from_kwargs(model_path=model_path, **server_kwargs)
        cmd = [sys.executable, "-m", "sglang_backend.cli", "serve"]
        for name, value in vars(args).items():
            default = ServerArgs.__dataclass_fields__[name].default
            if value == default or value is None:
                continue
            flag = "--" + name.replace("_", "-")
            cmd += [flag] if value is True else [flag, str(value)]
        self.process = subprocess.Popen(cmd, env=environ.child_env())
        self.url = f"http://{args.host}:{args.port}"
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited during start-up (code {self.process.returncode})")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError("the server did not become healthy in time")
            time.sleep(0.5)
        super().__init__(self.url, api_key=args.api_key)

    def __call__(self) -> "Runtime":
        # Backward compatibility: ``endpoint`` (BaseBackend's attribute, self) was a method of Runtime, and
        # ``runtime.endpoint()`` now calls this.
        return self

    def shutdown(self) -> None:
        if getattr(self, "process", None) is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __del__(self):
        self.shutdown()
