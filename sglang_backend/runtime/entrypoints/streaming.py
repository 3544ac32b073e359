"""Streamed replies: server-sent events (OpenAI, native) and newline-delimited JSON (Ollama), each ending with an
error event rather than a broken connection when the request fails; and interleaving several result streams."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from ..managers.tokenizer_manager import RequestFailed, ServerUnavailable
from .errors import APIError, error_body

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An SSE body that ends with an error event (not a broken connection) when the request fails."""
    try:
        async for event in events:
            yield event
    except (ServerUnavailable, RequestFailed) as e:
        yield sse_event({"error": error_body(e)})
    except Exception:  # noqa: BLE001 - never a stack trace to the client; the log has it
        logger.exception("internal error in a stream")
        yield sse_event({"error": error_body(RuntimeError())})
    yield SSE_DONE


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(sse_stream(events), media_type="text/event-stream")


async def ndjson_stream(objects: AsyncIterator[dict]) -> AsyncIterator[str]:
    """An NDJSON body (one JSON object a line) whose failure is a last line {"error": "message"}, as Ollama's."""
    try:
        async for obj in objects:
            yield json.dumps(obj) + "\n"
    except (ServerUnavailable, RequestFailed) as e:
        yield json.dumps({"error": error_body(e)["message"]}) + "\n"
    except APIError as e:  # a request the pipeline ended as the client's error (say, nothing left to sample)
        yield json.dumps({"error": e.message}) + "\n"
    except Exception:  # noqa: BLE001 - never a stack trace to the client; the log has it
        logger.exception("internal error in a stream")
        yield json.dumps({"error": error_body(RuntimeError())["message"]}) + "\n"


def ndjson_response(objects: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(ndjson_stream(objects), media_type="application/x-ndjson")


async def merge_streams(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleaves several result streams as (index, item), in arrival order."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(queue, i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


_DONE = object()


async def _pump(queue: asyncio.Queue, i: int, stream: AsyncIterator[dict]) -> None:
    try:
        async for item in stream:
            await queue.put((i, item))
    except Exception as e:  # noqa: BLE001 - surfaced to the consumer
        await queue.put((i, e))
    finally:
        await queue.put((i, _DONE))
