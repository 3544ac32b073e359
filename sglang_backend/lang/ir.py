"""The program IR: what ``s += ...`` appends. Expressions are plain data; the interpreter executes them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

REGEX_INT = r"[-+]?[0-9]+"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""  # a quoted string of word characters (upstream's gen_string)


@dataclass
class SglSamplingParams:
    """Per-gen sampling parameters (None = inherit the run's default)."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None
    regex: str | None = None
    json_schema: str | None = None

    def merged_over(self, default: "SglSamplingParams") -> "SglSamplingParams":
        out = dataclasses.replace(default)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                setattr(out, f.name, v)
        return out

    def to_runtime_params(self) -> dict:
        """The engine/server ``sampling_params`` dict (logprob options travel separately)."""
        sp: dict[str, Any] = {}
        mapping = {"max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "stop": "stop",
                   "stop_token_ids": "stop_token_ids", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                   "ignore_eos": "ignore_eos", "regex": "regex", "json_schema": "json_schema"}
        for ours, theirs in mapping.items():
            v = getattr(self, ours)
            if v is not None:
                sp[theirs] = v
        if self.dtype is not None and self.regex is None:
            sp["regex"] = dtype_regex(self.dtype)
        return sp


def dtype_regex(dtype) -> str:
    if dtype in (int, "int"):
        return REGEX_INT
    if dtype in (float, "float"):
        return REGEX_FLOAT
    if dtype in (bool, "bool"):
        return REGEX_BOOL
    if dtype in (str, "str"):
        return REGEX_STR
    raise ValueError(f"gen(dtype=...) must be int, float, bool or str, got {dtype!r}")


def cast_dtype(dtype, text: str):
    if dtype in (int, "int"):
        return int(text.strip())
    if dtype in (float, "float"):
        return float(text.strip())
    if dtype in (bool, "bool"):
        return text.strip() == "True"
    if dtype in (str, "str"):
        t = text.strip()
        return t[1:-1] if len(t) >= 2 and t[0] == t[-1] == '"' else t
    return text


class SglExpr:
    """Base of everything that can be appended to a program state."""

    def __add__(self, other):
        return SglExprList([self, _to_expr(other)])

    def __radd__(self, other):
        return SglExprList([_to_expr(other), self])


def _to_expr(x) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    raise TypeError(f"cannot append {type(x).__name__} to a program state (use str or a primitive)")


@dataclass(eq=False)
class SglExprList(SglExpr):
    exprs: list[SglExpr]

    def __post_init__(self):
        flat: list[SglExpr] = []
        for e in self.exprs:
            flat.extend(e.exprs if isinstance(e, SglExprList) else [e])
        self.exprs = flat

    @property
    def expr_list(self) -> list[SglExpr]:  # upstream's attribute name
        return self.exprs


@dataclass(eq=False)
class SglConstantText(SglExpr):
    value: str


@dataclass(eq=False)
class SglGen(SglExpr):
    name: str | None = None
    sampling_params: SglSamplingParams = field(default_factory=SglSamplingParams)  # SglGen(name): all inherited


@dataclass(eq=False)
class SglSelect(SglExpr):
    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Any


@dataclass(eq=False)
class SglRoleBegin(SglExpr):
    role: str


@dataclass(eq=False)
class SglRoleEnd(SglExpr):
    role: str


@dataclass(eq=False)
class SglImage(SglExpr):
    path: Any


@dataclass(eq=False)
class SglVideo(SglExpr):
    path: Any
    num_frames: int


@dataclass(eq=False)
class SglVarScopeBegin(SglExpr):
    name: str


@dataclass(eq=False)
class SglVarScopeEnd(SglExpr):
    name: str


@dataclass(eq=False)
class SglCommitLazy(SglExpr):
    """Send the text so far to the backend as a prefix hint (max_new_tokens=0)."""


@dataclass(eq=False)
class SglSeparateReasoning(SglExpr):
    """``separate_reasoning(gen(...), model_type)``: after the gen, its ``<think>...</think>`` part moves to the
    variable ``<name>_reasoning_content``; the gen's variable and the text keep the answer only."""

    model_type: str | None
    expr: SglExpr | None

    @property
    def targets(self) -> list:
        """The gens/selects whose output is split."""
        exprs = self.expr.exprs if isinstance(self.expr, SglExprList) else [self.expr]
        return [e for e in exprs if isinstance(e, (SglGen, SglSelect))]

    @property
    def names(self) -> list[str]:
        """The reasoning variables this produces."""
        return [reasoning_var_name(e.name) for e in self.targets]

    @property
    def name(self) -> str | None:  # upstream's attribute: the (last) reasoning variable
        return self.names[-1] if self.names else None

    @staticmethod
    def process_name_for_reasoning(name: str | None) -> str:  # upstream's name for reasoning_var_name
        return reasoning_var_name(name)

    def __repr__(self) -> str:  # upstream's form
        return f"SeparateReasoning(model_type={self.model_type}, name={self.name})"


def reasoning_var_name(name: str | None) -> str:
    if not name:
        raise ValueError("separate_reasoning needs a named gen/select: gen(\"answer\", ...)")
    return f"{name}_reasoning_content"


class BlockScope:
    """``with s.user():`` and friends: appends ``begin`` on entry and ``end`` on exit."""

    def __init__(self, state, begin: SglExpr, end: SglExpr):
        self.state, self.begin, self.end = state, begin, end

    def __enter__(self):
        self.state += self.begin
        return self.state

    def __exit__(self, *exc):
        self.state += self.end


class RoleBlocks:
    """``s.user(...)`` appends a whole role block; ``with s.user():`` opens one. Shared by the real and
    the tracing program state (both implement ``+=``)."""

    def _role(self, role: str, expr=None):
        if expr is None:
            return BlockScope(self, SglRoleBegin(role), SglRoleEnd(role))
        self += SglRoleBegin(role) + _to_expr(expr) + SglRoleEnd(role)
        return None

    def system(self, expr=None):
        return self._role("system", expr)

    def user(self, expr=None):
        return self._role("user", expr)

    def assistant(self, expr=None):
        return self._role("assistant", expr)


# Tracing placeholders --------------------------------------------------------------------------------------------
@dataclass(eq=False)
class SglArgument(SglExpr):
    name: str
    value: Any = None

    def _no_str(self, *_):
        raise TypeError(
            f"argument {self.name!r} was used inside an f-string or str() while tracing; tracing cannot see "
            f"through string formatting. Append it as its own piece instead: s += \"...\" + {self.name} + \"...\"")

    __str__ = _no_str
    __format__ = _no_str


@dataclass(eq=False)
class SglVariable(SglExpr):
    """A reference to a variable produced by a gen/select (in tracing, or another state's variable)."""

    name: str
    source: Any = None


@dataclass(eq=False)
class SglFork(SglExpr):
    n: int


@dataclass(eq=False)
class SglJoin(SglExpr):
    mode: str


@dataclass
class TraceNode:
    """One node of a traced program's dataflow graph."""

    kind: str  # text, argument, gen, select, role_begin, role_end, image, fork, join, variable
    value: Any = None
    inputs: list[int] = field(default_factory=list)
    branch: int | None = None
