"""The public DSL, with upstream SGLang's names and argument names (``import sglang as sgl`` programs run
with only the import changed)."""

from __future__ import annotations

import inspect
import json
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tqdm import tqdm

from .choices import token_length_normalized
from .interpreter import ProgramState, StreamExecutor, run_program
from .ir import (
    REGEX_INT,
    REGEX_STR,
    SglCommitLazy,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglSeparateReasoning,
    SglVideo,
    _to_expr,
)
from .global_config import global_config
from .tracer import TracerProgramState, substitute, trace_call, trace_program, tracing_graph

PREFIX_CACHE_MIN_CHARS = 64  # run_batch pre-caches a constant prefix at least this long


def set_default_backend(backend) -> None:
    global_config.default_backend = backend


def get_default_backend():
    return global_config.default_backend


def flush_cache(backend=None) -> None:
    backend = backend or global_config.default_backend
    if backend is not None and hasattr(backend, "flush_cache"):
        backend.flush_cache()


def get_server_info(backend=None) -> dict:
    backend = backend or global_config.default_backend
    return backend.get_server_info()


class SglFunction:
    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None, bind_arguments: dict | None = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = bind_arguments or {}
        self._pins: dict[int, list[str]] = {}  # pin(): session ids per backend (by id), for unpin()
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError("an @function's first parameter must be the program state (s)")
        self.arg_names = params[1:]

    def bind(self, **kwargs) -> "SglFunction":
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"bind(): unknown arguments {sorted(unknown)}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def _kwargs(self, args: tuple, kwargs: dict) -> dict:
        merged = dict(self.bind_arguments)
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.func.__name__}() takes {len(self.arg_names)} arguments, got {len(args)}")
        merged.update(zip(self.arg_names, args))
        merged.update(kwargs)
        return merged

    def run(self, *args, max_new_tokens: int = 128, stop=None, stop_token_ids=None, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
            presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool = False,
            logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=None, stream: bool = False,
            backend=None, use_thread: bool = True, **kwargs) -> ProgramState:
        default = SglSamplingParams(max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
                                    temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                    frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                    ignore_eos=ignore_eos, return_logprob=return_logprob,
                                    logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                    return_text_in_logprobs=return_text_in_logprobs)
        backend = backend or global_config.default_backend
        state = run_program(self, backend, (), self._kwargs(args, kwargs), default, stream, use_thread)
        if global_config.verbosity >= 2 and not stream:
            print(state.text())
        return state

    def run_batch(self, batch_kwargs: list[dict], *, max_new_tokens: int = 128, stop=None, stop_token_ids=None,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                  frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
                  return_logprob: bool = False, logprob_start_len=None, top_logprobs_num=None,
                  return_text_in_logprobs=None, backend=None, num_threads: int | str = "auto",
                  progress_bar: bool = False, generator_style: bool = False) -> list[ProgramState]:
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts")
        backend = backend or global_config.default_backend
        if backend is None:
            raise ValueError("no backend: call set_default_backend(...) or pass backend=...")
        if not batch_kwargs:
            return []
        self.cache_batch_prefix(backend, len(batch_kwargs))
        if num_threads == "auto":
            num_threads = min(len(batch_kwargs), max(16, (os.cpu_count() or 1) * 8), 128)
        run_kwargs = dict(max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
                          temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                          ignore_eos=ignore_eos, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                          top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
                          backend=backend)

        def one(kwargs):
            state = self.run(**kwargs, **run_kwargs)
            try:
                state.sync()
            except Exception:  # noqa: BLE001 - surfaced when the state is read
                pass
            return state

        with ThreadPoolExecutor(max(1, int(num_threads))) as pool:
            futures = [pool.submit(one, kw) for kw in batch_kwargs]
            if progress_bar:
                for _ in tqdm(futures, total=len(futures), desc=f"run_batch {self.func.__name__}"):
                    _.result()
            return [f.result() for f in futures]

    def cache_batch_prefix(self, backend, n: int) -> None:
        """Pre-caches the constant prefix every instance starts with, once, before ``n`` instances fan out."""
        if n >= 2 and global_config.enable_precache_with_tracing:
            self.cache(backend)

    def _hint_backend(self, backend):
        backend = backend or global_config.default_backend
        if backend is None:
            raise ValueError("no backend: call set_default_backend(...) or pass backend=...")
        return backend

    def _constant_prefix(self, backend) -> str:
        """The text every run of the program starts with (traced, bound arguments included); "" when the program
        cannot be traced, or when the prefix is shorter than PREFIX_CACHE_MIN_CHARS (not worth a call)."""
        try:
            prefix = trace_program(self, self.bind_arguments, partial=True).constant_prefix(backend.get_chat_template())
        except Exception:  # noqa: BLE001 - programs that cannot be traced just skip the hint
            return ""
        return prefix if len(prefix) >= PREFIX_CACHE_MIN_CHARS else ""

    def cache(self, backend=None) -> None:
        """Prefills the program's constant prefix into the backend's prefix cache, as upstream's
        ``SglFunction.cache``; runs then start from the cached prefix."""
        backend = self._hint_backend(backend)
        if getattr(backend, "fork_hints", True):
            prefix = self._constant_prefix(backend)
            if prefix:
                backend.cache_prefix(prefix)

    def pin(self, backend=None) -> None:
        """Prefills the constant prefix and keeps its KV from eviction until ``unpin`` (older upstream's
        ``SglFunction.pin``): a session pin on our runtimes, released by ``unpin`` or the session time to live;
        a backend without KV control (the OpenAI API) ignores it."""
        backend = self._hint_backend(backend)
        prefix = self._constant_prefix(backend)
        if prefix:
            session_id = f"sgl-pin-{uuid.uuid4().hex}"
            backend.pin_prefix(prefix, session_id)
            self._pins.setdefault(id(backend), []).append(session_id)

    def unpin(self, backend=None) -> None:
        """Releases what ``pin`` kept on this backend (its KV becomes evictable)."""
        backend = self._hint_backend(backend)
        for session_id in self._pins.pop(id(backend), []):
            backend.unpin_prefix(session_id)

    def trace(self, *, backend=None, **kwargs):
        """The program's dataflow graph (arguments not given become placeholders)."""
        return trace_program(self, {**self.bind_arguments, **kwargs})

    def compile(self, *, backend=None) -> "CompiledFunction":
        return CompiledFunction(self, self.trace(), backend)

    def __call__(self, *args, **kwargs):
        """``prog(...)`` runs the program (as upstream); ``prog(s, ...)`` with a program state first inlines
        it into that state, so functions nest. Inside a traced program, ``prog(...)`` is traced as a program of
        its own in the caller's graph (``tracer.trace_call``), as upstream's tracer does."""
        if args and isinstance(args[0], (ProgramState, TracerProgramState)):
            # Same thread, same state: the callee's appends queue up in order with the caller's.
            self.func(args[0], *args[1:], **{**self.bind_arguments, **kwargs})
            return args[0]
        if tracing_graph() is not None:
            return trace_call(self, args, kwargs)
        return self.run(*args, **kwargs)


class CompiledFunction:
    """Replays a traced program's operations with real arguments."""

    def __init__(self, function: SglFunction, graph, backend=None):
        self.function = function
        self.graph = graph
        self.backend = backend

    def run(self, *, max_new_tokens: int = 128, stop=None, temperature: float = 1.0, top_p: float = 1.0,
            top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            backend=None, **kwargs) -> ProgramState:
        """One replay with these arguments; the sampling keywords are the defaults of its ``gen`` calls, as in
        ``SglFunction.run`` (and upstream's ``CompiledFunction.run``)."""
        missing = [a for a in self.graph.arguments if a not in kwargs]
        if missing:
            raise TypeError(f"compiled program is missing arguments {missing}")
        backend = backend or self.backend or global_config.default_backend
        default = SglSamplingParams(max_new_tokens=max_new_tokens, stop=stop, temperature=temperature, top_p=top_p,
                                    top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                                    presence_penalty=presence_penalty)
        executor = StreamExecutor(backend, kwargs, default, None)
        states = {0: ProgramState(executor)}
        programs = [executor]  # the main program and those its calls started (ended together)
        for branch, kind, payload in self.graph.ops:
            if kind == "program":  # a nested function call: its own state, from empty
                programs.append(StreamExecutor(backend, {}, default, None))
                states[branch] = ProgramState(programs[-1])
                continue
            state = states[branch]
            if kind == "expr":
                state += substitute(payload, kwargs, states)
            elif kind == "fork":
                group = state.fork(len(payload))
                for b, s in zip(payload, group):
                    states[b] = s
                state._last_group = group
            elif kind == "join":
                state._last_group.join(payload[1])
        for ex in programs:
            ex.end()
        for ex in programs:
            try:
                ex.sync()
            except Exception:  # noqa: BLE001 - the state reports its own error
                pass
        return states[0]

    def run_batch(self, batch_kwargs: list[dict], *, num_threads: int | str = "auto",
                  **run_kwargs) -> list[ProgramState]:
        """``run`` for each argument dict, on a thread pool (upstream's ``CompiledFunction.run_batch``); the
        keywords are ``run``'s (sampling defaults, ``backend``). States come back in order, each synced."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts")
        if num_threads == "auto":
            num_threads = min(len(batch_kwargs), max(16, (os.cpu_count() or 1) * 8), 128)
        with ThreadPoolExecutor(max(1, int(num_threads))) as pool:
            return list(pool.map(lambda kw: self.run(**kw, **run_kwargs), batch_kwargs))


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None,
             api_num_spec_tokens: int | None = None):
    """``@function`` / ``@function(num_api_spec_tokens=N)``; ``api_num_spec_tokens`` is the older name of the same
    knob (upstream's test_openai_spec still passes it)."""
    if num_api_spec_tokens is None:
        num_api_spec_tokens = api_num_spec_tokens
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, n: int | None = None,
        stop=None, stop_token_ids=None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype=None, choices: list[str] | None = None,
        choices_method=None, regex: str | None = None, json_schema: str | None = None) -> SglExpr:
    if choices is not None:
        return SglSelect(name, choices, 0.0 if temperature is None else temperature,
                         choices_method or token_length_normalized)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen({name!r}): invalid regex {regex!r}: {e}") from None
    if json_schema is not None and not isinstance(json_schema, str):
        json_schema = json.dumps(json_schema)
    params = SglSamplingParams(max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
                               stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
                               min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                               ignore_eos=ignore_eos, return_logprob=return_logprob,
                               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                               return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex,
                               json_schema=json_schema)
    return SglGen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs) -> SglExpr:
    return gen(name, max_tokens, regex=REGEX_INT, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs) -> SglExpr:
    return gen(name, max_tokens, regex=REGEX_STR, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method=token_length_normalized) -> SglExpr:
    if not choices:
        raise ValueError(f"select({name!r}) needs a non-empty list of choices")
    return SglSelect(name, list(choices), temperature, choices_method)


def image(expr) -> SglExpr:
    return SglImage(expr)


def video(path, num_frames: int) -> SglExpr:
    return SglVideo(path, num_frames)


def _role_common(role: str, expr=None) -> SglExpr:
    if expr is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    return SglExprList([SglRoleBegin(role), _to_expr(expr), SglRoleEnd(role)])


def system(expr=None) -> SglExpr:
    return _role_common("system", expr)


def user(expr=None) -> SglExpr:
    return _role_common("user", expr)


def assistant(expr=None) -> SglExpr:
    return _role_common("assistant", expr)


def system_begin() -> SglExpr:
    return SglRoleBegin("system")


def system_end() -> SglExpr:
    return SglRoleEnd("system")


def user_begin() -> SglExpr:
    return SglRoleBegin("user")


def user_end() -> SglExpr:
    return SglRoleEnd("user")


def assistant_begin() -> SglExpr:
    return SglRoleBegin("assistant")


def assistant_end() -> SglExpr:
    return SglRoleEnd("assistant")


def commit_lazy_operations() -> SglExpr:
    return SglCommitLazy()


def separate_reasoning(expr=None, model_type: str | None = None) -> SglExpr:
    """``separate_reasoning(gen("answer"), model_type="deepseek-r1")``: runs the gen, then moves its
    ``<think>...</think>`` part to the variable ``answer_reasoning_content``."""
    if expr is None:
        return SglExprList([])
    expr = _to_expr(expr)
    return SglExprList([expr, SglSeparateReasoning(model_type, expr)])

