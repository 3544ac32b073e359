"""Unmodified LangGraph multi-agent flows under memory pressure (issue 26): the same plain LangGraph program through
each route to a server whose KV pool is too small for all the runs' histories.

The program (``build_graph``) is an ordinary LangGraph ``StateGraph`` over a shared message history: supervisor ->
researcher -> search tool -> writer -> supervisor ..., ``cycles`` times, then a last supervisor call (3 * cycles +
1 model calls). Every agent node calls the chat model with the whole history so far plus its own instruction as the
last turn, and appends its reply to the history; the tool node sleeps (a seeded draw from ``--tool-s``) and appends
a search result. Routing follows a cycle counter, never the model's text (the embedded SmolLM2-135M writes
gibberish). ``runs`` graph runs go at once, one thread each, each on its own LangGraph thread
(``configurable.thread_id``) and with its own long task text. Routes, each on a fresh server with the same pool
(``--pool-tokens``), run in turn (order rotating each round):

* ``sglang``: ``ChatSGLang(base_url=...)`` on a server with the host KV tier (``--kv-host-size``) and session pins
  on: everything on (the adapter sends the run's ``thread_id`` as its session id without user code);
* ``sglang_no_tier``: ``ChatSGLang`` on a server without the tier (pins on): the tier's share;
* ``sglang_no_programs``: everything on but program-level scheduling (``--program-scheduling off``): its share;
* ``sglang_radix_only``: ``ChatSGLang`` on a server with the radix cache alone (``--session-ttl 0``,
  ``--program-scheduling off``, no tier: the server ignores the session ids the adapter sends);
* ``openai``: ``langchain_openai.ChatOpenAI(base_url=<server>/v1)`` on a server with the radix cache alone: the
  route a LangGraph user takes to any OpenAI-compatible engine with prefix caching.

Reported per route (medians over rounds): graph run completion time p50, p99 (nearest rank: the slowest run while
``runs`` < 100) and max, all runs' wall time and programs/s, model calls, the server's prompt / cached / computed
prompt tokens over the run (``/get_stats``), KV loaded from the host.

    python -m benchmarks.programs.langgraph_flow --out benchmarks/results/programs_langgraph_cpu.json
"""

from __future__ import annotations

import math
import operator
import random
import time
from typing import Annotated, Any, Callable, TypedDict

from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage

from benchmarks.programs.dspy_agents import add_agent_args, chosen_routes, route_parser, run_route, run_rounds, words

ROUTES = {  # name: (client, server flags); None: --host-tokens
    "sglang": ("sglang", ["--kv-host-size", None]),
    "sglang_no_tier": ("sglang", []),
    "sglang_no_programs": ("sglang", ["--kv-host-size", None, "--program-scheduling", "off"]),
    "sglang_radix_only": ("sglang", ["--session-ttl", "0", "--program-scheduling", "off"]),
    "openai": ("openai", ["--session-ttl", "0"]),
}
SYSTEM = ("A research team answers one task together: a supervisor steers, a researcher looks facts up with the "
          "search tool, a writer drafts the answer. Everyone sees the whole conversation.")
INSTRUCTIONS = {
    "supervisor": "Supervisor: review the work so far and say in one sentence what the team should do next.",
    "researcher": "Researcher: name the one fact to look up next with the search tool.",
    "writer": "Writer: improve the draft answer with the latest search result.",
}


class FlowState(TypedDict):
    messages: Annotated[list[AnyMessage], operator.add]  # the shared history every agent re-sends
    run: int
    cycle: int


def make_nodes(llm, tool_s: tuple[float, float], obs_words: int,
               sleep: Callable[[float], None] = time.sleep) -> dict[str, Callable]:
    """The graph's nodes: plain functions of the state, as LangGraph programs write them."""

    def agent(name: str, next_cycle: bool = False):
        def node(state: FlowState) -> dict:
            reply = llm.invoke([*state["messages"], HumanMessage(INSTRUCTIONS[name])])
            return {"messages": [reply], **({"cycle": state["cycle"] + 1} if next_cycle else {})}

        return node

    def search(state: FlowState) -> dict:
        rng = random.Random(f"{state['run']}:{state['cycle']}")  # seeded per run and cycle: every route alike
        sleep(rng.uniform(*tool_s))
        return {"messages": [HumanMessage(f"Search result: {words(rng, obs_words)}")]}

    return {"supervisor": agent("supervisor", next_cycle=True), "researcher": agent("researcher"), "search": search,
            "writer": agent("writer")}


def build_graph(llm, cycles: int, tool_s: tuple[float, float] = (0.2, 0.6), obs_words: int = 40,
                sleep: Callable[[float], None] = time.sleep):
    """The compiled LangGraph flow (see the module docstring)."""
    if cycles < 1:
        raise ValueError(f"cycles must be >= 1 (got {cycles})")
    if not 0 <= tool_s[0] <= tool_s[1]:
        raise ValueError(f"tool_s must be 0 <= MIN <= MAX (got {tool_s})")
    from langgraph.graph import END, START, StateGraph  # deferred: --help without LangGraph

    graph = StateGraph(FlowState)
    for name, node in make_nodes(llm, tool_s, obs_words, sleep).items():
        graph.add_node(name, node)
    graph.add_edge(START, "supervisor")
    graph.add_conditional_edges("supervisor", lambda s: "researcher" if s["cycle"] <= cycles else END,
                                ["researcher", END])
    graph.add_edge("researcher", "search")
    graph.add_edge("search", "writer")
    graph.add_edge("writer", "supervisor")
    return graph.compile()


def start_state(i: int, task_words: int) -> dict:
    """Run ``i``'s input: the shared system prompt and its own long task."""
    rng = random.Random(1000 + i)
    return {"messages": [SystemMessage(SYSTEM), HumanMessage(f"Run {i}. Task: {words(rng, task_words)}")],
            "run": i, "cycle": 0}


def run_config(i: int, cycles: int) -> dict[str, Any]:
    return {"configurable": {"thread_id": f"run-{i}"}, "recursion_limit": 4 * cycles + 10}


def make_llm(kind: str, url: str, key: str, model_id: str, max_tokens: int):
    if kind == "sglang":
        from langchain_sglang import ChatSGLang

        return ChatSGLang(base_url=url, api_key=key, temperature=0.0, max_tokens=max_tokens, max_retries=0,
                          timeout=600)
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model_id, base_url=url + "/v1", api_key=key, temperature=0.0, max_tokens=max_tokens,
                      max_retries=0, timeout=600)


def p99(sorted_times: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    return sorted_times[max(0, math.ceil(0.99 * len(sorted_times)) - 1)]


def one_run(route: str, args) -> dict:
    """One route on a fresh server: all graph runs at once; returns times and the server's token counts."""
    kind, flags = ROUTES[route]

    def make_program(url: str, key: str, model_id: str):
        graph = build_graph(make_llm(kind, url, key, model_id, args.max_tokens), args.cycles, tuple(args.tool_s),
                            args.obs_words)

        def program(i: int):
            state, config = start_state(i, args.task_words), run_config(i, args.cycles)
            return lambda: graph.invoke(state, config)

        return program

    figures, times = run_route(flags, args, args.runs, make_program, label="run")
    return dict(route=route, **figures, p99_s=p99(times), program_times=times)


SUMMARY_KEYS = ("p50_s", "p99_s", "max_s", "elapsed_s", "programs_per_s", "lm_calls", "prompt_tokens",
                "computed_prompt_tokens", "host_loaded_tokens")


def main(argv: list[str] | None = None) -> int:
    ap = route_parser(__doc__, ROUTES)
    ap.add_argument("--runs", type=int, default=8, help="concurrent graph runs (LangGraph threads)")
    ap.add_argument("--cycles", type=int, default=3, help="supervisor -> researcher -> search -> writer cycles")
    add_agent_args(ap, max_tokens=32, task_words=200)
    args = ap.parse_args(argv)
    routes = chosen_routes(ap, args, ROUTES)
    if args.runs < 1 or args.cycles < 1 or args.rounds < 1 or args.max_tokens < 1:
        ap.error("--runs, --cycles, --rounds and --max-tokens must be >= 1")
    run_rounds(routes, args, lambda route: one_run(route, args), SUMMARY_KEYS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
