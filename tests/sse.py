"""A streamed ``/generate`` read on a background thread, for tests that act on a server while a stream runs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import httpx


@dataclass
class BackgroundStream:
    url: str
    body: dict
    headers: dict = field(default_factory=dict)
    timeout: float = 60
    events: list[str] = field(default_factory=list)  # the SSE data payloads, then "client error: ..." if it broke
    started: threading.Event = field(default_factory=threading.Event)  # set at the first event (or on failure)

    def start(self) -> "BackgroundStream":
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/generate", json=self.body, headers=self.headers,
                              timeout=self.timeout) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.started.set()
        except httpx.HTTPError as exc:
            self.events.append(f"client error: {exc!r}")
        self.started.set()
