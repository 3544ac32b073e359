"""The Responses API's parts that need no model (``entrypoints.openai_responses``): the bounded response store
(LRU, per credential), input items as chat messages (and their 400s), the prompt's token ids reusing the earlier
turn's, and the streamed output's event sequence for text and a function call."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_backend.runtime.entrypoints.errors import APIError
from sglang_backend.runtime.entrypoints.openai_chat import ChatOutput, DeltaReader
from sglang_backend.runtime.entrypoints.openai_responses import (EventStream, ResponseStore, ResponsesRequest,
                                                                  StoredResponse, StreamedOutput, Turn, input_messages,
                                                                  prompt_ids)


def stored(owner: str = "", **kw) -> StoredResponse:
    return StoredResponse(owner, {"id": "x"}, [], "", [], **kw)


def test_store_keeps_the_most_recently_used_and_scopes_by_owner():
    store = ResponseStore(2)
    store.put("a", stored())
    store.put("b", stored())
    assert store.get("a", "") is not None  # a is now the most recently used
    store.put("c", stored())
    assert store.get("b", "") is None and store.get("a", "") and store.get("c", "")
    store.put("d", stored("someone"))
    assert store.get("d", "") is None and store.get("d", "someone") is not None  # another credential: not found
    assert not store.pop("d", "") and store.pop("d", "someone") and store.get("d", "someone") is None
    empty = ResponseStore(0)
    empty.put("a", stored())
    assert empty.get("a", "") is None


def test_input_items_become_chat_messages():
    calls: dict = {}
    messages = input_messages([
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "name": "get_weather", "call_id": "c1", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "name": "get_weather", "call_id": "c2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rainy"}]},
    ], calls)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Be brief."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one assistant message
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "rainy"}
    assert calls == {"c1": "get_weather", "c2": "get_weather"}
    assert input_messages("hi", {}) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("items,words", [
    ([5], "must be an item object"),
    ([{"role": "wizard", "content": "hi"}], "role"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "unsupported content part"),
    ([{"type": "function_call_output", "call_id": "zz", "output": "x"}], "no function_call with call_id"),
    ([{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{"}], "not valid JSON"),
    ([{"type": "computer_call"}], "unsupported item type"),
])
def test_bad_input_items_are_400s_that_say_where(items, words):
    with pytest.raises(APIError) as e:
        input_messages(items, {})
    assert e.value.status == 400 and words in e.value.message and "input[0]" in e.value.message


def test_turn_converts_tools_choice_and_format():
    req = ResponsesRequest(input="hi", instructions="Be brief.", max_output_tokens=8, parallel_tool_calls=False,
                           tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                           tool_choice={"type": "function", "name": "f"},
                           text={"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}})
    turn = Turn.build(req, None)
    assert turn.conversation == [{"role": "user", "content": "hi"}]  # the instructions are not carried over
    chat = turn.chat
    assert chat.messages[0].role == "system" and chat.max_tokens == 8 and chat.parallel_tool_calls is False
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format.json_schema["schema"] == {"type": "object"}
    with pytest.raises(APIError):
        Turn.build(ResponsesRequest(input="hi", tools=[{"type": "web_search"}]), None)


def test_prompt_ids_reuse_the_earlier_turns_tokens():
    limits = SimpleNamespace(context_len=1000)
    ctx = SimpleNamespace(tm=SimpleNamespace(limits=limits, tokenize=lambda text, _special: [ord(c) for c in text]))
    previous = StoredResponse("", {}, [], "<p>", [1, 2], output_text="out.", output_ids=[7, 8])
    assert prompt_ids(ctx, "<p>out.<next>", previous) == [1, 2, 7, 8] + [ord(c) for c in "<next>"]
    assert prompt_ids(ctx, "<p>OTHER", previous) == [1, 2] + [ord(c) for c in "OTHER"]
    assert prompt_ids(ctx, "new", previous) == [ord(c) for c in "new"]


def events_of(stream: list[str]) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in stream]


def test_streamed_text_then_call_events():
    output = StreamedOutput(EventStream(), DeltaReader(ChatOutput("none", "hermes")))
    raw = []
    for piece in ["Sure", " ", "<tool_call>\n", '{"name": "f", "arguments": {"x"', ": 1}}\n</tool_call>"]:
        raw += output.feed(piece, False)
    raw += output.feed("", True) + output.finish()
    events = events_of(raw)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    message, call = output.output()
    assert message["content"][0]["text"] == "Sure " and call["name"] == "f" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"x": 1} and events[-2]["arguments"] == call["arguments"]


def test_streamed_empty_output_is_one_empty_message():
    output = StreamedOutput(EventStream(), DeltaReader(ChatOutput("none", None)))
    kinds = [e["type"] for e in events_of(output.feed("", True) + output.finish())]
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done"]
    assert output.output()[0]["content"][0]["text"] == ""
