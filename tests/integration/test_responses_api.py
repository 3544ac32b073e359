"""OpenAI's Responses API on the real server (embedded SmolLM2) with the real ``openai`` client: plain and streamed
``responses.create`` (the event sequence of the API), ``text.format`` JSON schema, a follow-up with
``previous_response_id`` whose prompt reuses the earlier turn's KV (``cached_tokens`` covers it), retrieve / delete,
``store: false`` not retrievable, function tools (a call and its output in a second turn), and hostile input: a 4xx
with a clear message, the server unharmed and the KV pool whole after every test (conftest)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

ASK = "What is the capital of France? Answer in one word."
SMALL = dict(model="any-name", temperature=0, max_output_tokens=16)
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


def test_plain_text_and_items(oai):
    r = oai.responses.create(input=ASK, **SMALL)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "any-name"
    assert r.status in ("completed", "incomplete") and r.output_text
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.usage.input_tokens > 5 and 1 <= r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    items = oai.responses.create(instructions="You are terse.", **SMALL,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    assert items.output_text and items.instructions == "You are terse."
    cut = oai.responses.create(input="Count from one to one hundred.", model="m", temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def test_streamed_events_match_the_plain_response(oai):
    plain = oai.responses.create(input=ASK, **SMALL)
    events = list(oai.responses.create(input=ASK, stream=True, **SMALL))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == TEXT_EVENTS[:4] + ["response.output_text.delta"] * deltas + TEXT_EVENTS[5:] + \
        [f"response.{plain.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    assert oai.responses.retrieve(final.id).output_text == plain.output_text  # streamed responses are stored too


def test_previous_response_id_reuses_the_earlier_turn(oai):
    first = oai.responses.create(input="My name is Ada. Say hello to me.", instructions="Be brief.", **SMALL)
    second = oai.responses.create(input="What is my name?", previous_response_id=first.id,
                                  instructions="Be brief.", **SMALL)
    assert second.previous_response_id == first.id and second.output_text
    earlier_turn = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > earlier_turn
    # The earlier prompt and its output (all but its last token, whose KV was never computed) come from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= earlier_turn - 1
    third = oai.responses.create(input="Thanks.", previous_response_id=second.id, instructions="Be brief.", **SMALL)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens + second.usage.output_tokens - 1
    # Without the instructions the prompt no longer starts with the earlier turn's: still answered, less cached.
    other = oai.responses.create(input="And yours?", previous_response_id=first.id, **SMALL)
    assert other.output_text and other.usage.input_tokens_details.cached_tokens < earlier_turn - 1


def test_retrieve_delete_and_store_false(oai):
    kept = oai.responses.create(input=ASK, **SMALL)
    again = oai.responses.retrieve(kept.id)
    assert again.id == kept.id and again.output_text == kept.output_text and again.usage == kept.usage
    unkept = oai.responses.create(input=ASK, store=False, **SMALL)
    assert unkept.output_text and unkept.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(input="Go on.", previous_response_id=unkept.id, **SMALL)
    assert "previous_response_id" in str(e.value)
    oai.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(kept.id)


def test_json_schema_text_format(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = oai.responses.create(input="Name the capital of France as JSON.", model="m", temperature=0,
                             max_output_tokens=32, text={"format": {"type": "json_schema", "name": "city",
                                                                    "schema": schema, "strict": True}})
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"city"}
    assert r.text.format.type == "json_schema"

    class Capital(BaseModel):
        city: str = Field(max_length=20)
        population: int

    parsed = oai.responses.parse(input="The capital of France, as JSON.", model="m", temperature=0,
                                 max_output_tokens=48, text_format=Capital)
    assert isinstance(parsed.output_parsed, Capital) and parsed.output_parsed.city


WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
ASK_WEATHER = "What is the weather in Paris?"
ONE_CALL = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, model="m", temperature=0,
                max_output_tokens=48)


def test_function_tool_call_streamed_and_answered(oai):
    r = oai.responses.create(input=ASK_WEATHER, **ONE_CALL)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and r.tools[0].name == "get_weather"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    events = list(oai.responses.create(input=ASK_WEATHER, stream=True, **ONE_CALL))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments  # greedy: the same call, streamed
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta").replace(" ", "") \
        == call.arguments.replace(" ", "")
    # The tool's result, continuing the stored conversation (tool_choice auto): the earlier turn's KV is reused.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "sunny"})}
    again = {**ONE_CALL, "tool_choice": "auto", "max_output_tokens": 24}
    follow = oai.responses.create(input=[result], previous_response_id=r.id, **again)
    assert follow.output and follow.usage.input_tokens_details.cached_tokens >= \
        r.usage.input_tokens + r.usage.output_tokens - 1
    # The same, stateless: the earlier output items replayed as input give the same prompt and output.
    replay = oai.responses.create(input=[{"role": "user", "content": ASK_WEATHER}, *r.output, result], store=False,
                                  **again)
    assert replay.usage.input_tokens == follow.usage.input_tokens
    assert [i.type for i in replay.output] == [i.type for i in follow.output]


BAD_BODIES = [
    {"input": 5},
    {"input": [5]},
    {"input": [{"role": "wizard", "content": "hi"}]},
    {"input": [{"role": "user", "content": 7}]},
    {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
    {"input": [{"type": "item_reference", "id": "x"}]},
    {"input": [{"type": "function_call", "name": "f", "call_id": "c1", "arguments": "{not json"}]},
    {"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]},
    {"input": [{"type": "function_call_output", "call_id": "nope", "output": "42"}]},
    {"input": []},
    {"input": "hi", "previous_response_id": "resp_does_not_exist"},
    {"input": "hi", "tools": [{"type": "web_search"}]},
    {"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"input": "hi", "tools": "all"},
    {"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]},
    {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
    {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]},
    {"input": "hi", "tools": [WEATHER, WEATHER]},
    {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
    {"input": "hi", "tool_choice": "required"},
    {"input": "hi", "tools": [WEATHER], "tool_choice": "sometimes"},
    {"input": [{"type": "function_call", "name": "nope", "call_id": "c1", "arguments": "{}"}], "tools": [WEATHER]},
    {"input": "hi", "tool_choice": {"type": "allowed_tools"}},
    {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
    {"input": "hi", "text": {"format": {"type": "yaml"}}},
    {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
    {"input": "hi", "temperature": "hot"},
    {"input": "hi", "max_output_tokens": 0},
    {"input": "hi", "store": "yes"},
    {"input": "x" * 600_000},
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_bad_input_is_a_4xx_with_a_clear_message(http, body):
    for stream in (False, True):
        r = http.post("/v1/responses", json={"model": "m", "max_output_tokens": 4, **body, "stream": stream})
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and "Traceback" not in err["message"] and err["type"]
    assert http.get("/v1/responses/resp_unknown").status_code == 404
    assert http.delete("/v1/responses/resp_unknown").status_code == 404
