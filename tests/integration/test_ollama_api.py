"""Ollama's API on the real server (embedded SmolLM2), through the real ``ollama`` client and langchain-ollama's
``ChatOllama``: chat, generate, streams, ``format`` (JSON and JSON schema), options, embed (equal to
/v1/embeddings), tags, show, ps, version; bad input is a 4xx with Ollama's {"error": "..."} and the KV pool is
whole after every test (conftest)."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field

ollama = pytest.importorskip("ollama")

MODEL = "smollm2:135m"  # any name is served
GREEDY = {"temperature": 0, "num_predict": 24}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


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


def test_embed_equals_openai_embeddings(client, http):
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
    assert len(client.embed(model=MODEL, input=long_text).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL, input=long_text, truncate=False)
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
    ("/api/chat", {"model": MODEL, "messages": ASK, "tools": [{"type": "function", "function": {"name": "f"}}]}),
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
