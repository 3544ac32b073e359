"""Structured output through the real ``openai`` client, and hostile schemas (issue 25).

* ``client.chat.completions.parse(..., response_format=PydanticModel)`` with unbounded ``int`` and ``float``
  fields (and a string and a list) always parses and finishes with ``stop``, never ``length``: 50 requests
  sampled at temperature 1, concurrently. The schema compiler bounds what the model can write (digits of
  numbers, characters of strings, items of arrays: ``constrained/json_schema.py``), so ``max_tokens`` is
  picked to fit the longest object the grammar allows.
* Invalid or huge schemas (deep nesting, enormous enums, giant counted repeats) sent as ``response_format`` on
  ``/v1/chat/completions`` and as ``json_schema`` on ``/generate`` are a 400 with a clear message, answered
  quickly (refused by size and state budgets, not by a wall clock), and the server keeps serving.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import BaseModel, Field

from sglang_backend.runtime.constrained.json_schema import (
    MAX_EXPONENT_DIGITS,
    MAX_FRACTION_DIGITS,
    MAX_INTEGER_DIGITS,
    MAX_STRING_LENGTH,
)


N_REQUESTS = 50


MAX_READINGS = 4
MAX_LABEL = 40  # the string's own bound keeps the 50 sampled objects short on CPU (unbounded: MAX_STRING_LENGTH)


class Measurement(BaseModel):
    """Unbounded int and float fields (a model emitted 170-digit integers before the digit bounds), a string
    and a list (of unbounded floats; arrays get no default bound, so it has one here)."""

    label: str = Field(max_length=MAX_LABEL)
    count: int
    ratio: float
    readings: list[float] = Field(max_length=MAX_READINGS)


def longest_measurement_bytes() -> int:
    """Bytes of the longest ``Measurement`` the grammar allows (json.dumps layout): every token carries at least
    one byte, so this many tokens fit any object the grammar allows."""
    number = 1 + MAX_INTEGER_DIGITS + 1 + MAX_FRACTION_DIGITS + 2 + MAX_EXPONENT_DIGITS  # -d.de+d
    string = 2 + 6 * MAX_LABEL  # every character a \\uXXXX escape
    readings = 2 + MAX_READINGS * (number + 2)
    return len('{"label": , "count": , "ratio": , "readings": }') + string + 2 * number + readings


def test_parse_always_parses_at_temperature_1(server):
    client = server.openai(timeout=600.0)
    model = client.models.list().data[0].id
    max_tokens = longest_measurement_bytes() + 1  # + EOS
    assert max_tokens < 8192, "the caps let an object outgrow the model's context"

    def one(i: int):
        return client.chat.completions.parse(
            model=model, temperature=1.0, max_tokens=max_tokens, seed=1000 + i, response_format=Measurement,
            messages=[{"role": "user", "content": "Report one measurement of a sensor as JSON."}])

    with ThreadPoolExecutor(max_workers=16) as pool:
        completions = list(pool.map(one, range(N_REQUESTS)))
    for c in completions:
        choice = c.choices[0]
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content[:300])
        assert isinstance(choice.message.parsed, Measurement), choice.message.content


def _nested(depth: int) -> str:
    """JSON text of an object schema nested ``depth`` deep (built as text: too deep for json.dumps)."""
    return '{"type": "object", "required": ["a"], "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


HOSTILE_SCHEMAS = {  # JSON texts
    "not-a-schema-type": json.dumps({"type": "nonsense"}),
    "bad-keyword-value": json.dumps({"type": "string", "maxLength": -3}),
    "deep-nesting": _nested(2000),
    "enormous-enum": json.dumps({"enum": [f"value-{i}-" + "x" * 20 for i in range(50_000)]}),
    "giant-counted-repeat": json.dumps({"type": "string", "pattern": "^a{1000000}$"}),
    "giant-array-bounds": json.dumps({"type": "array", "items": {"type": "string", "pattern": "^[a-z]{500}$"},
                                      "minItems": 100000}),
}


def _chat(schema: str) -> str:
    return ('{"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], '
            '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema + "}}}")


def _generate(schema: str) -> str:
    return json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 8, "json_schema": schema}})


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("name", list(HOSTILE_SCHEMAS))
def test_hostile_schema_is_a_quick_clear_4xx(server, route, name):
    body = (_chat if route == "/v1/chat/completions" else _generate)(HOSTILE_SCHEMAS[name])
    with server.client(timeout=120.0) as http:
        t0 = time.monotonic()
        r = http.post(route, content=body, headers={"Content-Type": "application/json"})
        elapsed = time.monotonic() - t0
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
        error = r.json()["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
        words = ("schema", "grammar", "regex", "pattern", "too", "json", "nested")
        assert any(w in message.lower() for w in words), message
        assert elapsed < 30, f"{name} took {elapsed:.1f} s to refuse"
        ok = http.post("/generate", json={"text": "Say hi.", "sampling_params": {"max_new_tokens": 4}})
        assert ok.status_code == 200, ok.text[:300]
