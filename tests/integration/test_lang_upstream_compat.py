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
    check_pin_keeps_the_prefix,
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


def test_pin_keeps_the_prefix_through_the_server(endpoint):
    check_pin_keeps_the_prefix(endpoint, lambda: endpoint._get("/get_stats")["session_pinned_tokens"],
                               "issue 28, server")


@pytest.mark.parametrize("which", ["endpoint", "completion_api"])
def test_separate_reasoning_and_fork_lambda_on_server_backends(which, request):
    backend = request.getfixturevalue(which)
    check_think_then_color(backend)
    check_parallel_encoding(backend)


def test_openai_completion_model_select(server, endpoint):
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
    # Scored through echo + logprobs as the runtime backends score: the same decision and logprobs.
    endpoint_state = capital.run(backend=endpoint)
    assert state["city"] == endpoint_state["city"]
    ours, theirs = state.get_meta_info("city"), endpoint_state.get_meta_info("city")
    assert ours["normalized_prompt_logprobs"] == pytest.approx(theirs["normalized_prompt_logprobs"], abs=1e-4)
    assert [[e[2] for e in option] for option in ours["input_token_logprobs"]] == \
        [[e[2] for e in option] for option in theirs["input_token_logprobs"]]
    for method in (sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        @sgl.function
        def pick(s, method=method):
            s += "The capital of France is" + sgl.select("city", [" Paris", " London", " Tokyo"],
                                                         choices_method=method)

        assert pick.run(backend=completion_api)["city"] == pick.run(backend=endpoint)["city"]
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


@pytest.mark.parametrize("model", ["gpt-3.5-turbo-instruct", "gpt-4o"])
def test_openai_backend_gen_logprobs_as_the_runtime_backends(server, endpoint, model):
    """``gen(return_logprob=True, top_logprobs_num=k)`` through the OpenAI backend (completion and chat models):
    the runtime backends' meta_info shape with the API's texts for ids; ``max_tokens=0`` gives the next token's
    top-k (upstream's cot_decoding reads ``output_top_logprobs[0]``) and no text. Same values as the endpoint."""
    api = sgl.OpenAI(model, base_url=server.url + "/v1", api_key=server.api_key)

    @sgl.function
    def step(s, n):
        if api.is_chat_model:
            s += sgl.user("Name a colour.")
            s += sgl.assistant(sgl.gen("x", max_tokens=n, return_logprob=True, top_logprobs_num=3,
                                       return_text_in_logprobs=True, temperature=0))
        else:
            s += "Name a colour:" + sgl.gen("x", max_tokens=n, return_logprob=True, top_logprobs_num=3,
                                            return_text_in_logprobs=True, temperature=0)

    for n in (0, 4):
        ours = step.run(n=n, backend=api)
        mo = ours.get_meta_info("x")
        assert len(mo["output_token_logprobs"]) == n and (n or ours["x"] == "")
        assert "".join(e[2] for e in mo["output_token_logprobs"]) == ours["x"]
        assert all(e[0] <= 0 and e[1] is None for e in mo["output_token_logprobs"])  # the API sends texts, not ids
        assert len(mo["output_top_logprobs"]) == max(n, 1) and all(len(t) == 3 for t in mo["output_top_logprobs"])
        if api.is_chat_model:
            continue  # the chat route renders the model's own template; the endpoint, the DSL's: other prompts
        theirs = step.run(n=n, backend=endpoint)
        mt = theirs.get_meta_info("x")
        assert ours["x"] == theirs["x"]
        assert [e[2] for e in mo["output_token_logprobs"]] == [e[2] for e in mt["output_token_logprobs"]]
        assert [e[0] for e in mo["output_token_logprobs"]] == pytest.approx(
            [e[0] for e in mt["output_token_logprobs"]], abs=1e-4)
        assert [t[2] for t in mo["output_top_logprobs"][0]] == [t[2] for t in mt["output_top_logprobs"][0]]
        assert [t[0] for t in mo["output_top_logprobs"][0]] == pytest.approx(
            [t[0] for t in mt["output_top_logprobs"][0]], abs=1e-4)
