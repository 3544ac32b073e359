"""OpenAI tool calling on /v1/chat/completions against the real server (embedded SmolLM2, whose chat template has
no tools: the Hermes fallback prompt and format) with the real ``openai`` client: every ``tool_choice``, parallel
calls, a streamed call reassembled, a two-turn tool loop; 200 sampled ``required`` calls at temperature 1 all
name a declared tool with schema-valid arguments, and every call the model starts under ``auto`` parses.
Malformed tools, unknown tools in the history and invalid or huge schemas are 400s; the server keeps serving
(and the KV pool is whole after every test: conftest). A second server with ``--reasoning-parser qwen3`` splits
``<think>...</think>`` into ``reasoning_content`` (SmolLM2 does not think: a request grammar makes it)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.integration.conftest import API_KEY, ServerHandle

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Tokyo?"}]
MAX_TOKENS = 64


def chat(oai, **kw):
    kw = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return oai.chat.completions.create(**kw)


def assert_valid(calls) -> None:
    """Every call names a declared tool and its arguments validate against that tool's schema."""
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in SCHEMAS, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# tool_choice ---------------------------------------------------------------------------------------------------------
def test_required_returns_valid_calls_and_no_content(oai):
    choice = chat(oai, tool_choice="required").choices[0]
    assert choice.message.tool_calls and choice.message.content is None
    assert choice.finish_reason in ("tool_calls", "length")
    assert_valid(choice.message.tool_calls)


def test_named_tool_forces_that_one_call(oai):
    choice = chat(oai, tool_choice={"type": "function", "function": {"name": "add"}},
                  messages=[{"role": "user", "content": "What is 2 plus 3?"}]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    assert_valid(choice.message.tool_calls)


def test_none_and_auto_without_a_call_answer_in_text(oai):
    none = chat(oai, tool_choice="none", max_tokens=16).choices[0]
    assert none.message.tool_calls is None and none.message.content
    auto = chat(oai, max_tokens=16).choices[0]  # tools given, no tool_choice: "auto"
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    if auto.message.tool_calls:
        assert_valid(auto.message.tool_calls)
    else:
        assert "<tool_call>" not in auto.message.content


def test_parallel_calls_and_parallel_false(oai):
    many = chat(oai, tool_choice="required", max_tokens=160).choices[0]
    assert len(many.message.tool_calls) >= 2  # SmolLM2 keeps calling: the grammar lets it (up to 8)
    assert_valid(many.message.tool_calls)
    one = chat(oai, tool_choice="required", parallel_tool_calls=False, max_tokens=160).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    assert_valid(one.message.tool_calls)


def test_streamed_call_reassembles(oai):
    stream = chat(oai, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    calls: dict[int, dict] = {}
    finish, fragments = None, 0
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            c["arguments"] += d.function.arguments or ""
            fragments += 1
    assert finish == "tool_calls" and fragments > 1  # name first, then argument fragments
    (call,) = calls.values()
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])
    whole = chat(oai, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert json.loads(whole.message.tool_calls[0].function.arguments) == json.loads(call["arguments"])


def test_two_turn_tool_loop(oai):
    messages = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]
    first = chat(oai, messages=messages, tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    call = first.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    second = chat(oai, messages=messages, max_tokens=24).choices[0]  # auto: it may answer or call again
    assert second.message.content or second.message.tool_calls
    if second.message.tool_calls:
        assert_valid(second.message.tool_calls)
    final = chat(oai, messages=messages, tool_choice="none", max_tokens=24).choices[0]
    assert final.message.content and final.message.tool_calls is None


# Sampled: every returned call is valid; every started call parses ----------------------------------------------------
def sampled(oai, n: int, **kw) -> list:
    return chat(oai, n=n, temperature=1.0, seed=None, **kw).choices


def test_200_sampled_required_calls_validate(oai):
    with ThreadPoolExecutor(4) as pool:
        batches = list(pool.map(lambda _: sampled(oai, 50, tool_choice="required", parallel_tool_calls=False,
                                                  max_tokens=48), range(4)))
    choices = [c for batch in batches for c in batch]
    assert len(choices) == 200
    with_calls = [c for c in choices if c.message.tool_calls]
    for c in with_calls:
        assert_valid(c.message.tool_calls)
    # A call is only returned whole; one cut off by max_tokens is none (finish "length").
    assert all(c.finish_reason == "length" for c in choices if not c.message.tool_calls)
    assert len(with_calls) >= 180, f"only {len(with_calls)} of 200 finished their call"


def test_every_call_started_under_auto_parses(oai):
    choices = sampled(oai, 48, messages=[{"role": "user", "content": "Call get_weather for Paris."}],
                      max_tokens=48)
    for c in choices:
        if c.message.tool_calls:
            assert_valid(c.message.tool_calls)
            assert c.finish_reason in ("tool_calls", "length")
        elif c.finish_reason != "length":
            assert "<tool_call>" not in (c.message.content or ""), c.message.content


# Hostile input -------------------------------------------------------------------------------------------------------
HUGE = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)}}
DEEP = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string", "pattern": "(a|b){20000}"}}},
        "required": ["a"]}
BAD_CALL = {"id": "call_x", "type": "function", "function": {"name": "launch_missiles", "arguments": "{}"}}
HOSTILE = [
    ("tools-not-list", {"tools": {"a": 1}}),
    ("tool-no-function", {"tools": [{"type": "function"}]}),
    ("tool-bad-type", {"tools": [{"type": "retrieval"}]}),
    ("tool-bad-name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}),
    ("schema-invalid", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}),
    ("schema-not-object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}),
    ("schema-huge", {"tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE}}]}),
    ("schema-explodes", {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}],
                         "tool_choice": "required"}),
    ("choice-unknown-tool", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("choice-without-tools", {"tool_choice": "required"}),
    ("choice-bad", {"tools": TOOLS, "tool_choice": "always"}),
    ("parallel-not-bool", {"tools": TOOLS, "parallel_tool_calls": "yes"}),
    ("history-unknown-tool", {"tools": TOOLS, "messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [BAD_CALL]},
        {"role": "tool", "tool_call_id": "call_x", "content": "done"}]}),
    ("history-bad-arguments", {"tools": TOOLS, "messages": ASK + [
        {"role": "assistant", "tool_calls": [{**BAD_CALL, "function": {"name": "add", "arguments": "{oops"}}]}]}),
    ("history-unanswered-id", {"tools": TOOLS, "messages": ASK + [
        {"role": "assistant", "tool_calls": [{**BAD_CALL, "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_other", "content": "1"}]}),
]


@pytest.mark.parametrize("name,body", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_tools_are_400(server, name, body):
    payload = {"model": "m", "messages": ASK, "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60,
                   headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 400, (name, r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    assert message and "internal" not in message
    ok = httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 2},
                    timeout=60, headers={"Authorization": f"Bearer {server.api_key}"})
    assert ok.status_code == 200


# Reasoning (--reasoning-parser qwen3) --------------------------------------------------------------------------------
THINK = {"ebnf": 'start: "<think>\\n" /[a-z]{2,8}( [a-z]{2,8}){1,3}/ "\\n</think>\\n\\n" /[A-Z][a-z]{1,8}/ "."'}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    handle = ServerHandle("", API_KEY, log_dir=str(tmp_path_factory.mktemp("reasoning_server")),
                          extra_args=["--reasoning-parser", "qwen3"])
    handle.start()
    yield handle  # pytest runs the rest whether or not the tests passed
    assert not handle.stop(), "the reasoning server left orphan processes"


def test_reasoning_is_separated_whole_and_streamed(thinking_server):
    oai = thinking_server.openai()
    kw = dict(model="m", messages=ASK, max_tokens=40, temperature=0, extra_body=THINK)
    msg = oai.chat.completions.create(**kw).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and msg.model_extra["reasoning"] == reasoning
    assert msg.content and "</think>" not in msg.content and msg.content.endswith(".")
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in oai.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        streamed["content"] += delta.content or ""
        streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": msg.content}
    kept = oai.chat.completions.create(**{**kw, "extra_body": {**THINK, "separate_reasoning": False}})
    assert kept.choices[0].message.content.startswith("<think>")
    thinking_server.assert_pool_whole()
