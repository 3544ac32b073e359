"""Upstream SGLang frontend features (issue 28) on a real server: through ``RuntimeEndpoint`` (the native
/generate route) and the ``OpenAI`` backend (the /v1 routes). The in-process cases are in
tests/unit/test_upstream_compat.py."""

from __future__ import annotations

import pytest

import sglang_backend as sgl
from sglang_backend.utils import http_request
from tests.upstream_programs import (
    check_cache_prefills_the_prefix,
    check_cot_step_0,
    check_parallel_encoding,
    check_think_then_color,
    gen_character_spec,
)


@pytest.fixture()
def endpoint(server):
    return sgl.RuntimeEndpoint(server.url, api_key=server.api_key)


@pytest.fixture()
def completion_api(server):
    return sgl.OpenAI("default", is_chat_model=False, base_url=server.url + "/v1", api_key=server.api_key)


def test_prefill_only_top_logprobs_through_the_server(endpoint):
    check_cot_step_0(endpoint)


def test_model_name_endpoint_attribute_and_cache(endpoint):
    assert endpoint.endpoint is endpoint
    model_path = endpoint.get_model_name()
    assert model_path == endpoint.model_info["model_path"] and model_path
    check_cache_prefills_the_prefix(endpoint, "issue 28, server")


@pytest.mark.parametrize("which", ["endpoint", "completion_api"])
def test_separate_reasoning_and_fork_lambda_on_server_backends(which, request):
    backend = request.getfixturevalue(which)
    check_think_then_color(backend)
    check_parallel_encoding(backend)


def test_openai_completion_model_select(server):
    # Upstream's programs name OpenAI's models; the server answers any name with its one model.
    completion_api = sgl.OpenAI("gpt-3.5-turbo-instruct", base_url=server.url + "/v1", api_key=server.api_key)
    assert not completion_api.is_chat_model

    @sgl.function
    def capital(s):
        s += "The capital of France is"
        s += sgl.select("city", [" Paris", " London", " Tokyo"])
        s += "."

    state = capital.run(backend=completion_api)
    assert state["city"] in (" Paris", " London", " Tokyo")
    assert state.text() == "The capital of France is" + state["city"] + "."
    assert state.get_meta_info("city")["scores"].count(1) == 1
    chat = sgl.OpenAI("gpt-3.5-turbo", base_url=server.url + "/v1", api_key=server.api_key)
    assert chat.is_chat_model
    with pytest.raises(NotImplementedError, match="chat model"):
        chat.select(None, ["a"], 0.0, None)


def test_openai_chat_model_speculative_execution(server):
    backend = sgl.OpenAI("default", base_url=server.url + "/v1", api_key=server.api_key)
    state = gen_character_spec.run(backend=backend, temperature=0)
    state.sync()
    assert state.error() is None
    assert all(isinstance(state[k], str) for k in ("name", "birthday", "job"))
    assert backend.token_usage.api_calls == 1  # one chat completion for the whole templated turn
    assert state.messages()[-1]["content"].startswith("Name:")


def test_upstream_http_request_helper(server):
    """``sglang.utils.http_request`` as upstream's examples (json_logprobs) call a server with it."""
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2}
    res = http_request(server.url + "/generate", json=body, api_key=server.api_key)
    assert res.status_code == 200
    meta = res.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(meta["output_top_logprobs"])
    streamed = http_request(server.url + "/generate", json={**body, "stream": True}, stream=True,
                            api_key=server.api_key)
    assert any(line.startswith(b"data: [DONE]") for line in streamed.iter_lines())
    assert http_request(server.url + "/generate", json={"text": 1}, api_key=server.api_key).status_code == 400
    assert http_request(server.url + "/generate", json=body).status_code == 401  # no key: answered, not raised
