"""benchmarks/programs/langgraph_flow.py: the LangGraph multi-agent flow the benchmark runs (with a fake chat model,
no server)."""

from __future__ import annotations

import pytest
from langchain_core.language_models import FakeListChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.runnables import ensure_config

from benchmarks.programs import langgraph_flow


class RecordingModel(FakeListChatModel):
    """FakeListChatModel that records each call's messages and the LangGraph thread its config names."""

    calls: list = []

    def _call(self, messages, *args, **kwargs):
        thread_id = (ensure_config().get("configurable") or {}).get("thread_id")
        self.calls.append(([(type(m).__name__, m.content) for m in messages], thread_id))
        return super()._call(messages, *args, **kwargs)


@pytest.fixture
def graph_of():
    pytest.importorskip("langgraph")  # the bench extra; the argument tests below need no LangGraph

    def make(cycles: int):
        llm = RecordingModel(responses=[f"reply {k}" for k in range(3 * cycles + 1)], calls=[])
        slept = []
        return llm, slept, langgraph_flow.build_graph(llm, cycles, (0.1, 0.2), 5, sleep=slept.append)

    return make


def test_graph_calls_each_agent_in_order_and_every_call_resends_the_history(graph_of):
    llm, slept, graph = graph_of(2)
    out = graph.invoke(langgraph_flow.start_state(3, 20), langgraph_flow.run_config(3, 2))
    order = [msgs[-1][1].split(":")[0] for msgs, _ in llm.calls]
    assert order == ["Supervisor", "Researcher", "Writer"] * 2 + ["Supervisor"]  # 3 * cycles + 1 calls
    assert len(slept) == 2 and all(0.1 <= s <= 0.2 for s in slept)  # one seeded search per cycle
    # each call carries the whole history so far (system, task, every earlier reply and search result) plus its
    # own instruction as the last turn, which does not stay in the history
    history = [(type(m).__name__, m.content) for m in out["messages"]]
    assert history[0] == ("SystemMessage", langgraph_flow.SYSTEM) and history[1][1].startswith("Run 3. Task: ")
    assert len(history) == 2 + 7 + 2 and out["cycle"] == 3
    for k, (msgs, _) in enumerate(llm.calls):
        assert msgs[:-1] == history[:len(msgs) - 1] and msgs[-1][0] == "HumanMessage"
        assert sum(m[0] == "AIMessage" for m in msgs) == k  # every earlier reply
    assert [m[1] for m in history if m[0] == "AIMessage"] == [f"reply {k}" for k in range(7)]
    assert sum(m[1].startswith("Search result: ") for m in history[2:] if m[0] == "HumanMessage") == 2
    assert len(llm.calls[-1][0]) == len(history)  # the last call re-sent all of it but its own reply


def test_thread_id_reaches_the_model_config_and_search_is_seeded(graph_of):
    llm, slept, graph = graph_of(1)
    graph.invoke(langgraph_flow.start_state(5, 10), langgraph_flow.run_config(5, 1))
    assert [t for _, t in llm.calls] == ["run-5"] * 4
    llm2, slept2, graph2 = graph_of(1)
    graph2.invoke(langgraph_flow.start_state(5, 10), langgraph_flow.run_config(5, 1))
    assert slept2 == slept and llm2.calls == llm.calls  # the same run is the same program on every route


def test_runs_differ_in_task_but_share_the_system_prompt():
    a, b = langgraph_flow.start_state(0, 50), langgraph_flow.start_state(1, 50)
    assert isinstance(a["messages"][0], SystemMessage) and a["messages"][0] == b["messages"][0]
    assert isinstance(a["messages"][1], HumanMessage) and a["messages"][1].content != b["messages"][1].content
    assert len(a["messages"][1].content.split()) == 3 + 50 and a == langgraph_flow.start_state(0, 50)
    assert not any(isinstance(m, AIMessage) for m in a["messages"])


def test_bad_arguments_error():
    assert set(langgraph_flow.ROUTES) == {"sglang", "sglang_no_tier", "sglang_no_programs", "sglang_radix_only", "openai"}
    for argv in (["--routes", "nope"], ["--routes", ""], ["--runs", "0"], ["--cycles", "0"], ["--rounds", "0"],
                 ["--max-tokens", "0"]):
        with pytest.raises(SystemExit):
            langgraph_flow.main(argv)
    with pytest.raises(ValueError, match="cycles"):
        langgraph_flow.build_graph(FakeListChatModel(responses=["x"]), 0)
    with pytest.raises(ValueError, match="tool_s"):
        langgraph_flow.build_graph(FakeListChatModel(responses=["x"]), 1, (0.5, 0.1))


def test_p99_is_nearest_rank():
    assert langgraph_flow.p99([1.0]) == 1.0
    assert langgraph_flow.p99([float(k) for k in range(1, 9)]) == 8.0
    assert langgraph_flow.p99([float(k) for k in range(1, 201)]) == 198.0
