"""Reading a request: its JSON body (type, size and shape checked before any model sees it), its pydantic model,
its owner, and the checks every API family shares."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import Request

from ..managers.validation import MAX_PROMPTS_PER_REQUEST
from .errors import APIError

MAX_JSON_DEPTH = 64


def check_content_type(header: str) -> None:
    """A JSON body must say so. Browsers send text/plain and form bodies cross-origin without a preflight, so
    parsing those as JSON would let any web page drive a server that has no API key (CSRF)."""
    ctype = header.split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(f"Content-Type must be application/json, got {ctype!r}", 415)


def decode_json(body: bytes) -> Any:
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError("request body is not valid UTF-8")
    except json.JSONDecodeError as e:
        raise APIError(f"request body is not valid JSON: {e}")
    except RecursionError:
        raise APIError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
    check_json_value(data)
    return data


def check_json_value(data: Any) -> None:
    """Iterative walk (no recursion to exhaust): nesting at most MAX_JSON_DEPTH, and every string valid
    Unicode (JSON escapes can smuggle in lone surrogates, which no tokenizer or encoder accepts)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (str, list, dict)))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError("request body contains a string that is not valid Unicode (a lone surrogate escape)") from None


async def read_json(request: Request) -> Any:
    check_content_type(request.headers.get("content-type", ""))
    return decode_json(await request.body())


def parse(model_cls, data):
    """``data`` as ``model_cls``; a mismatch is answered as FastAPI's own validation errors are (400)."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors())


async def read_model(request: Request, model_cls):
    return parse(model_cls, await read_json(request))


def json_body(schema) -> dict:
    """``openapi_extra`` that documents a route's JSON body (the handlers read raw JSON themselves, to
    control every error). A pydantic model's ``$defs`` are inlined so the schema stands alone."""
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline_refs(schema, schema.get("$defs", {}))}}}}


def inline_refs(node, defs: dict):
    if isinstance(node, dict):
        if "$ref" in node:
            return inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [inline_refs(v, defs) for v in node]
    return node


def request_owner(request: Request) -> str:
    """Who sent a request: a digest of its credential (the Authorization header; "" when there is none).
    Request ids live in this owner's namespace only."""
    auth = request.headers.get("authorization")
    return hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()[:32] if auth else ""


def check_count(n: int) -> None:
    if n > MAX_PROMPTS_PER_REQUEST:
        raise APIError(f"one request may carry at most {MAX_PROMPTS_PER_REQUEST} prompts x n, got {n}")
