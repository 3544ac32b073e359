"""The HTTP layer's pure helpers (request parsing, response shaping, SSE chunks, error mapping), without a model
or a server. The routes themselves run end to end in tests/integration/test_server_*.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace as NS

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from sglang_backend.runtime.entrypoints import (errors, http_server, native_api, ollama_api, openai_chat, openai_common,
                                                openai_completions, openai_embeddings, openai_responses, operations,
                                                request_parsing, streaming)
from sglang_backend.runtime.entrypoints.app_context import AppContext, served_model_name, served_model_names
from sglang_backend.runtime.entrypoints.errors import APIError
from sglang_backend.runtime.entrypoints.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from sglang_backend.runtime.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from sglang_backend.runtime.entrypoints.preparation import PreparationAborted
from sglang_backend.runtime.managers.tokenizer_manager import Overloaded, RequestFailed, ServerUnavailable
from sglang_backend.runtime.managers.validation import MAX_PROMPTS_PER_REQUEST

MSGS = [{"role": "user", "content": "hi"}]


class Tok:
    """Token id t decodes to "<t>"."""

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "p", **kw})


def gen(**kw) -> GenerateRequest:
    return GenerateRequest.model_validate(kw)


def ctx(model_name="served", model_path="/models/m") -> AppContext:
    return AppContext(tm=None, server_args=NS(model_path=model_path), metrics=None, prep=None, model_name=model_name)


def out(text="t", finish=None, **meta) -> dict:
    return {"text": text, "meta_info": {"finish_reason": finish, **meta}}


def raises_api(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kwargs)
    return e.value


def request_with(headers: dict) -> Request:
    return Request({"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})


async def agen(items):
    for item in items:
        await asyncio.sleep(0)
        if isinstance(item, Exception):
            raise item
        yield item


async def collect(aiter) -> list:
    return [x async for x in aiter]


# Errors -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc, code, err_type, message", [
    (Overloaded("42 in flight"), 503, "server_error", "server overloaded: 42 in flight; retry later"),
    (ServerUnavailable("scheduler died"), 503, "server_error", "server unavailable: scheduler died"),
    (RequestFailed("too slow", 504), 504, "timeout_error", "too slow"),
    (RequestFailed("broke", 500), 500, "server_error", "broke"),
    (TimeoutError(), 504, "timeout_error", "the scheduler did not answer in time"),
    (KeyError("secret detail"), 500, "internal_error", "internal server error"),
])
def test_error_body_maps_each_failure(exc, code, err_type, message):
    assert errors.error_body(exc) == {"message": message, "type": err_type, "code": code}


def test_error_response_is_openai_shaped():
    r = errors.error_response("nope", 404, "not_found_error", "model", headers={"X-A": "1"})
    assert r.status_code == 404 and r.headers["x-a"] == "1"
    assert json.loads(r.body) == {"error": {"message": "nope", "type": "not_found_error", "param": "model", "code": 404}}


def test_preparation_error_keeps_status_and_type():
    timeout = errors.preparation_error(PreparationAborted("took too long", 504))
    gone = errors.preparation_error(PreparationAborted("client disconnected", 499))
    bad = errors.preparation_error(ValueError("prompt too long"))
    assert (timeout.status, timeout.err_type, timeout.message) == (504, "timeout_error", "took too long")
    assert (gone.status, gone.err_type) == (499, "invalid_request_error")
    assert (bad.status, bad.err_type, bad.message) == (400, "invalid_request_error", "prompt too long")


def test_validation_error_fields_names_the_first_field_without_body():
    errs = [{"loc": ("body", "messages", 0, "role"), "msg": "bad role"}, {"loc": ("body", "n"), "msg": "x"}]
    assert errors.validation_error_fields(errs) == ("messages.0.role: bad role", "messages.0.role")
    assert errors.validation_error_fields([]) == ("body: invalid request", None)
    assert errors.validation_error_fields([{"loc": ("body",), "msg": "not a dict"}]) == ("body: not a dict", None)


def test_handlers_answer_with_status_type_and_headers():
    r = asyncio.run(errors.pipeline_error_handler(None, Overloaded("full")))
    assert r.status_code == 503 and r.headers["retry-after"] == str(errors.RETRY_AFTER_S)
    r = asyncio.run(errors.pipeline_error_handler(None, ServerUnavailable("gone")))
    assert r.status_code == 503 and "retry-after" not in r.headers
    r = asyncio.run(errors.http_error_handler(None, StarletteHTTPException(404, "Not Found")))
    assert json.loads(r.body)["error"] == {"message": "Not Found", "type": "not_found_error", "param": None, "code": 404}
    r = asyncio.run(errors.http_error_handler(None, StarletteHTTPException(405, "Method Not Allowed")))
    assert json.loads(r.body)["error"]["type"] == "invalid_request_error"
    r = asyncio.run(errors.validation_error_handler(None, RequestValidationError([{"loc": ("body", "n"), "msg": "too big"}])))
    assert r.status_code == 400 and json.loads(r.body)["error"]["param"] == "n"
    r = asyncio.run(errors.internal_error_handler(None, RuntimeError("secret")))
    assert r.status_code == 500 and b"secret" not in r.body


def test_every_pipeline_failure_has_a_handler():
    for exc_class in (APIError, RequestValidationError, StarletteHTTPException, Overloaded, ServerUnavailable,
                      RequestFailed, TimeoutError, Exception):
        assert exc_class in errors.EXCEPTION_HANDLERS


# Request parsing ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("header", ["", "application/json", "Application/JSON; charset=utf-8", "application/vnd.x+json"])
def test_content_type_accepted(header):
    request_parsing.check_content_type(header)


@pytest.mark.parametrize("header", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"])
def test_content_type_refused_with_415(header):
    err = raises_api(request_parsing.check_content_type, header)
    assert err.status == 415 and header.split(";")[0] in err.message


def test_decode_json_errors():
    assert request_parsing.decode_json(b'{"a": [1, "x"]}') == {"a": [1, "x"]}
    assert raises_api(request_parsing.decode_json, b"\xff\xfe").message == "request body is not valid UTF-8"
    assert raises_api(request_parsing.decode_json, b'{"a": ').message.startswith("request body is not valid JSON: ")
    assert "nested more than 64" in raises_api(request_parsing.decode_json, b"[" * 100000 + b"]" * 100000).message
    assert "lone surrogate" in raises_api(request_parsing.decode_json, b'{"t": "\\ud800"}').message


def test_json_depth_limit_is_exact():
    def nested(depth):
        value = "leaf"
        for _ in range(depth - 1):
            value = [value]
        return value

    request_parsing.check_json_value(nested(request_parsing.MAX_JSON_DEPTH))
    raises_api(request_parsing.check_json_value, nested(request_parsing.MAX_JSON_DEPTH + 1))
    raises_api(request_parsing.check_json_value, {"\udc80key": 1})  # keys are checked too


def test_parse_raises_fastapi_validation_error():
    assert request_parsing.parse(GenerateRequest, {"text": "x"}).text == "x"
    with pytest.raises(RequestValidationError) as e:
        request_parsing.parse(GenerateRequest, {"text": "x", "unknown": 1})
    assert e.value.errors()[0]["loc"] == ("unknown",)


def test_json_body_inlines_definitions():
    extra = request_parsing.json_body(ChatCompletionRequest)
    schema = extra["requestBody"]["content"]["application/json"]["schema"]
    assert extra["requestBody"]["required"] is True
    assert "$ref" not in json.dumps(schema) and "$defs" not in schema
    assert schema["properties"]["messages"]["items"]["properties"]["role"]["enum"][0] == "system"


def test_request_owner_is_a_digest_of_the_credential():
    a, b = request_with({"authorization": "Bearer a"}), request_with({"authorization": "Bearer b"})
    assert request_parsing.request_owner(request_with({})) == ""
    assert len(request_parsing.request_owner(a)) == 32 and "Bearer" not in request_parsing.request_owner(a)
    assert request_parsing.request_owner(a) == request_parsing.request_owner(request_with({"authorization": "Bearer a"}))
    assert request_parsing.request_owner(a) != request_parsing.request_owner(b)


def test_any_model_name_is_served_and_reported_back():
    c = ctx()
    for name in ("gpt-4", "served", "/models/m"):
        assert c.response_model(name) == name
    assert c.response_model(None) == c.response_model("") == "served"


def test_check_count():
    request_parsing.check_count(MAX_PROMPTS_PER_REQUEST)
    assert str(MAX_PROMPTS_PER_REQUEST + 1) in raises_api(request_parsing.check_count, MAX_PROMPTS_PER_REQUEST + 1).message


def test_served_model_name_falls_back_to_the_path():
    assert served_model_name(NS(served_model_name="x", model_path="/p")) == "x"
    assert served_model_name(NS(served_model_name=None, model_path="/p")) == "/p"
    assert served_model_name(NS(served_model_name=None, model_path=None)) == "SmolLM2-135M-Instruct"


def test_served_model_name_aliases():
    assert served_model_names(NS(served_model_name="main, alias-1,,alias-2", model_path="/p")) == ["main", "alias-1", "alias-2"]
    assert served_model_names(NS(served_model_name=" , ", model_path="/p")) == ["/p"]


# SSE ----------------------------------------------------------------------------------------------------------------
def test_sse_event_framing():
    assert streaming.sse_event({"a": 1, "b": "é"}) == 'data: {"a": 1, "b": "\\u00e9"}\n\n'


def test_sse_stream_ends_with_done_or_an_error_event():
    assert asyncio.run(collect(streaming.sse_stream(agen(["x", "y"])))) == ["x", "y", "data: [DONE]\n\n"]
    failed = asyncio.run(collect(streaming.sse_stream(agen(["x", RequestFailed("too slow", 504)]))))
    assert failed == ["x", streaming.sse_event({"error": {"message": "too slow", "type": "timeout_error", "code": 504}}),
                      streaming.SSE_DONE]
    crashed = asyncio.run(collect(streaming.sse_stream(agen([KeyError("secret")]))))
    assert "secret" not in "".join(crashed) and json.loads(crashed[0][6:])["error"]["code"] == 500
    assert crashed[-1] == streaming.SSE_DONE


def test_merge_streams_tags_items_and_propagates_failures():
    merged = asyncio.run(collect(streaming.merge_streams([agen(["a1", "a2"]), agen(["b1"])])))
    assert sorted(merged) == [(0, "a1"), (0, "a2"), (1, "b1")]
    assert [item for i, item in merged if i == 0] == ["a1", "a2"]
    with pytest.raises(RequestFailed):
        asyncio.run(collect(streaming.merge_streams([agen(["a"]), agen([RequestFailed("x", 500)])])))


# OpenAI common ------------------------------------------------------------------------------------------------------
def test_sampling_from_openai_maps_fields():
    req = chat(temperature=0.5, min_tokens=2, stop="END", seed=7, logit_bias={"5": 1}, json_schema={"type": "integer"},
               ignore_eos=True)
    sp = openai_common.sampling_from_openai(req, 9)
    assert sp == {"max_new_tokens": 9, "temperature": 0.5, "min_new_tokens": 2, "seed": 7, "stop": ["END"],
                  "logit_bias": {5: 1.0}, "ignore_eos": True, "skip_special_tokens": True, "no_stop_trim": False,
                  "json_schema": '{"type": "integer"}'}
    assert "max_new_tokens" not in openai_common.sampling_from_openai(chat(), None)


def test_sampling_from_openai_refuses_bad_fields():
    assert raises_api(openai_common.sampling_from_openai, chat(stop=["s"] * 17), None).param == "stop"
    openai_common.sampling_from_openai(chat(stop=["s"] * 16), None)
    assert raises_api(openai_common.sampling_from_openai, chat(logit_bias={"tok": 1}), None).param == "logit_bias"


def test_usage_finish_reason_and_rids():
    outs = [out(prompt_tokens=5, completion_tokens=2, cached_tokens=3), out(prompt_tokens=5, completion_tokens=4)]
    assert openai_common.usage(outs) == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                                         "prompt_tokens_details": {"cached_tokens": 3}}
    assert openai_common.usage(outs, outs)["prompt_tokens"] == 10
    assert [openai_common.finish_reason(out(finish=f)) for f in (None, {"type": "stop"}, {"type": "length"},
                                                                  {"type": "abort"})] == [None, "stop", "length", "abort"]
    assert (openai_common.sample_rid("r", 2, True), openai_common.sample_rid("r", 0, False),
            openai_common.sample_rid(None, 3, True)) == ("r-2", "r", None)


def test_openai_sse_chunks_and_usage():
    header = {"id": "c-1", "object": "x.chunk", "created": 1, "model": "m"}
    streams = [agen([out("a"), out("b", {"type": "stop"}, completion_tokens=2)])]
    events = asyncio.run(collect(openai_common.openai_sse(
        streams, header, lambda i, o: {"index": i, "text": o["text"], "finish_reason": openai_common.finish_reason(o)},
        True, openai_common.usage)))
    chunks = [json.loads(e[len("data: "):]) for e in events]
    assert [list(c) for c in chunks[:2]] == [["id", "object", "created", "model", "choices"]] * 2
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["a", "b"]
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 2
    no_usage = asyncio.run(collect(openai_common.openai_sse([agen([out("a")])], header,
                                                            lambda i, o: {"finish_reason": None}, False, None)))
    assert len(no_usage) == 1


# Chat ---------------------------------------------------------------------------------------------------------------
def test_chat_messages_flatten_parts_and_collect_images():
    req = chat(messages=[{"role": "developer", "content": "sys"},
                         {"role": "user", "content": [{"type": "text", "text": "look: "},
                                                      {"type": "image_url", "image_url": {"url": "http://i/1.png"}},
                                                      {"type": "image", "image": "raw"}]},
                         {"role": "assistant", "tool_calls": [{"id": "t"}]}])
    images: list = []
    assert openai_chat.chat_messages(req, "<img>", images) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "look: <img><img>"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]}]
    assert images == ["http://i/1.png", "raw"]


def test_chat_messages_refuse_images_and_unknown_parts():
    req = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}])
    assert raises_api(openai_chat.chat_messages, req, None, []).message == "this model takes no images"
    req = chat(messages=[{"role": "user", "content": [{"type": "audio"}]}])
    assert "'audio'" in raises_api(openai_chat.chat_messages, req, "<img>", []).message


def test_template_variables_refuse_reserved_names():
    def apply_chat_template(conversation, tools=None, chat_template=None, tokenize=True, **kwargs):
        pass

    reserved = openai_chat.reserved_template_args(apply_chat_template)
    assert reserved == {"conversation", "tools", "chat_template", "tokenize", "messages"}
    assert openai_chat.template_variables(chat(chat_template_kwargs={"enable_thinking": False}), reserved) == \
        {"enable_thinking": False}
    err = raises_api(openai_chat.template_variables, chat(chat_template_kwargs={"tokenize": 1, "chat_template": "x"}),
                     reserved)
    assert err.param == "chat_template_kwargs" and "['chat_template', 'tokenize']" in err.message


def test_response_format_constrains_output():
    assert json.loads(openai_chat.chat_sampling_params(chat(response_format={"type": "json_object"}, regex="a"))
                      ["json_schema"]) == {"type": "object"}
    assert "regex" not in openai_chat.chat_sampling_params(chat(response_format={"type": "json_object"}, regex="a"))
    schema = {"type": "string"}
    sp = openai_chat.chat_sampling_params(chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    assert json.loads(sp["json_schema"]) == schema
    assert openai_chat.chat_sampling_params(chat(response_format={"type": "text"}, regex="a"))["regex"] == "a"
    err = raises_api(openai_chat.chat_sampling_params, chat(response_format={"type": "json_schema", "json_schema": {}}))
    assert err.param == "response_format"


def test_chat_inputs_one_per_sample():
    inputs = openai_chat.chat_inputs(chat(n=2, rid="r", logprobs=True, top_logprobs=3, stream=True), "P", ["img"],
                                     {"temperature": 1.0})
    assert [i["rid"] for i in inputs] == ["r-0", "r-1"]
    assert all(i["text"] == "P" and i["image_data"] == ["img"] and i["add_special_tokens"] is False and i["stream"]
               and i["return_logprob"] and i["top_logprobs_num"] == 3 for i in inputs)
    single = openai_chat.chat_inputs(chat(rid="r"), "P", [], {})
    assert len(single) == 1 and single[0]["rid"] == "r" and single[0]["image_data"] is None


def test_chat_logprobs_from_an_offset():
    o = out(output_token_logprobs=[[-0.5, 65], [-0.25, 66]], output_top_logprobs=[[[-0.5, 65], [-1.0, 7]], [[-0.25, 66]]])
    full = openai_chat.chat_logprobs(o, Tok(), top=2)
    assert full["content"][0] == {"token": "<65>", "logprob": -0.5, "bytes": list(b"<65>"),
                                  "top_logprobs": [{"token": "<65>", "logprob": -0.5, "bytes": list(b"<65>")},
                                                   {"token": "<7>", "logprob": -1.0, "bytes": list(b"<7>")}]}
    assert [e["token"] for e in openai_chat.chat_logprobs(o, Tok(), top=0, start=1)["content"]] == ["<66>"]
    assert openai_chat.chat_logprobs(o, Tok(), top=0)["content"][0]["top_logprobs"] == []


def test_chat_deltas_role_once_and_new_logprobs_only():
    deltas = openai_chat.ChatDeltas(chat(logprobs=True, n=2), Tok(), samples=2)
    first = deltas(1, out("He", output_token_logprobs=[[-1.0, 1]]))
    again = deltas(1, out("llo", {"type": "stop"}, output_token_logprobs=[[-1.0, 1], [-2.0, 2]]))
    same = deltas(1, out("", {"type": "stop"}, output_token_logprobs=[[-1.0, 1], [-2.0, 2]]))
    assert first["delta"] == {"content": "He", "role": "assistant"} and first["index"] == 1
    assert again["delta"] == {"content": "llo"} and again["finish_reason"] == "stop"
    assert [e["token"] for e in again["logprobs"]["content"]] == ["<2>"]
    assert same["logprobs"] is None
    assert deltas(0, out("x"))["delta"]["role"] == "assistant"


def test_chat_choice_shape():
    choice = openai_chat.chat_choice(out("hi", {"type": "length"}), 3, chat(), Tok())
    assert choice == {"index": 3, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                      "finish_reason": "length"}


# Completions --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, expected", [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]),
                                               ([[1], [2, 3]], [[1], [2, 3]])])
def test_completion_prompts(prompt, expected):
    assert openai_completions.completion_prompts(completion(prompt=prompt)) == expected


def test_completion_prompts_refused():
    assert raises_api(openai_completions.completion_prompts, completion(prompt=[])).param == "prompt"
    assert raises_api(openai_completions.completion_prompts, completion(suffix="s")).param == "suffix"
    assert raises_api(openai_completions.completion_prompts, completion(best_of=2)).param == "best_of"
    openai_completions.completion_prompts(completion(best_of=1))


def test_completion_inputs_group_samples_per_prompt():
    req = completion(prompt=["a", "b"], n=2, rid="r", logprobs=0)
    inputs = openai_completions.completion_inputs(req, ["a", [5, 6]], {"temperature": 1.0})
    assert [(i["text"], i["input_ids"], i["rid"]) for i in inputs] == [("a", None, "r-0"), ("a", None, "r-1"),
                                                                     (None, [5, 6], "r-2"), (None, [5, 6], "r-3")]
    assert all(i["return_logprob"] is True and i["top_logprobs_num"] == 0 for i in inputs)
    one = openai_completions.completion_inputs(completion(rid="r"), ["a"], {})
    assert one[0]["rid"] == "r" and one[0]["return_logprob"] is False


def test_echo_texts_and_completion_usage():
    req = completion(prompt=["a", "b"], n=2, echo=True)
    assert openai_completions.echo_texts(req, ["a", [5]], Tok().decode) == ["a", "a", "<5>", "<5>"]
    assert openai_completions.echo_texts(completion(n=2), ["a"], Tok().decode) == ["", ""]
    outs = [out(prompt_tokens=p, completion_tokens=1) for p in (3, 3, 4, 4)]
    assert openai_completions.completion_usage(outs, 2)["prompt_tokens"] == 7  # each prompt once, not per sample


def test_completion_logprobs_and_deltas():
    o = out("x", output_token_logprobs=[[-0.5, 1], [-0.25, 2]], output_top_logprobs=[[[-0.5, 1]], [[-0.25, 2]]])
    assert openai_completions.completion_logprobs(o, Tok(), start=1) == {
        "tokens": ["<2>"], "token_logprobs": [-0.25], "top_logprobs": [{"<2>": -0.25}], "text_offset": []}
    assert openai_completions.completion_logprobs(out(output_token_logprobs=[[-1.0, 3]]), Tok())["top_logprobs"] is None
    deltas = openai_completions.CompletionDeltas(completion(echo=True, logprobs=1), Tok(), ["P:"])
    first, second = deltas(0, out("a", output_token_logprobs=[[-1.0, 1]])), deltas(0, o)
    assert (first["text"], second["text"]) == ("P:a", "x")
    assert first["logprobs"]["tokens"] == ["<1>"] and second["logprobs"]["tokens"] == ["<2>"]
    assert openai_completions.CompletionDeltas(completion(), Tok(), [""])(0, out("a"))["logprobs"] is None


# Native /generate ---------------------------------------------------------------------------------------------------
def test_prompt_items_single_and_batch():
    assert native_api.prompt_items(gen(text="a")) == (False, ["a"])
    assert native_api.prompt_items(gen(text=["a", "b"])) == (True, ["a", "b"])
    assert native_api.prompt_items(gen(input_ids=[1, 2])) == (False, [[1, 2]])
    assert native_api.prompt_items(gen(input_ids=[[1], [2]])) == (True, [[1], [2]])
    assert raises_api(native_api.prompt_items, gen(text=[])).message == "empty batch"


def test_per_prompt_values():
    assert native_api.per_prompt(0.5, "x", True, 3) == [0.5] * 3
    assert native_api.per_prompt([1, 2], "x", True, 2) == [1, 2]
    assert raises_api(native_api.per_prompt, [1], "rid", False, 1).message == "rid is a list but the request has one prompt"
    assert raises_api(native_api.per_prompt, [1], "rid", True, 2).message == "rid has 1 entries for 2 prompts"


def test_generate_plan_checks_in_order():
    assert raises_api(native_api.generate_plan, gen(text="a", background=True)).param == "background"
    assert native_api.generate_plan(gen(text="a", model="other")).inputs[0]["text"] == "a"  # any model name
    assert raises_api(native_api.generate_plan, gen()).message == "give exactly one of text or input_ids"
    assert raises_api(native_api.generate_plan, gen(text=["a", "b"], rid=["r", "r"])).param == "rid"
    assert raises_api(native_api.generate_plan, gen(text=["a", "b"], stream=True)).message == \
        "stream=true takes a single prompt"
    err = raises_api(native_api.generate_plan, gen(text=["a", "b"], sampling_params=[{"n": 2}, {"n": 3}]))
    assert err.param == "n" and "same for every prompt" in err.message
    assert "asks for" in raises_api(native_api.generate_plan, gen(text="a", sampling_params={"n": MAX_PROMPTS_PER_REQUEST + 1})).message


def test_generate_plan_expands_samples_per_prompt():
    plan = native_api.generate_plan(gen(text=["a", "b"], rid=["x", "y"], sampling_params={"n": 2, "temperature": 1.0},
                                        return_logprob=[True, False], image_data=["i1", "i2"]))
    assert plan.is_batch and plan.n_samples == 2 and plan.returns_list
    assert [(i["text"], i["rid"], i["return_logprob"], i["image_data"]) for i in plan.inputs] == [
        ("a", "x-0", True, "i1"), ("a", "x-1", True, "i1"), ("b", "y-0", False, "i2"), ("b", "y-1", False, "i2")]
    assert all("n" not in i["sampling_params"] and i["sampling_params"]["temperature"] == 1.0 for i in plan.inputs)
    single = native_api.generate_plan(gen(input_ids=[1, 2], rid="r", image_data=["u1", "u2"]))
    assert not single.returns_list and single.inputs[0]["input_ids"] == [1, 2] and single.inputs[0]["rid"] == "r"
    assert single.inputs[0]["image_data"] == ["u1", "u2"]  # one prompt: a list of images, not one per prompt


def test_format_logprobs_in_place():
    o = out(input_token_logprobs=[[None, 1]], output_token_logprobs=[[-0.5, 2]], output_top_logprobs=[None, [[-0.5, 2]]])
    assert native_api.format_logprobs(o, Tok(), with_text=True)["meta_info"] == {
        "finish_reason": None, "input_token_logprobs": [[None, 1, "<1>"]], "output_token_logprobs": [[-0.5, 2, "<2>"]],
        "output_top_logprobs": [None, [[-0.5, 2, "<2>"]]]}
    assert native_api.format_logprobs(out(output_token_logprobs=[[-0.5, 2]]), Tok(), False)["meta_info"][
        "output_token_logprobs"] == [[-0.5, 2, None]]


# Operations and middleware ------------------------------------------------------------------------------------------
def test_load_from_stats():
    stats = {"num_running": 1, "num_waiting": 2, "max_total_num_tokens": 100, "free_tokens": 50, "evictable_tokens": 10,
             "cache_hit_rate": 0.5}
    assert operations.load_from_stats(stats) == {"num_running_reqs": 1, "num_waiting_reqs": 2, "num_reqs": 3,
                                                 "num_tokens": 40, "token_usage": pytest.approx(0.4),
                                                 "cache_hit_rate": 0.5}


def test_string_field_and_health():
    assert operations.string_field({"rid": "x"}, "rid", "m") == "x"
    for data in ({"rid": 1}, ["rid"], None):
        assert raises_api(operations.string_field, data, "rid", "give rid").message == "give rid"
    assert operations.unhealthy_response(NS(healthy=True)) is None
    r = operations.unhealthy_response(NS(healthy=False, dead_reason="scheduler exited"))
    assert r.status_code == 503 and json.loads(r.body)["error"]["message"] == "unhealthy: scheduler exited"


def test_middleware_checks():
    limit = BodySizeLimitMiddleware(None, max_bytes=10)
    assert limit.declared_length_error(None) is None and limit.declared_length_error(b"10") is None
    assert limit.declared_length_error(b"11").status == 413
    assert limit.declared_length_error(b"-1").message == "invalid Content-Length header"
    keys = APIKeyMiddleware(None, api_key="k1, k2,")
    assert keys.allowed(b"Bearer k1") and keys.allowed(b"Bearer k2")
    assert not keys.allowed(b"Bearer k3") and not keys.allowed(b"k1") and not keys.allowed(b"")


def test_each_api_family_registers_its_routes():
    expected = {native_api: {"/generate"}, openai_chat: {"/v1/chat/completions"},
                openai_completions: {"/v1/completions"}, openai_embeddings: {"/v1/embeddings"},
                openai_responses: {"/v1/responses", "/v1/responses/{response_id}"},
                ollama_api: {"/", "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show",
                             "/api/tags", "/api/ps", "/api/version"},
                operations: {"/tokenize", "/v1/models", "/health", "/health_generate", "/model_info", "/get_model_info",
                             "/server_info", "/get_server_info", "/get_load", "/v1/loads", "/get_stats", "/flush_cache",
                             "/abort_request", "/end_session", "/check_pool", "/metrics"}}
    assert set(http_server.API_FAMILIES) == set(expected)
    for family, paths in expected.items():
        app = FastAPI()
        family.register(app)
        assert {r.path for r in app.routes} - {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"} == paths
