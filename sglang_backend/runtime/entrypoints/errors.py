"""Every exception a request can end in, mapped to its HTTP status and OpenAI-style body in one place.

Every error a client can cause is a 4xx with a body {"error": {"message", "type", "param", "code"}}; internal
failures are 5xx without stack traces (the log has them).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..managers.tokenizer_manager import Overloaded, RequestFailed, ServerUnavailable
from .preparation import PreparationAborted

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param


def error_response(message: str, status: int = 400, err_type: str = "invalid_request_error", param=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}}, status_code=status,
                        headers=headers)


def error_body(exc: Exception) -> dict:
    """The OpenAI-style error of a pipeline-side failure (for JSON replies and SSE error events)."""
    if isinstance(exc, Overloaded):
        return {"message": f"server overloaded: {exc}; retry later", "type": "server_error", "code": 503}
    if isinstance(exc, ServerUnavailable):
        return {"message": f"server unavailable: {exc}", "type": "server_error", "code": 503}
    if isinstance(exc, RequestFailed):
        return {"message": str(exc), "type": "timeout_error" if exc.status == 504 else "server_error", "code": exc.status}
    if isinstance(exc, TimeoutError):
        return {"message": "the scheduler did not answer in time", "type": "timeout_error", "code": 504}
    return {"message": "internal server error", "type": "internal_error", "code": 500}


def preparation_error(exc: Exception) -> APIError:
    """A request preparation job's failure as the client sees it: ``PreparationAborted`` keeps its status (499 or
    504), a ValueError is the client's error (400)."""
    if isinstance(exc, PreparationAborted):
        return APIError(str(exc), exc.status, "timeout_error" if exc.status == 504 else "invalid_request_error")
    return APIError(str(exc))


def unavailable(exc: ServerUnavailable) -> APIError:
    return APIError(f"server unavailable: {exc}", 503, "server_error")


def validation_error_fields(errors: list) -> tuple[str, str | None]:
    """(message, param) of a pydantic validation failure: its first error, located without the "body" prefix."""
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", []) if x != "body")
    return f"{loc or 'body'}: {first.get('msg', 'invalid request')}", loc or None


def ended_by_pipeline(finish_reason: dict, default_message: str) -> APIError:
    """The error for a request the pipeline ended (an abort finish reason): its own status, the client's error
    (4xx, say nothing left to sample) or ours (5xx)."""
    status = finish_reason.get("status_code", 500)
    return APIError(finish_reason.get("message", default_message), status,
                    "server_error" if status >= 500 else "invalid_request_error")


def http_error_type(status: int) -> str:
    return "not_found_error" if status == 404 else "invalid_request_error"


# Handlers ---------------------------------------------------------------------------------------------------------
async def api_error_handler(_, exc: APIError):
    return error_response(exc.message, exc.status, exc.err_type, exc.param)


async def validation_error_handler(_, exc: RequestValidationError):
    message, param = validation_error_fields(exc.errors())
    return error_response(message, 400, param=param)


async def http_error_handler(_, exc: StarletteHTTPException):
    return error_response(str(exc.detail), exc.status_code, http_error_type(exc.status_code))


async def pipeline_error_handler(_, exc: Exception):
    err = error_body(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, Overloaded) else None
    return error_response(err["message"], err["code"], err["type"], headers=headers)


async def internal_error_handler(_, exc: Exception):
    logger.exception("internal error")
    return error_response("internal server error", 500, "internal_error")


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    RequestValidationError: validation_error_handler,
    StarletteHTTPException: http_error_handler,
    TimeoutError: pipeline_error_handler,
    RequestFailed: pipeline_error_handler,
    Overloaded: pipeline_error_handler,
    ServerUnavailable: pipeline_error_handler,
    Exception: internal_error_handler,
}


async def response_for(exc: Exception) -> JSONResponse:
    """The reply the app's handlers give ``exc`` (the handler of its nearest class), for routes that reshape the
    error body themselves (Ollama's {"error": "message"})."""
    handler = next(EXCEPTION_HANDLERS[cls] for cls in type(exc).__mro__ if cls in EXCEPTION_HANDLERS)
    return await handler(None, exc)


def install_error_handlers(app: FastAPI) -> None:
    for exc_class, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
