"""The app's own ASGI middleware: API keys and the request body size limit (the connection-level defences, slow
clients and draining, are in ``connection_guard``)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import FastAPI

from .errors import APIError, error_response

OPEN_ROUTES = {"/health", "/health_generate"}


class APIKeyMiddleware:
    """Bearer-token check as plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client
    disconnects from the handlers, and a disconnect must abort its request).

    ``api_key`` may list several keys separated by commas (one per client or tenant); request ids are scoped
    per key. The check compares SHA-256 digests with ``hmac.compare_digest`` against every key, so its time
    tells nothing about the keys' contents or lengths."""

    def __init__(self, app, api_key: str):
        self.app = app
        keys = [k.strip() for k in api_key.split(",") if k.strip()]
        self.expected = [hashlib.sha256(f"Bearer {k}".encode()).digest() for k in keys]

    def allowed(self, header: bytes) -> bool:
        given = hashlib.sha256(header).digest()
        ok = False
        for expected in self.expected:  # no early exit: every key is compared
            ok |= hmac.compare_digest(given, expected)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if self.allowed(given):
            return await self.app(scope, receive, send)
        response = error_response("invalid or missing API key", 401, "authentication_error")
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from Content-Length, or as soon as a chunked body passes
    the limit (counted while it is read, so an oversized body is never buffered whole)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self) -> APIError:
        return APIError(f"request body is larger than the server's limit of {self.max_bytes} bytes", 413)

    def declared_length_error(self, declared: bytes | None) -> APIError | None:
        """The error of a Content-Length header that is not a number or is over the limit; None if it is fine."""
        if declared is None or (declared.isdigit() and int(declared) <= self.max_bytes):
            return None
        return self.too_large() if declared.isdigit() else APIError("invalid Content-Length header")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = self.declared_length_error(dict(scope.get("headers") or []).get(b"content-length"))
        if err is not None:
            return await error_response(err.message, err.status)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self.too_large()  # inside the app: answered by its APIError handler
            return message

        await self.app(scope, limited_receive, send)


def install_middleware(app: FastAPI, server_args) -> None:
    """The body limit runs first (outermost: Starlette runs the last one added first), then the API key check."""
    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server_args.max_request_body_bytes)
