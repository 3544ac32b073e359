"""DSL backends over a real server: RuntimeEndpoint, and the OpenAI backend with API speculative execution."""

from __future__ import annotations

import pytest

import sglang_backend as sgl


def test_runtime_endpoint_program(server):
    backend = sgl.RuntimeEndpoint(server.url, api_key=server.api_key)

    @sgl.function
    def chat(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))

    @sgl.function
    def pick(s):
        s += sgl.user("What is the capital of France? Answer with one word.")
        s += sgl.assistant(sgl.select("city", choices=["Paris", "London", "Tokyo"]))

    assert "Paris" in chat.run(question="What is the capital of France?", backend=backend)["answer"]
    assert pick.run(backend=backend)["city"] == "Paris"


def test_api_speculative_execution_saves_calls_and_prompt_tokens(server):
    @sgl.function
    def describe(s):
        s += "Country: Germany\nCapital: Berlin\nLanguage: German\n\n"
        s += "Country: Italy\nCapital: Rome\nLanguage: Italian\n\n"
        s += "Country: France\n"
        s += "Capital:" + sgl.gen("capital", stop="\n") + "\n"
        s += "Language:" + sgl.gen("language", stop="\n") + "\n"

    @sgl.function(num_api_spec_tokens=64)
    def describe_spec(s):
        describe.func(s)

    results = {}
    for label, program in (("plain", describe), ("spec", describe_spec)):
        backend = sgl.OpenAI("default", is_chat_model=False, base_url=server.url + "/v1", api_key=server.api_key)
        state = program.run(backend=backend, temperature=0, max_new_tokens=32)
        results[label] = (state["capital"], state["language"], backend.token_usage.api_calls,
                          backend.token_usage.prompt_tokens)
    plain, spec = results["plain"], results["spec"]
    assert spec[2] < plain[2], results  # fewer API calls
    assert spec[3] < plain[3], results  # fewer prompt tokens sent
    assert plain[:2] == (" Paris", " French"), results  # the model follows the template here...
    assert spec[:2] == plain[:2], results  # ...so speculation parses the same fields


def test_openai_backend_chat_model(server):
    backend = sgl.OpenAI("default", base_url=server.url + "/v1", api_key=server.api_key)

    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))

    assert "Paris" in chat.run(backend=backend)["answer"]
    with pytest.raises(NotImplementedError, match="select"):
        backend.select(None, ["a"], 0.0, None)


def test_runtime_launches_and_tears_down_a_server():
    import requests

    runtime = sgl.Runtime(log_level="warning")
    try:
        @sgl.function
        def capital(s):
            s += "The capital of France is" + sgl.gen("city", max_tokens=3, temperature=0)

        assert "Paris" in capital.run(backend=runtime)["city"]
        url = runtime.url
    finally:
        runtime.shutdown()
    assert runtime.process.poll() is not None  # the server process is gone
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=2)
