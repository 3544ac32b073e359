"""LangChain ``ChatSGLang``: LangChain's standard unit + integration suites, plus our runtime-specific checks.

* ``TestChatSGLangUnit`` — ``langchain_tests.unit_tests.ChatModelUnitTests`` (no model needed).
* ``TestChatSGLangIntegration`` — ``langchain_tests.integration_tests.ChatModelIntegrationTests`` against the
  embedded SmolLM2-135M-Instruct run in-process (the session ``smollm_engine``, so the KV pool is checked whole
  after every test), with tool calling, tool choice, structured output and JSON mode enabled.
* Server transport (the ``server`` fixture): invoke/stream/async/tool call/structured output over HTTP, and a
  ``RunnableParallel`` of 4 branches over one prompt whose cached tokens show the shared prefix prefilled once.

The standard suites have async tests; pytest-asyncio runs them in strict mode through the marks added below
(so no global ``asyncio_mode=auto`` is needed).
"""

from __future__ import annotations

import inspect
import json
import os
import uuid

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")
pytest.importorskip("pytest_asyncio")

from langchain_core.load import dumpd, load  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser, StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableParallel  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from langchain_sglang import ChatSGLang, register_engine, unregister_engine  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"


def mark_async_tests(cls):
    """pytest-asyncio (strict mode) runs only marked coroutines: mark the suite's async tests."""
    for name in dir(cls):
        if name.startswith("test_"):
            fn = getattr(cls, name)
            if inspect.iscoroutinefunction(fn):
                setattr(cls, name, pytest.mark.asyncio(fn))
    return cls


def _serdes_roundtrip(model: ChatSGLang) -> None:
    ser = dumpd(model)
    assert ser["id"] == ["langchain_sglang", "chat_models", "ChatSGLang"]
    assert "api_key" not in json.dumps(ser) or ser["kwargs"]["api_key"]["type"] == "secret"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_API_KEY", "test")
        back = load(ser, valid_namespaces=["langchain_sglang"], allowed_objects=[ChatSGLang],
                    secrets_from_env=True)
    assert isinstance(back, ChatSGLang)
    assert back.model_dump() == model.model_dump()


# Standard unit tests -----------------------------------------------------------------------------------------------
@mark_async_tests
class TestChatSGLangUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict:
        return {"model": MODEL_NAME, "base_url": "http://127.0.0.1:30000"}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        return "other-model"

    @property
    def init_from_env_params(self):
        return ({"SGLANG_API_KEY": "env-key", "SGLANG_BASE_URL": "http://127.0.0.1:30001"}, {"model": MODEL_NAME},
                {"api_key": "env-key", "base_url": "http://127.0.0.1:30001"})

    @pytest.mark.xfail(reason="langchain-core's load(allowed_objects='all') admits only classes in its own "
                              "partner mapping (langchain_core.load.mapping), which a third-party package cannot "
                              "join, and the standard test also needs a syrupy snapshot file; the same round trip "
                              "with allowed_objects=[ChatSGLang] is test_serdes_roundtrip", strict=True)
    def test_serdes(self, model, snapshot) -> None:  # type: ignore[override]
        super().test_serdes(model, snapshot)

    def test_serdes_roundtrip(self, model) -> None:
        _serdes_roundtrip(model)


# Standard integration tests (in-process engine) --------------------------------------------------------------------
SKIP_135M = "beyond SmolLM2-135M: "


@mark_async_tests
class TestChatSGLangIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _engine(self, smollm_engine):
        register_engine(smollm_engine)
        yield
        unregister_engine()

    @property
    def chat_model_class(self):
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict:
        # Short answers keep the suite fast on CPU; constrained calls get their own budget (>= 256 tokens).
        # temperature 0: the integration suite's standard_chat_model_params is {} (unlike the unit suite's
        # temperature=0), so without it every request samples at the runtime default temperature 1.0 from the
        # global torch RNG, and e.g. test_tool_calling's forced call sometimes drew {"input": 100} instead of 3.
        return {"model": MODEL_NAME, "base_url": None, "max_tokens": 24, "constrained_max_string_length": 40,
                "temperature": 0}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @property
    def model_override_value(self) -> str:
        return "smollm2-override"

    @property
    def enable_vcr_tests(self) -> bool:
        return False

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The same long prompt twice: the second request reads its prefix from the radix cache."""
        llm = ChatSGLang(**{**self.standard_chat_model_params, **self.chat_model_params, "max_tokens": 4})
        prompt = f"[{uuid.uuid4().hex}] " + "Remember this sentence about caching. " * 10 + "Say OK."
        llm.invoke(prompt)
        if not stream:
            msg = llm.invoke(prompt)
        else:
            msg = None
            for chunk in llm.stream(prompt):
                msg = chunk if msg is None else msg + chunk
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg

    @pytest.mark.xfail(reason=SKIP_135M + "with tools bound and no tool_choice ('auto'), SmolLM2-135M answers in "
                              "text instead of choosing to call get_weather (forced calls are covered by "
                              "test_tool_calling / test_tool_choice)", run=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:  # type: ignore[override]
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=SKIP_135M + "the constrained call is always valid JSON, but SmolLM2-135M does not "
                              "copy the requested Japanese text into the argument (and the attempt takes ~45 s "
                              "on CPU, so it is not run)", run=False)
    def test_unicode_tool_call_integration(self, model, *, tool_choice=None,  # type: ignore[override]
                                           force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)


# Our own checks ----------------------------------------------------------------------------------------------------
@pytest.fixture
def engine_llm(smollm_engine):
    register_engine(smollm_engine)
    yield ChatSGLang(model=MODEL_NAME, temperature=0, max_tokens=16, constrained_max_string_length=40)
    unregister_engine()


def test_chain_prompt_model_parser(engine_llm):
    prompt = ChatPromptTemplate.from_messages([("system", "Answer with one word."),
                                               ("human", "What is the capital of {country}?")])
    chain = prompt | engine_llm | StrOutputParser()
    assert "Paris" in chain.invoke({"country": "France"})
    outs = chain.batch([{"country": "France"}, {"country": "Italy"}])
    assert "Paris" in outs[0] and "Rome" in outs[1]


class Review(BaseModel):
    """A short product review."""
    product: str = Field(description="what is reviewed")
    stars: int = Field(description="1 to 5")
    pros: list[str]
    recommended: bool


def test_output_parser_downstream_always_parses(smollm_engine):
    """``prompt | llm | PydanticOutputParser``, plain LangChain (no structured-output call): the parser's format
    instructions in the prompt become the generation constraint, so 50 samples at temperature 1 all parse."""
    register_engine(smollm_engine)
    try:
        parser = PydanticOutputParser(pydantic_object=Review)
        prompt = ChatPromptTemplate.from_messages([
            ("system", "Answer the user query.\n{format_instructions}"),
            ("human", "Review {product} for me.")]).partial(format_instructions=parser.get_format_instructions())
        llm = ChatSGLang(model=MODEL_NAME, temperature=1.0, max_tokens=16, constrained_max_string_length=24)
        products = ["a kettle", "a bicycle", "a laptop", "running shoes", "a tent"] * 10
        reviews = (prompt | llm | parser).batch([{"product": p} for p in products])
        assert len(reviews) == 50 and all(isinstance(r, Review) for r in reviews)
        assert len({r.model_dump_json() for r in reviews}) > 10  # sampled, not one answer repeated

        # JsonOutputParser with a model: the same instructions; a later free-text turn is not constrained.
        json_parser = JsonOutputParser(pydantic_object=Review)
        asked = [("system", json_parser.get_format_instructions()), ("human", "Review a lamp.")]
        assert set((llm | json_parser).invoke(asked)) == {"product", "stars", "pros", "recommended"}
        later = [HumanMessage("Review a lamp.\n" + parser.get_format_instructions()), AIMessage("{}"),
                 HumanMessage("Now say hello.")]
        assert "json_schema" not in llm._prepare(later, None).sampling
        bare = [HumanMessage("Review a lamp. " + JsonOutputParser().get_format_instructions())]
        assert json.loads(llm._prepare(bare, None).sampling["json_schema"]) == {"type": "object"}
        assert "json_schema" not in llm.model_copy(update={"constrain_format_instructions": False})._prepare(
            later[:1], None).sampling
    finally:
        unregister_engine()


def check_choices(result, n: int, top: int) -> None:
    """``n`` completions, each with one OpenAI-shaped logprob entry per token that spells its text."""
    gens = result.generations[0]
    assert len(gens) == n
    for g in gens:
        content = g.message.response_metadata["logprobs"]["content"]
        assert content and all(e["logprob"] <= 0 and len(e["top_logprobs"]) == top for e in content)
        assert b"".join(bytes(e["bytes"]) for e in content).decode() == g.message.content


def test_n_and_logprobs_in_process(engine_llm):
    llm = engine_llm.model_copy(update={"n": 3, "temperature": 1.0, "logprobs": True, "top_logprobs": 2})
    check_choices(llm.generate([[HumanMessage("Name a color.")]]), 3, 2)
    one = engine_llm.invoke("Name a color.", logprobs=True)  # bound per call, as ChatOpenAI takes it
    assert one.response_metadata["logprobs"]["content"][0]["top_logprobs"] == []
    with pytest.raises(ValueError, match="n must be 1 when streaming"):
        list(llm.stream("Name a color."))


def test_batch_sends_common_prefix_first(engine_llm, smollm_engine):
    system = f"[{uuid.uuid4().hex}] " + "You are a careful geography assistant. " * 12
    inputs = [[("system", system), ("human", f"Capital of {c}?")] for c in ("France", "Spain", "Italy")]
    outs = engine_llm.batch(inputs)
    shared = len(smollm_engine.tokenizer.encode(system))
    for out in outs:  # every branch found the hinted prefix in the radix cache
        assert out.usage_metadata["input_token_details"]["cache_read"] >= shared


def test_tool_call_forced_and_structured_output_in_process(engine_llm):
    @tool
    def get_weather(city: str) -> str:
        """Get the weather of a city."""
        return "sunny"

    msg = engine_llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)
    assert msg.response_metadata["finish_reason"] == "tool_calls"

    class Person(BaseModel):
        """A person."""
        name: str = Field(description="first name")
        age: int

    for method in ("json_schema", "function_calling", "json_mode"):
        p = engine_llm.with_structured_output(Person, method=method).invoke("Alice is 30 years old. Extract her.")
        assert isinstance(p, Person)
    raw = engine_llm.with_structured_output(Person, include_raw=True).invoke("Bob is 41.")
    assert isinstance(raw["raw"], AIMessage) and isinstance(raw["parsed"], Person) and raw["parsing_error"] is None


def test_forced_tool_call_greedy_is_reproducible(engine_llm, smollm_engine):
    """The standard test_tool_calling request at temperature 0 gives the same call cold and with the radix cache
    warm from the same and from other tool prompts (its flakiness was sampling at the default temperature 1.0:
    under the mask '3' has p=0.85 after ' : ', so 100/123/250 were legitimate draws, not a cache bug)."""
    @tool
    def magic_function(input: int) -> int:
        """Apply a magic function to an input."""
        return input + 2

    query = "What is the value of magic_function(3)? Use the tool."
    llm = engine_llm.bind_tools([magic_function], tool_choice="any")
    first = llm.invoke(query)
    engine_llm.bind_tools([magic_function], tool_choice="any").invoke("What is magic_function(7)? Use the tool.")
    calls = [first, llm.invoke(query), *llm.batch([query, query])]
    assert all(c.tool_calls[0]["args"] == {"input": 3} for c in calls), [c.tool_calls for c in calls]
    assert {c.content for c in calls} == {first.content}
    assert calls[1].usage_metadata["input_token_details"]["cache_read"] > 0


# Server transport --------------------------------------------------------------------------------------------------
@pytest.fixture
def server_llm(server):
    return ChatSGLang(base_url=server.url, api_key=server.api_key, temperature=0, max_tokens=16,
                      constrained_max_string_length=40, max_retries=1, timeout=120)


def test_server_invoke_stream_usage(server_llm):
    msg = server_llm.invoke("What is the capital of France? One word.")
    assert "Paris" in msg.content
    assert msg.usage_metadata["input_tokens"] > 0 and msg.usage_metadata["output_tokens"] > 0
    assert "cache_read" in msg.usage_metadata["input_token_details"]
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    chunks = list(server_llm.stream("What is the capital of France? One word."))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == msg.content  # greedy: same text streamed or not
    assert full.usage_metadata["output_tokens"] == msg.usage_metadata["output_tokens"]
    stopped = server_llm.invoke("Count: 1, 2, 3, 4, 5, 6", stop=[","], max_tokens=8)
    assert "," not in stopped.content


@pytest.mark.asyncio
async def test_server_async_tools_structured(server_llm):
    @tool
    def add(a: int, b: int) -> int:
        """Adds a and b."""
        return a + b

    msg = await server_llm.bind_tools([add], tool_choice="any").ainvoke("What is 2 + 3?")
    assert msg.tool_calls[0]["name"] == "add" and set(msg.tool_calls[0]["args"]) == {"a", "b"}

    class City(BaseModel):
        name: str
        country: str

    city = await server_llm.with_structured_output(City).ainvoke("Paris is in France. Extract the city.")
    assert isinstance(city, City)
    outs = await server_llm.abatch(["Say A.", "Say B."])
    assert len(outs) == 2
    pieces = [c.content async for c in server_llm.astream("Say hello.")]
    assert "".join(pieces)


def test_n_and_logprobs_over_the_server_match_chat_openai(server, server_llm):
    llm = server_llm.model_copy(update={"n": 2, "temperature": 1.0, "logprobs": True, "top_logprobs": 3})
    check_choices(llm.generate([[HumanMessage("Name a color.")]]), 2, 3)
    openai_llm = pytest.importorskip("langchain_openai").ChatOpenAI(
        base_url=server.url + "/v1", api_key=server.api_key, model="any", temperature=0, max_tokens=16)
    ours = server_llm.invoke("Name a color.", logprobs=True, top_logprobs=2).response_metadata["logprobs"]
    theirs = openai_llm.invoke("Name a color.", logprobs=True, top_logprobs=2).response_metadata["logprobs"]
    assert [e["token"] for e in ours["content"]] == [e["token"] for e in theirs["content"]]
    assert ours["content"][0]["top_logprobs"] == theirs["content"][0]["top_logprobs"]


def test_runnable_parallel_branches_share_prefix(server, server_llm):
    """4 branches over one prompt: the long shared prompt is prefilled once and the other branches read it
    from the radix cache (concurrent arrivals are deduplicated by the scheduler)."""
    nonce = uuid.uuid4().hex
    system = f"[{nonce}] You are a helpful assistant who knows world geography well. " * 8
    prompt = ChatPromptTemplate.from_messages([("system", system), ("human", "Name a city in {country}.")])
    branches = RunnableParallel(**{f"b{i}": server_llm.bind(seed=i, temperature=0.7, max_tokens=6)
                                   for i in range(4)})
    outs = (prompt | branches).invoke({"country": "France"})
    usages = [outs[f"b{i}"].usage_metadata for i in range(4)]
    inp = usages[0]["input_tokens"]
    assert all(u["input_tokens"] == inp for u in usages)
    cached = sorted(u["input_token_details"]["cache_read"] for u in usages)
    prefilled = sum(inp - c for c in cached)
    # Once: one branch computes (almost) the whole prompt; the other three reuse all but a few tokens.
    assert all(c >= inp - 8 for c in cached[1:]), cached
    assert prefilled < inp + 3 * 8, (prefilled, inp, cached)
