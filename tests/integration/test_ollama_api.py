"""Ollama's API on the real server (embedded SmolLM2), through the real ``ollama`` client and langchain-ollama's
``ChatOllama``: chat, generate, streams, ``format`` (JSON and JSON schema), options, embed (equal to
/v1/embeddings), tags, show, ps, version, ``tools`` (calls, streamed calls, a tool round trip; ChatOllama's
``bind_tools`` and every ``with_structured_output`` method); bad input is a 4xx with Ollama's {"error": "..."} and
the KV pool is whole after every test (conftest).

SmolLM2-135M does not choose to call a tool on its own (``tool_choice`` auto, Ollama's only mode), so the tool
tests force the call with this server's extension option ``tool_choice`` ("required" or a tool's name), which
Ollama itself ignores."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field

ollama = pytest.importorskip("ollama")

MODEL = "smollm2:135m"  # any name is served
GREEDY = {"temperature": 0, "num_predict": 24}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
ONE_CALL = {"temperature": 0, "num_predict": 48, "tool_choice": "required", "parallel_tool_calls": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(server):
    c = ollama.Client(host=server.url, headers=server.headers, timeout=120)
    yield c
    c.close()


def test_chat_not_streamed(client):
    r = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    assert r.model == MODEL and r.done and r.done_reason in ("stop", "length")
    assert r.message.role == "assistant" and r.message.content
    assert r.prompt_eval_count > 5 and 1 <= r.eval_count <= 24
    assert r.total_duration >= r.eval_duration > 0 and r.load_duration == 0 and r.created_at.endswith("Z")


def test_chat_streamed_equals_not_streamed(client):
    full = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    parts = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == full.message.content
    assert parts[-1].eval_count == full.eval_count and parts[-1].done_reason == full.done_reason
    assert parts[-1].prompt_eval_duration > 0


def test_stream_defaults_to_true_on_the_wire(server):
    with httpx.stream("POST", server.url + "/api/chat", headers=server.headers, timeout=60,
                      json={"model": MODEL, "messages": ASK, "options": GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) >= 2 and lines[-1]["done"] is True and lines[0]["done"] is False


def test_generate_options_and_context(client):
    r = client.generate(model=MODEL, prompt="Count from one to five:", options={"temperature": 0, "num_predict": 5,
                                                                                 "num_ctx": 4096, "mirostat": 1})
    assert r.done_reason == "length" and r.eval_count == 5 and r.response  # unknown options ignored
    again = client.generate(model=MODEL, prompt="Count from one to five:", options={"temperature": 0, "num_predict": 5})
    assert again.response == r.response  # greedy: the same
    assert r.context[-5:] and len(r.context) == r.prompt_eval_count + 5
    follow = client.generate(model=MODEL, prompt="And then?", context=r.context, options={"num_predict": 3})
    assert follow.prompt_eval_count > len(r.context)
    stopped = client.generate(model=MODEL, prompt="Count: one, two, three, four,", raw=True,
                              options={"temperature": 0, "num_predict": 24, "stop": [","]})
    assert "," not in stopped.response and stopped.done_reason == "stop"
    seeded = [client.generate(model=MODEL, prompt="Say something.", options={"seed": 7, "temperature": 1.0,
                                                                             "num_predict": 8}).response
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_generate_stream_and_load(client):
    parts = list(client.generate(model=MODEL, prompt="Hello", stream=True, options={"num_predict": 4}))
    assert parts[-1].done and len(parts[-1].context) > 0
    loaded = client.generate(model=MODEL)  # no prompt: Ollama "loads" the model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_format_json_and_schema(client):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object about a cat."}],
                    format="json", options={"temperature": 0, "num_predict": 64})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"]}
    g = client.generate(model=MODEL, prompt="A person:", format=schema, options={"temperature": 0, "num_predict": 64})
    assert g.done_reason == "stop"
    obj = json.loads(g.response)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


@pytest.fixture
def short_context_client(server, tmp_path_factory):
    """An Ollama client of a second server whose context is 1024 tokens, for inputs longer than the context:
    truncating one to the shared server's context (8k tokens) embeds 8k tokens, over a minute on a CPU thread.
    Against an external server (SGLANG_TEST_SERVER_URL): that server. After the test its KV pool is whole."""
    handle = server
    if server.proc is not None:
        handle = type(server)("", server.api_key, log_dir=str(tmp_path_factory.mktemp("short_context_server")),
                              extra_args=["--context-length", "1024"])
        handle.start()
    c = ollama.Client(host=handle.url, headers=handle.headers, timeout=120)
    try:
        yield c
        handle.assert_pool_whole()
    finally:
        c.close()
        orphans = handle.stop() if handle is not server else []
    assert not orphans, f"the short-context server left orphan processes {orphans}:\n{handle.log_tail()}"


def test_embed_equals_openai_embeddings(client, http, short_context_client):
    one = client.embed(model=MODEL, input="The capital of France is Paris.")
    many = client.embed(model=MODEL, input=["The capital of France is Paris.", "Cats purr."])
    assert len(one.embeddings) == 1 and len(many.embeddings) == 2 and one.prompt_eval_count > 0
    assert many.embeddings[0] == pytest.approx(one.embeddings[0], abs=1e-5)
    oai = http.post("/v1/embeddings", json={"input": "The capital of France is Paris."}).json()
    assert one.embeddings[0] == pytest.approx(oai["data"][0]["embedding"], abs=1e-5)
    legacy = client.embeddings(model=MODEL, prompt="The capital of France is Paris.")
    assert list(legacy.embedding) == pytest.approx(one.embeddings[0], abs=1e-5)
    assert client.embed(model=MODEL, input="").embeddings == []
    long_text = "word " * 20000  # truncated to the context (the default), or refused without truncation
    assert len(short_context_client.embed(model=MODEL, input=long_text).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as e:
        short_context_client.embed(model=MODEL, input=long_text, truncate=False)
    assert e.value.status_code == 400


def test_tags_show_ps_version(client, server):
    models = client.list().models
    assert models and models[0].model and models[0].details.family == "llama"
    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and "embedding" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] > 0 and "im_start" in shown.template
    assert client.ps().models[0].context_length > 0
    assert httpx.get(server.url + "/api/version", headers=server.headers).json()["version"]
    assert httpx.get(server.url + "/", headers=server.headers).text == "Ollama is running"


@pytest.mark.parametrize("path,body", [
    ("/api/chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
    ("/api/chat", {"model": MODEL, "messages": "hi"}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"temperature": "hot"}}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"num_predict": "many"}}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"top_p": 7}}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"top_k": -5}}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"stop": 5}}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": "fast"}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "format": "yaml"}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "format": {"type": "nonsense"}}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "format": 5}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "think": True}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name"}}]}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": "all"}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [5]}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [WEATHER, WEATHER]}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 5}}}}}]}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [WEATHER], "format": "json"}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [WEATHER], "options": {"tool_choice": "other"}}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [WEATHER], "options": {"tool_choice": 5}}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [WEATHER], "options": {"parallel_tool_calls": "yes"}}),
    ("/api/chat", {"model": MODEL, "tools": [WEATHER], "messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "unknown", "arguments": {}}}]}]}),
    ("/api/chat", {"model": MODEL, "tools": [WEATHER], "messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": 5}}]}]}),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "assistant", "content": "", "tool_calls": [5]}]}),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}),
    ("/api/chat", {"model": MODEL, "messages": ASK, "stream": "yes"}),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "template": "{{ .Prompt }}"}),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "suffix": "end"}),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "context": [10**9]}),
    ("/api/generate", {"model": MODEL, "prompt": "x" * 600_000}),
    ("/api/generate", {"model": MODEL, "prompt": 5}),
    ("/api/embed", {"model": MODEL, "input": 5}),
    ("/api/embed", {"model": MODEL, "input": ["a", ""]}),
    ("/api/embed", {"model": MODEL, "input": "a", "dimensions": 3}),
    ("/api/embeddings", {"model": MODEL, "prompt": ["a"]}),
    ("/api/show", {"model": 5}),
])
def test_bad_input_is_a_4xx_with_ollamas_error(server, path, body):
    for stream in (False, True):
        r = httpx.post(server.url + path, json={**body, "stream": stream} if "stream" not in body else body,
                       headers=server.headers, timeout=60)
        assert r.status_code == 400, (r.status_code, r.text[:300])
        err = r.json()["error"]
        assert isinstance(err, str) and err and "Traceback" not in err


def test_client_raises_response_error(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=ASK, options={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error


# langchain-ollama ----------------------------------------------------------------------------------------------------
@pytest.fixture
def chat_model(server):
    langchain_ollama = pytest.importorskip("langchain_ollama")
    return langchain_ollama.ChatOllama(model=MODEL, base_url=server.url, temperature=0, num_predict=24,
                                       client_kwargs={"headers": server.headers, "timeout": 120})


def test_chat_ollama_invoke_and_stream(chat_model):
    msg = chat_model.invoke("What is the capital of France? Answer in one word.")
    assert msg.content and msg.usage_metadata["input_tokens"] > 5 and msg.usage_metadata["output_tokens"] >= 1
    assert msg.response_metadata["done_reason"] in ("stop", "length")
    chunks = list(chat_model.stream("What is the capital of France? Answer in one word."))
    assert len(chunks) >= 2 and "".join(c.content for c in chunks) == msg.content


def test_chat_ollama_structured_output(chat_model):
    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    structured = chat_model.bind(num_predict=64).with_structured_output(City)  # method="json_schema": format=schema
    city = structured.invoke("Name a city in France.")
    assert isinstance(city, City) and city.name and city.country


# Tools -----------------------------------------------------------------------------------------------------------
def get_weather(city: str) -> str:
    """The current weather of a city.

    Args:
      city: the city's name
    """
    return f"sunny in {city}"


def test_chat_tool_call_streamed_and_round_trip(client):
    r = client.chat(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], options=ONE_CALL)
    assert r.done and r.message.content == "" and len(r.message.tool_calls) == 1
    call = r.message.tool_calls[0].function
    assert call.name == "get_weather" and set(call.arguments) == {"city"} and isinstance(call.arguments["city"], str)
    parts = list(client.chat(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], options=ONE_CALL, stream=True))
    streamed = [c.function for p in parts for c in p.message.tool_calls or []]
    assert streamed == [call] and parts[-1].done and parts[-1].eval_count == r.eval_count
    # A Python function as the tool (the client derives its schema), and its result sent back.
    again = client.chat(model=MODEL, messages=ASK_WEATHER, tools=[get_weather], options=ONE_CALL)
    assert again.message.tool_calls[0].function.name == "get_weather"
    history = [*ASK_WEATHER, again.message,
               {"role": "tool", "tool_name": "get_weather", "content": get_weather(**call.arguments)}]
    answer = client.chat(model=MODEL, messages=history, tools=[get_weather], options=GREEDY)
    assert answer.done and (answer.message.content or answer.message.tool_calls)


def test_chat_tools_auto_answers_text_or_valid_calls(client):
    r = client.chat(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], options=GREEDY)  # Ollama's mode: auto
    assert r.done and (r.message.content or r.message.tool_calls)
    for call in r.message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(call.function.arguments.get("city"), str)
    none = client.chat(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], options={**GREEDY, "tool_choice": "none"})
    assert none.message.content and not none.message.tool_calls
    assert "tools" in client.show(MODEL).capabilities


def test_chat_ollama_bind_tools_round_trip(chat_model):
    # langchain-core comes with langchain-ollama, which the chat_model fixture skips without
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    bound = chat_model.bind_tools([multiply]).bind(options=ONE_CALL)
    question = HumanMessage("What is 3 times 12?")
    ai = bound.invoke([question])
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "multiply"
    assert set(ai.tool_calls[0]["args"]) == {"a", "b"}
    chunks = list(bound.stream([question]))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in ai.tool_calls]
    result = multiply.invoke(ai.tool_calls[0])  # a ToolMessage answering the call's id
    final = chat_model.bind_tools([multiply]).invoke([question, ai, result])
    assert final.content or final.tool_calls


def test_chat_ollama_structured_output_every_method(chat_model):
    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    # function_calling: a tool named City; the call is forced with the server's tool_choice option.
    calling = chat_model.with_structured_output(City, method="function_calling")
    city = calling.invoke("Name a city in France.", options={"temperature": 0, "num_predict": 64,
                                                             "tool_choice": "City"})
    assert isinstance(city, City) and city.name and city.country
    # json_mode: format "json" (any JSON object; this small model fills the keys, not always with strings).
    schema = {"title": "City", "type": "object", "properties": {"name": {"type": "string"},
                                                                 "country": {"type": "string"}}}
    moded = chat_model.bind(num_predict=64).with_structured_output(schema, method="json_mode")
    obj = moded.invoke('Name a city in France as JSON: {"name": "...", "country": "..."}')
    assert isinstance(obj, dict) and obj


# DSPy ------------------------------------------------------------------------------------------------------------
def test_dspy_ollama_chat_route(server):
    """dspy 3.4's ``ollama_chat/`` provider speaks Ollama's OpenAI-compatible API at ``api_base`` (its default
    is http://localhost:11434/v1) through its own router: no litellm involved."""
    dspy = pytest.importorskip("dspy")
    lm = dspy.LM("ollama_chat/smollm2", api_base=server.url + "/v1", api_key=server.api_key, temperature=0,
                 max_tokens=16, cache=False)
    out = lm("What is the capital of France? Answer in one word.")
    assert len(out) == 1 and isinstance(out[0], str) and out[0]
