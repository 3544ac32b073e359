"""Runs LM programs: one ``StreamExecutor`` (a worker thread with a queue) per program state, so ``s += ...``
returns at once and many programs (and the branches of a fork) run in parallel. Reading ``s["var"]``
blocks until that variable is produced; an error in a program surfaces when its state is read, never as
a hang.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import uuid
from typing import Any, Iterator

from ..utils import iterate_in_thread
from .ir import (
    BlockScope,
    RoleBlocks,
    SglCommitLazy,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglSeparateReasoning,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
    SglVideo,
    _to_expr,
    cast_dtype,
    reasoning_var_name,
)
from .speculative import SpecTerm, gen_term, match_terms

CHAT_SPEC_TRIES = 3  # chat speculative execution: completions tried until one follows the template (sampling)


class ProgramError(RuntimeError):
    pass


class StreamExecutor:
    def __init__(self, backend, arguments: dict, default_sampling_para: SglSamplingParams, chat_template=None,
                 stream: bool = False, use_thread: bool = True, num_api_spec_tokens: int | None = None):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens
        self.text_ = ""
        self.messages_: list[dict] = []
        self.images_: list = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.var_scopes: dict[str, int] = {}
        self.partial_vars: dict[str, str] = {}  # variables being streamed
        self.partial_meta: dict[str, dict] = {}  # their latest meta info (cumulative logprob lists)
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.cond = threading.Condition()
        self.spec_text = ""  # API speculative execution: text generated ahead, not yet consumed
        self.chat_spec: list[SpecTerm] = []  # chat models: the assistant turn's deferred texts and gens
        self.cur_images: list = []  # images of the open role, for backends that send them as message parts
        self.api_calls = 0
        self.use_thread = use_thread
        self.queue: queue.Queue = queue.Queue()
        if use_thread:
            self.worker = threading.Thread(target=self._worker, daemon=True, name=f"sgl-executor-{self.sid[:6]}")
            self.worker.start()

    # Submission -----------------------------------------------------------------------------------------------
    def submit(self, expr: SglExpr) -> None:
        expr = _to_expr(expr)
        self._declare_vars(expr)
        if self.use_thread:
            self.queue.put(expr)
        else:
            self._run_one(expr)

    def _declare_vars(self, expr: SglExpr) -> None:
        exprs = expr.exprs if isinstance(expr, SglExprList) else [expr]
        for e in exprs:
            if isinstance(e, SglSeparateReasoning):
                names = e.names
            else:
                names = [getattr(e, "name", None)] if isinstance(e, (SglGen, SglSelect, SglVarScopeBegin)) else []
            for name in names:
                if name is not None:
                    self.variable_event.setdefault(name, threading.Event())

    def sync(self) -> None:
        if self.use_thread:
            self.queue.join()
        if self.error is not None:
            raise ProgramError(f"program failed: {self.error}") from self.error

    def end(self) -> None:
        if self.use_thread:
            self.queue.put(None)
        else:
            self._finish()

    def _worker(self) -> None:
        while True:
            expr = self.queue.get()
            try:
                if expr is None:
                    self._finish()
                    return
                self._run_one(expr)
            finally:
                self.queue.task_done()

    def _run_one(self, expr: SglExpr) -> None:
        if self.error is not None:
            return  # a failed program skips the rest of its expressions
        try:
            self._execute(expr)
        except BaseException as e:  # noqa: BLE001 - recorded; raised on whoever reads the state
            self.error = e
            for ev in self.variable_event.values():
                ev.set()
            with self.cond:
                self.cond.notify_all()

    def _finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()
        for ev in self.variable_event.values():
            ev.set()  # readers of never-produced variables get an error instead of waiting forever

    # Reading --------------------------------------------------------------------------------------------------
    def get_var(self, name: str):
        if name in self.variables:
            return self.variables[name]
        ev = self.variable_event.get(name)
        if ev is None:
            raise KeyError(f"variable {name!r} is never generated by this program (known: {sorted(self.variable_event)})")
        ev.wait()
        if name in self.variables:
            return self.variables[name]
        if self.error is not None:
            raise ProgramError(f"variable {name!r} was not produced: {self.error}") from self.error
        raise KeyError(f"variable {name!r} was not produced (the program ended before it)")

    def get_meta_info(self, name: str):
        self.get_var(name)
        return self.meta_info.get(name)

    # Execution ------------------------------------------------------------------------------------------------
    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, SglConstantText):
            self._fill(expr.value)
        elif isinstance(expr, SglVariable):
            value = expr.source.get_var(expr.name) if expr.source is not None else self.get_var(expr.name)
            self._fill(str(value))
        elif isinstance(expr, SglGen):
            self._gen(expr)
        elif isinstance(expr, SglSelect):
            self._select(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self.var_scopes[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            start = self.var_scopes.pop(expr.name)
            self._set_var(expr.name, self.text_[start:])
        elif isinstance(expr, SglCommitLazy):
            self.backend.cache_prefix(self.text_)
        elif isinstance(expr, (SglImage, SglVideo)):
            self._image(expr)
        elif isinstance(expr, SglSeparateReasoning):
            self._execute_separate_reasoning(expr)
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _fill(self, text: str) -> None:
        if self._chat_speculating():
            self.chat_spec.append(SpecTerm(text))
        else:
            self._append(text)

    def _append(self, text: str) -> None:
        # Text the program writes consumes matching speculated text; anything else voids the speculation.
        if self.spec_text:
            self.spec_text = self.spec_text[len(text):] if self.spec_text.startswith(text) else ""
        with self.cond:
            self.text_ += text
            self.cond.notify_all()

    def _set_var(self, name: str, value, meta=None) -> None:
        self.variables[name] = value
        if meta is not None:
            self.meta_info[name] = meta
        self.partial_vars.pop(name, None)
        self.partial_meta.pop(name, None)
        self.variable_event.setdefault(name, threading.Event()).set()
        with self.cond:
            self.cond.notify_all()

    def _gen(self, expr: SglGen) -> None:
        params = expr.sampling_params.merged_over(self.default_sampling_para)
        name = expr.name or f"gen_{len(self.variables)}"
        if self._chat_speculating():
            self.chat_spec.append(gen_term(name, params))
            return
        if params.n and params.n > 1:
            texts, metas = self.backend.generate_n(self, params, params.n)
            value = [cast_dtype(params.dtype, t) for t in texts] if params.dtype else texts
            self._set_var(name, value, metas)
            self._append(texts[0])
            return
        if self._speculating():
            text, meta = self._spec_gen(params)
            self._append_generated(text)
            self._set_var(name, cast_dtype(params.dtype, text) if params.dtype else text, meta)
            return
        if self.stream and self.backend.supports_stream:
            self.partial_vars[name] = ""
            meta = None
            for piece, meta in self.backend.generate_stream(self, params):
                if meta is not None:
                    self.partial_meta[name] = meta
                self.partial_vars[name] += piece
                self._append(piece)
            text = self.partial_vars.get(name, "")
        else:
            text, meta = self.backend.generate(self, params)
            self._append(text)
        self._set_var(name, cast_dtype(params.dtype, text) if params.dtype else text, meta)

    # API speculative execution (completion models) ---------------------------------------------------------------
    def _speculating(self) -> bool:
        return bool(self.num_api_spec_tokens) and getattr(self.backend, "supports_api_spec", False) \
            and not getattr(self.backend, "is_chat_model", False)

    def _chat_speculating(self) -> bool:
        return self.cur_role == "assistant" and bool(self.num_api_spec_tokens) \
            and getattr(self.backend, "supports_api_spec", False) and getattr(self.backend, "is_chat_model", False)

    def _flush_chat_spec(self) -> None:
        """Runs the assistant turn's deferred texts and gens as one chat completion (see speculative.py)."""
        terms, self.chat_spec = self.chat_spec, []
        gens = [t for t in terms if t.text is None]
        values, meta = {}, {}
        if gens:
            params = dataclasses.replace(gens[0].params, stop=None, n=None, max_new_tokens=self.num_api_spec_tokens)
            for _ in range(1 if not params.temperature else CHAT_SPEC_TRIES):  # greedy: a retry is the same
                completion, meta = self.backend.generate(self, params)
                values, matched = match_terms(terms, completion)
                if matched:
                    break
        for t in terms:
            value = t.text if t.text is not None else values.get(t.name, "")
            self._append(value)
            if t.text is None:
                try:
                    typed = cast_dtype(t.params.dtype, value) if t.params.dtype else value
                except ValueError:
                    typed = value  # the model strayed: the raw text, as upstream's
                self._set_var(t.name, typed, {**meta, "speculative": True})

    def _append_generated(self, text: str) -> None:
        with self.cond:
            self.text_ += text
            self.cond.notify_all()

    def _spec_gen(self, params: SglSamplingParams) -> tuple[str, dict]:
        """Serves a gen from speculated text, generating ahead (without stop, num_api_spec_tokens long)
        when there is none. Lengths are cut in characters, as the speculation is text."""
        meta: dict = {"speculative": True}
        if not self.spec_text:
            ahead = dataclasses.replace(params, stop=None,
                                        max_new_tokens=max(params.max_new_tokens or 0, self.num_api_spec_tokens))
            self.spec_text, meta = self.backend.generate(self, ahead)
            meta = {**meta, "speculative": False}
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        positions = [p for p in (self.spec_text.find(x) for x in stops if x) if p >= 0]
        cut = min(positions) if positions else min(len(self.spec_text), params.max_new_tokens or len(self.spec_text))
        text, self.spec_text = self.spec_text[:cut], self.spec_text[cut:]
        return text, meta

    def _select(self, expr: SglSelect) -> None:
        if not expr.choices:
            raise ValueError("select() needs at least one choice")
        decision = self.backend.select(self, list(expr.choices), expr.temperature, expr.choices_method)
        self._append(decision.decision)
        self._set_var(expr.name or f"select_{len(self.variables)}", decision.decision, decision.meta_info)

    def _execute_separate_reasoning(self, expr: SglSeparateReasoning) -> None:
        """Splits each target's output: the answer stays in its variable and in the text (the reasoning is cut
        out of the text where the output was appended), the reasoning goes to ``<name>_reasoning_content``."""
        # Looked up at each call, as upstream's interpreter does: a patched ReasoningParser is the one used.
        from ..srt import reasoning_parser

        if self.chat_spec:
            self._flush_chat_spec()  # the gens to split are still deferred
        for target in expr.targets:
            raw = self.get_var(target.name)
            parser = reasoning_parser.ReasoningParser(expr.model_type)
            if isinstance(raw, list):  # gen(n=...): one split per sample; the text holds the first
                pairs = [parser.parse_non_stream(r) for r in raw]
                reasoning, answer = [p[0] for p in pairs], [p[1] for p in pairs]
                raw_text, answer_text = raw[0], answer[0]
            else:
                raw_text = str(raw)
                reasoning, answer = parser.parse_non_stream(raw_text)
                answer_text = answer
            at = self.text_.rfind(raw_text)
            if at >= 0:
                with self.cond:
                    self.text_ = self.text_[:at] + answer_text + self.text_[at + len(raw_text):]
                    self.cond.notify_all()
            self._set_var(reasoning_var_name(target.name), reasoning)
            self._set_var(target.name, answer, self.meta_info.get(target.name))

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}")
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self._role_begin("system")
            self._append(self.chat_template.default_system_prompt)
            self._role_end("system")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._append(prefix)
        self.cur_role = role
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but {self.cur_role!r} is open")
        if self.chat_spec:
            self._flush_chat_spec()
        content = self.text_[self.cur_role_begin_pos:]
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._append(suffix)
        if self.cur_images:  # OpenAI's vision format: the text, then the role's images
            content = [{"type": "text", "text": content},
                       *({"type": "image_url", "image_url": {"url": url}} for url in self.cur_images)]
            self.cur_images = []
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None

    def _image(self, expr) -> None:
        self.backend.append_image(self, expr)

    # Forking --------------------------------------------------------------------------------------------------
    def fork(self, n: int, position_ids_offset=None) -> list["StreamExecutor"]:
        self.sync()
        if n > 1 and self.text_ and getattr(self.backend, "fork_hints", True):
            # The fork hint: prefill the shared prefix once, before the branches arrive.
            self.backend.cache_prefix(self.text_)
        branches = []
        for _ in range(n):
            b = StreamExecutor(self.backend, self.arguments, self.default_sampling_para, self.chat_template,
                               self.stream, self.use_thread, self.num_api_spec_tokens)
            b.text_ = self.text_
            b.messages_ = [dict(m) for m in self.messages_]
            b.images_ = list(self.images_)
            b.variables = dict(self.variables)
            b.meta_info = dict(self.meta_info)
            for k in self.variables:
                b.variable_event.setdefault(k, threading.Event()).set()
            b.cur_images = list(self.cur_images)
            b.cur_role = self.cur_role
            b.cur_role_begin_pos = self.cur_role_begin_pos
            branches.append(b)
        return branches


class ProgramState(RoleBlocks):
    """The ``s`` a program writes to."""

    def __init__(self, executor: StreamExecutor):
        self.stream_executor = executor

    # Writing
    def __iadd__(self, other):
        self.stream_executor.submit(_to_expr(other))
        return self

    def __add__(self, other):  # s + x builds an expression, as upstream (rarely used)
        raise TypeError("use s += ... to append to a program state")

    def fork(self, size: int = 1, position_ids_offset=None) -> "ProgramStateGroup":
        branches = self.stream_executor.fork(size, position_ids_offset)
        return ProgramStateGroup([ProgramState(b) for b in branches], self)

    def var_scope(self, name: str):
        return BlockScope(self, SglVarScopeBegin(name), SglVarScopeEnd(name))

    # Reading
    def __getitem__(self, name: str):
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value) -> None:
        self.stream_executor.sync()
        self.stream_executor._set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.stream_executor.sync()
        return name in self.stream_executor.variables

    def get_var(self, name: str):
        return self.stream_executor.get_var(name)

    def get_meta_info(self, name: str):
        return self.stream_executor.get_meta_info(name)

    def set_var(self, name: str, value) -> None:
        self[name] = value

    def sync(self) -> "ProgramState":
        self.stream_executor.sync()
        return self

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict]:
        self.sync()
        return self.stream_executor.messages_

    def error(self):
        return self.stream_executor.error

    @property
    def variables(self) -> dict:
        self.sync()
        return self.stream_executor.variables

    def text_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> Iterator:
        """Streams text as it is produced: the whole state's text, or one variable's. ``return_meta_data`` (with a
        variable, as upstream's): (piece, meta) pairs whose meta holds the logprob entries new since the last
        piece and ``output_token_logprobs_length``, the running count (``completion_tokens`` is cumulative)."""
        ex = self.stream_executor
        sent = 0
        if var_name is not None and var_name not in ex.variable_event:
            raise KeyError(f"variable {var_name!r} is never generated by this program")
        if return_meta_data and var_name is None:
            raise ValueError("return_meta_data=True streams one variable: pass its name")
        chunks = _ChunkMeta()
        while True:
            with ex.cond:
                while True:
                    meta = None
                    if var_name is None:
                        current, done = ex.text_, ex.finished or ex.error is not None
                    elif var_name in ex.variables:
                        current, done, meta = str(ex.variables[var_name]), True, ex.meta_info.get(var_name)
                    else:
                        current, done = ex.partial_vars.get(var_name, ""), ex.finished or ex.error is not None
                        meta = ex.partial_meta.get(var_name)
                    if len(current) > sent or done:
                        break
                    ex.cond.wait(timeout=0.5)
            if len(current) > sent:
                yield (current[sent:], chunks.next(meta)) if return_meta_data else current[sent:]
                sent = len(current)
            if done:
                if ex.error is not None:
                    raise ProgramError(f"program failed: {ex.error}") from ex.error
                return

    def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False):
        return iterate_in_thread(self.text_iter(var_name, return_meta_data))

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class _ChunkMeta:
    """Per streamed piece, the variable's meta with only the output logprob entries not yet reported (the
    backends' stream metas carry cumulative lists) and their running count, as upstream's incremental stream."""

    def __init__(self):
        self.reported = 0

    def next(self, meta: dict | None) -> dict:
        meta = dict(meta or {})
        entries = meta.get("output_token_logprobs") or []
        meta["output_token_logprobs_length"] = len(entries)
        meta["output_token_logprobs"] = entries[self.reported:]
        if "output_top_logprobs" in meta:
            meta["output_top_logprobs"] = (meta["output_top_logprobs"] or [])[self.reported:]
        self.reported = len(entries)
        return meta


class ProgramStateGroup:
    """The branches of ``s.fork(n)``: index them, iterate them, ``+=`` to all, ``join()`` them."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __setitem__(self, i, value):
        if value is not self.states[i]:
            raise TypeError("assign to a fork branch with +=, e.g. forks[i] += ...")

    def __iadd__(self, other):
        if callable(other) and not isinstance(other, SglExpr):
            # forks += lambda i: ...: branch i gets what the function returns for i (upstream's form).
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for s, o in zip(self.states, other):
                s += o
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Waits for every branch. ``gather_variable``: each variable a branch produced becomes a list in the
        parent (one entry per branch). ``concate_and_append``: the branches' new text is appended to the
        parent in order."""
        errors = []
        for s in self.states:
            s.stream_executor.end()
            try:
                s.stream_executor.sync()
            except ProgramError as e:
                errors.append(e)
        if errors:
            raise ProgramError(f"{len(errors)} of {len(self.states)} fork branches failed: {errors[0]}") from errors[0]
        src = self.src_state.stream_executor
        src.sync()
        if mode == "gather_variable":
            names = []
            for s in self.states:
                for k in s.stream_executor.variables:
                    if k not in src.variables and k not in names:
                        names.append(k)
            for k in names:
                src._set_var(k, [s.stream_executor.variables.get(k) for s in self.states],
                             [s.stream_executor.meta_info.get(k) for s in self.states])
        elif mode == "concate_and_append":
            base = len(src.text_)
            for s in self.states:
                src._append(s.stream_executor.text_[base:])
        else:
            raise ValueError(f"unknown join mode {mode!r}")


def run_program(program, backend, func_args, func_kwargs, default_sampling_para, stream=False, use_thread=True):
    if backend is None:
        raise ValueError("no backend: call set_default_backend(...) or pass backend=...")
    executor = StreamExecutor(backend, func_kwargs, default_sampling_para, None, stream, use_thread,
                              program.num_api_spec_tokens)
    state = ProgramState(executor)
    if stream:
        def body():
            try:
                program.func(state, *func_args, **func_kwargs)
            except BaseException as e:  # noqa: BLE001
                executor.error = executor.error or e
            finally:
                executor.end()

        threading.Thread(target=body, daemon=True).start()
        return state
    try:
        program.func(state, *func_args, **func_kwargs)
    finally:
        executor.end()
    try:
        executor.sync()
    except ProgramError:
        pass  # the caller sees it when reading the state (state.error() / state[...] / state.text())
    return state
