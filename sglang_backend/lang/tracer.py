"""Tracing: run a program with placeholder arguments and record what it appends, as a dataflow graph.

Works for programs without data-dependent control flow (a traced ``s["x"]`` is a placeholder, not a
value). The graph serves ``run_batch``'s prefix pre-caching and ``.compile()``, which replays the recorded
operations with real arguments.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any

from .ir import (
    RoleBlocks,
    SglArgument,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVariable,
    SglVideo,
    TraceNode,
    _to_expr,
)


class TracingError(RuntimeError):
    pass


_scope = threading.local()  # .graph: the graph being traced on this thread (None outside tracing)


def tracing_graph() -> "TracedProgram | None":
    return getattr(_scope, "graph", None)


@dataclass
class TracedProgram:
    nodes: list[TraceNode] = field(default_factory=list)
    ops: list[tuple[int, str, Any]] = field(default_factory=list)  # (branch, kind, payload) in program order
    arguments: list[str] = field(default_factory=list)
    _last: dict[int, int] = field(default_factory=dict)  # branch -> last node id
    _producers: dict[tuple[int, str], int] = field(default_factory=dict)  # (branch, var) -> node id
    _next_branch: int = 1

    def add(self, branch: int, kind: str, value=None, extra_inputs=()) -> int:
        inputs = [self._last[branch]] if branch in self._last else []
        inputs += [i for i in extra_inputs if i is not None]
        self.nodes.append(TraceNode(kind, value, inputs, branch))
        nid = len(self.nodes) - 1
        self._last[branch] = nid
        return nid

    def node_line(self, i: int) -> str:
        n = self.nodes[i]
        value = n.value if not isinstance(n.value, str) or len(n.value) < 40 else n.value[:37] + "..."
        return f"%{i} = {n.kind}({value!r}) <- {n.inputs} [branch {n.branch}]"

    def pretty(self) -> str:
        return "\n".join(self.node_line(i) for i in range(len(self.nodes)))

    @property
    def last_node(self) -> "GraphNode":
        """The main program's last node (upstream's ``tracer.last_node``), to walk the graph back from."""
        return GraphNode(self, self._last.get(0))

    def constant_prefix(self, chat_template) -> str:
        """The text every run of the program starts with (before any argument, gen or select)."""
        text = ""
        for branch, kind, payload in self.ops:
            if branch != 0 or kind != "expr":
                break
            for e in payload.exprs if isinstance(payload, SglExprList) else [payload]:
                if isinstance(e, SglConstantText):
                    text += e.value
                elif isinstance(e, SglRoleBegin):
                    text += chat_template.get_prefix_and_suffix(e.role)[0]
                elif isinstance(e, SglRoleEnd):
                    text += chat_template.get_prefix_and_suffix(e.role)[1]
                else:
                    return text
        return text


class GraphNode:
    """One node of a traced graph, as upstream's tracer hands it out: ``print_graph_dfs()`` lists the node and
    everything it depends on, dependencies first, one ``%id = kind(value) <- inputs`` line each."""

    def __init__(self, graph: TracedProgram, node_id: int | None):
        self.graph, self.node_id = graph, node_id

    @property
    def prev_nodes(self) -> list["GraphNode"]:
        if self.node_id is None:
            return []
        return [GraphNode(self.graph, i) for i in self.graph.nodes[self.node_id].inputs]

    def print_graph_dfs(self) -> str:
        order: list[int] = []
        seen: set[int] = set()
        stack = [(self.node_id, False)] if self.node_id is not None else []
        while stack:  # iterative post-order: a long program must not hit the recursion limit
            nid, expanded = stack.pop()
            if expanded:
                order.append(nid)
            elif nid not in seen:
                seen.add(nid)
                stack.append((nid, True))
                stack.extend((i, False) for i in reversed(self.graph.nodes[nid].inputs) if i not in seen)
        return "".join(self.graph.node_line(i) + "\n" for i in order)

    def __repr__(self) -> str:
        return f"GraphNode(%{self.node_id})"


class TracerProgramState(RoleBlocks):
    def __init__(self, graph: TracedProgram, branch: int = 0):
        self.graph = graph
        self.branch = branch

    def __iadd__(self, other):
        expr = _to_expr(other)
        self.graph.ops.append((self.branch, "expr", expr))
        for e in expr.exprs if isinstance(expr, SglExprList) else [expr]:
            self._record(e)
        return self

    def _record(self, e: SglExpr) -> None:
        g, b = self.graph, self.branch
        if isinstance(e, SglConstantText):
            g.add(b, "text", e.value)
        elif isinstance(e, SglArgument):
            g.add(b, "argument", e.name)
        elif isinstance(e, SglGen):
            nid = g.add(b, "gen", e.name)
            g._producers[(b, e.name)] = nid
        elif isinstance(e, SglSelect):
            nid = g.add(b, "select", {"name": e.name, "choices": e.choices})
            g._producers[(b, e.name)] = nid
        elif isinstance(e, SglRoleBegin):
            g.add(b, "role_begin", e.role)
        elif isinstance(e, SglRoleEnd):
            g.add(b, "role_end", e.role)
        elif isinstance(e, (SglImage, SglVideo)):
            g.add(b, "image", str(e.path))
        elif isinstance(e, SglVariable):
            src = e.source.branch if isinstance(e.source, TracerProgramState) else b
            g.add(b, "variable", e.name, [g._producers.get((src, e.name))])
        else:
            g.add(b, type(e).__name__, None)

    def __getitem__(self, name: str) -> SglVariable:
        return SglVariable(name, self)

    def fork(self, size: int = 1, position_ids_offset=None) -> "TracerStateGroup":
        g = self.graph
        children = list(range(g._next_branch, g._next_branch + size))
        g._next_branch += size
        fork_node = g.add(self.branch, "fork", size)
        for c in children:
            g._last[c] = fork_node
        g.ops.append((self.branch, "fork", children))
        return TracerStateGroup([TracerProgramState(g, c) for c in children], self)

    def _not_while_tracing(self, *_, **__):
        raise TracingError("the program reads its state (text/messages/sync) while tracing; tracing needs "
                           "programs without data-dependent control flow")

    text = messages = sync = _not_while_tracing


class TracerStateGroup:
    def __init__(self, states: list[TracerProgramState], parent: TracerProgramState):
        self.states, self.parent = states, parent

    def __getitem__(self, i):
        return self.states[i]

    def __iter__(self):
        return iter(self.states)

    def __len__(self):
        return len(self.states)

    def __setitem__(self, i, value):
        pass

    def __iadd__(self, other):
        if callable(other) and not isinstance(other, SglExpr):
            others = [other(i) for i in range(len(self.states))]  # forks += lambda i: ...
        else:
            others = other if isinstance(other, (list, tuple)) else [other] * len(self.states)
        for s, o in zip(self.states, others):
            s += o
        return self

    def join(self, mode: str = "gather_variable") -> None:
        g = self.parent.graph
        g.add(self.parent.branch, "join", mode, [g._last.get(s.branch) for s in self.states])
        g.ops.append((self.parent.branch, "join", ([s.branch for s in self.states], mode)))


def trace_program(program, kwargs: dict, partial: bool = False) -> TracedProgram:
    """The program's graph with placeholders for missing arguments. ``partial=True``: a program whose control
    flow needs a real argument (``for x in arg``, ``s.fork(arg)``) is traced up to that point instead of
    failing; the ops before it are the same for every run, which is all a constant prefix needs."""
    graph = TracedProgram()
    params = list(inspect.signature(program.func).parameters)[1:]
    args = {}
    for name in params:
        if name in kwargs:
            args[name] = kwargs[name]
        else:
            args[name] = SglArgument(name)
            graph.arguments.append(name)
    state = TracerProgramState(graph)
    outer, _scope.graph = tracing_graph(), graph
    try:
        program.func(state, **args)
    except Exception:  # noqa: BLE001 - see partial above
        if not partial:
            raise
    finally:
        _scope.graph = outer
    return graph


def trace_call(program, args: tuple, kwargs: dict) -> TracerProgramState:
    """A function called as ``f(...)`` inside a traced program (upstream's nested programs): a new branch that
    starts from an empty state ("program" op), recorded in the caller's graph; the returned state's variables
    are placeholders the caller can append (``s += sub["x"]``), and ``.compile()`` replays the branch."""
    graph = tracing_graph()
    branch = graph._next_branch
    graph._next_branch += 1
    graph.add(branch, "program", program.func.__name__)
    graph.ops.append((branch, "program", None))
    state = TracerProgramState(graph, branch)
    bound = inspect.signature(program.func).bind(state, *args, **{**program.bind_arguments, **kwargs})
    program.func(*bound.args, **bound.kwargs)
    return state


def substitute(expr: SglExpr, values: dict, states: dict) -> SglExpr:
    """Replaces argument placeholders with values and traced variable references with real ones."""
    if isinstance(expr, SglExprList):
        return SglExprList([substitute(e, values, states) for e in expr.exprs])
    if isinstance(expr, SglArgument):
        v = values[expr.name]
        return v if isinstance(v, SglExpr) else SglConstantText(str(v))
    if isinstance(expr, SglVariable) and isinstance(expr.source, TracerProgramState):
        return SglVariable(expr.name, states[expr.source.branch].stream_executor)
    return expr
