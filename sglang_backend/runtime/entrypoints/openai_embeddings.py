"""OpenAI-compatible /v1/embeddings: pooled final hidden states of the served causal LM (``--embedding-pooling``
last or mean, normalized), one vector per input, batched through the scheduler like any prompt."""

from __future__ import annotations

import base64
import struct

from fastapi import FastAPI, Request

from .app_context import get_context
from .errors import APIError
from .execution import run_embeddings
from .openai_protocol import EmbeddingRequest
from .request_parsing import json_body, read_model


def embedding_inputs(req: EmbeddingRequest) -> list:
    """The request's inputs: each a string or a list of token ids (OpenAI's four shapes of ``input``)."""
    if isinstance(req.input, str):
        return [req.input]
    if req.input and isinstance(req.input[0], int):
        return [req.input]
    if not req.input:
        raise APIError("input is empty", param="input")
    return list(req.input)


def encode_vector(vector: list[float], encoding_format: str):
    """A vector as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def embeddings(request: Request):
    ctx = get_context(request)
    req = await read_model(request, EmbeddingRequest)
    results = await run_embeddings(ctx, request, embedding_inputs(req), req.dimensions)
    prompt_tokens = sum(r["meta_info"].get("prompt_tokens", 0) for r in results)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(r["embedding"], req.encoding_format)}
            for i, r in enumerate(results)]
    return {"object": "list", "data": data, "model": ctx.response_model(req.model),
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def register(app: FastAPI) -> None:
    app.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))(embeddings)
