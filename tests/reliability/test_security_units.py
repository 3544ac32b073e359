"""Fast checks without a server: safe defaults, the API-key middleware, the JSON walker and request bounds."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from sglang_backend.runtime.entrypoints.http_server import APIError, APIKeyMiddleware, check_json_value
from sglang_backend.runtime.managers import validation
from sglang_backend.runtime.managers.validation import ModelLimits, check_rid, check_text, parse_sampling_params
from sglang_backend.runtime.server_args import ServerArgs


def test_binds_loopback_and_bounds_queues_by_default():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([]))
    assert args.host == "127.0.0.1"
    assert args.allow_local_media is False
    assert args.max_queued_requests > 0 and args.max_request_body_bytes > 0
    with pytest.raises(ValueError):
        ServerArgs(request_timeout=0)


def _status(api_key: str, auth: bytes | None, path: str = "/generate") -> int:
    """The status APIKeyMiddleware answers (200: passed on to the app)."""
    sent = []

    async def app(scope, receive, send):
        sent.append(200)

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    headers = [(b"authorization", auth)] if auth is not None else []
    asyncio.run(APIKeyMiddleware(app, api_key)({"type": "http", "path": path, "headers": headers}, receive, send))
    return sent[0]


def test_api_keys_each_accepted_and_nothing_else():
    keys = "alpha, beta"
    assert _status(keys, b"Bearer alpha") == 200
    assert _status(keys, b"Bearer beta") == 200
    for bad in (None, b"", b"Bearer", b"Bearer alph", b"Bearer alphaa", b"bearer alpha", b"Bearer alpha, beta",
                b"Bearer alpha,beta", b"Basic alpha"):
        assert _status(keys, bad) == 401, bad
    assert _status(keys, None, "/health") == 200  # liveness stays open


def test_json_walker_bounds_depth_and_rejects_lone_surrogates():
    check_json_value({"a": [1, 2, {"b": "fine \u00e9\U0001f600"}]})
    deep = "x"
    for _ in range(65):
        deep = [deep]
    with pytest.raises(APIError):
        check_json_value(deep)
    for bad in ("\ud800", {"\udfff": 1}, [["ok", "\ud83d"]]):
        with pytest.raises(APIError):
            check_json_value(bad)


LIMITS = ModelLimits(context_len=512, max_total_num_tokens=4096, vocab_size=50_000)


@pytest.mark.parametrize("params", [
    {"stop": ["s"] * (validation.MAX_STOP_STRINGS + 1)},
    {"stop": "x" * (validation.MAX_STOP_STRING_CHARS + 1)},
    {"stop_token_ids": [1] * (validation.MAX_STOP_TOKEN_IDS + 1)},
    {"logit_bias": {str(i): 1 for i in range(validation.MAX_LOGIT_BIAS_ENTRIES + 1)}},
    {"regex": "a" * (validation.MAX_GRAMMAR_CHARS + 1)},
    {"temperature": float("nan")},
    {"stop": "\ud800"},
])
def test_sampling_bounds(params):
    """One past each bound is refused (before any stop string is tokenized or grammar compiled)."""
    with pytest.raises(ValueError):
        parse_sampling_params(params, LIMITS, None)


def test_text_and_rid_bounds():
    check_text("hello", LIMITS)
    with pytest.raises(ValueError):
        check_text("a" * (512 * validation.MAX_PROMPT_CHARS_PER_TOKEN + 1), LIMITS)
    with pytest.raises(ValueError):
        check_text("bad \ud800", LIMITS)
    check_rid("client-42")
    for bad in ("", "x" * (validation.MAX_RID_CHARS + 1), "a\nb", 5):
        with pytest.raises(ValueError):
            check_rid(bad)


def test_at_the_bounds_is_accepted():
    parse_sampling_params({"stop": ["s" * validation.MAX_STOP_STRING_CHARS] * validation.MAX_STOP_STRINGS,
                           "stop_token_ids": list(range(validation.MAX_STOP_TOKEN_IDS)),
                           "logit_bias": {str(i): 1 for i in range(validation.MAX_LOGIT_BIAS_ENTRIES)}}, LIMITS, None)
