"""ChatSGLang sends a session id without user code: a LangGraph-style ``configurable.thread_id`` of the enclosing
runnable (or the model's / the call's ``session_id``); the engine or server pins the call's KV for the next one."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")

from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_sglang import ChatSGLang, register_engine, unregister_engine  # noqa: E402

PROMPT = ChatPromptTemplate.from_messages([("system", "Answer briefly."), ("human", "{q}")])


@pytest.fixture
def engine_llm(smollm_engine):
    register_engine(smollm_engine)
    yield ChatSGLang(temperature=0, max_tokens=4)
    unregister_engine()


def taken(engine) -> int:
    """Pins taken since start: a counter (a count of pins held would move as other tests' pins expire)."""
    return engine.get_stats()["session_pins_taken"]


def test_thread_id_of_the_enclosing_runnable_is_the_session(engine_llm, smollm_engine):
    chain = PROMPT | engine_llm | StrOutputParser()
    before = taken(smollm_engine)
    chain.invoke({"q": "Name a colour."}, config={"configurable": {"thread_id": "t-1"}})
    assert taken(smollm_engine) == before + 1 and "lc-thread:t-1" in smollm_engine.scheduler.session_pins.pins
    chain.invoke({"q": "Name a fruit."})  # no thread, no session: nothing more is pinned
    assert taken(smollm_engine) == before + 1
    assert smollm_engine.end_session("lc-thread:t-1") is True


def test_call_and_model_session_ids(engine_llm, smollm_engine):
    before = smollm_engine.get_stats()["session_pins_taken"]
    engine_llm.invoke("Say hi.", session_id="call-s")
    list(engine_llm.stream("Say hi again.", session_id="call-s"))
    ChatSGLang(temperature=0, max_tokens=4, session_id="model-s").invoke("Say bye.")
    assert smollm_engine.get_stats()["session_pins_taken"] == before + 3
    assert smollm_engine.end_session("call-s") is True and smollm_engine.end_session("model-s") is True


def test_session_id_over_the_server(server):
    llm = ChatSGLang(base_url=server.url, api_key=server.api_key, temperature=0, max_tokens=4, max_retries=1,
                     timeout=120)
    with server.client() as http:
        before = http.get("/get_stats").json()["session_pins_taken"]
        (PROMPT | llm).invoke({"q": "Name a colour."}, config={"configurable": {"thread_id": "srv-t"}})
        assert http.get("/get_stats").json()["session_pins_taken"] == before + 1
        assert http.post("/end_session", json={"session_id": "lc-thread:srv-t"}).json()["released"] is True
