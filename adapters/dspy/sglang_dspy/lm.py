"""SGLangLM: a ``dspy.LM`` whose engine is sglang_backend (in-process Engine or our HTTP server).

DSPy 3.4's engine contract: ``dspy.LM(model, engine=E, async_engine=A)`` where ``E.complete(Request) ->
Response`` and ``await A.complete(Request) -> Response``. DSPy keeps caching, retries, history, usage
tracking and callbacks; the engine runs one attempt. On that contract this module compiles each DSPy call
into the runtime's primitives:

* prefix hints: the system message + few-shot demos that every call of a predictor shares are sent once
  (``max_new_tokens=0``) before the calls that need them, so the radix cache holds them;
* ``n > 1``: DSPy asks a canonical engine for one candidate per ``complete`` call. ``SGLangLM.__call__``
  records ``n`` for the call, and the first ``complete`` runs all ``n`` as one fork (the prompt prefilled
  once, ``n`` branches decoding from it); the following ``complete`` calls of that DSPy call take the
  remaining branches;
* structured output: ``response_format`` schemas, JSONAdapter's field list (where DSPy only says
  ``json_object``) and ChatAdapter's ``[[ ## field ## ]]`` sections become JSON-schema / regex constraints
  (see constraints.py), so the output parses;
* native function calling (``tools``): the tools are described in the system turn and the reply is
  constrained to either a call of a declared tool with its parameters or the ordinary answer.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import dspy
from dspy.clients.base_lm import LM_CLASS_STATE_KEY
from dspy.dsp.utils.settings import main_thread_config
from dspy.utils.callback import BaseCallback
from dspy.lm15 import (
    ContextLengthError,
    InvalidRequestError,
    Message,
    Response,
    ServerError,
    StreamDeltaEvent,
    StreamEndEvent,
    StreamStartEvent,
    TextDelta,
    TextPart,
    TokenLogprob,
    ToolCallPart,
    ToolResultPart,
    TopLogprob,
    UnsupportedFeatureError,
    Usage,
    response_to_events,
)
from sglang_backend import Engine
from sglang_backend.utils import iterate_in_thread

from .constraints import constraint_for, parse_tool_calls, tools_prompt, with_tool_calls

_ENGINES: dict[str, Any] = {}
_ENGINES_LOCK = threading.Lock()
_MIN_HINT_TOKENS = 8
DEFAULT_MODEL_NAME = "sglang/smollm2-135m-instruct"


def _shared_runtime(model_path: str | None, engine_kwargs: dict) -> Any:
    """One in-process Engine per (model_path, kwargs) for the whole process: copies, load_state and several
    SGLangLM objects over the same model share one scheduler and one radix cache."""
    key = json.dumps([model_path, engine_kwargs], sort_keys=True, default=str)
    with _ENGINES_LOCK:
        eng = _ENGINES.get(key)
        if eng is None:
            eng = Engine(model_path=model_path, **engine_kwargs)
            _ENGINES[key] = eng
        return eng


def hit_rate_from_history(history: list[dict]) -> float:
    """sum(cached) / sum(prompt) over lm.history entries' usage (what the calls themselves saw)."""
    prompt = cached = 0
    for entry in history:
        u = entry.get("usage") or {}
        prompt += u.get("prompt_tokens") or 0
        cached += ((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return cached / prompt if prompt else 0.0


def _is_context_error(message: str) -> bool:
    m = message.lower()
    return "context length" in m or "context window" in m or ("exceeds" in m and "token" in m) or "kv cache holds" in m


# One DSPy call's fork: n, and the branches not handed out yet ----------------------------------------------------
@dataclass
class _Fork:
    n: int
    request: Any = None
    pending: list = field(default_factory=list)


_FORK: contextvars.ContextVar[_Fork | None] = contextvars.ContextVar("sglang_dspy_fork", default=None)
# The session the current DSPy call belongs to (SGLangLM.__call__ sets it; the backends send it): the server pins
# the call's KV for the session's next call.
_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("sglang_dspy_session", default=None)


# The run of the outermost DSPy module being called (its callback call id), set by _ProgramRuns.
_RUN: contextvars.ContextVar[str | None] = contextvars.ContextVar("sglang_dspy_run", default=None)


def _program_session() -> str | None:
    """The DSPy program run this call belongs to, as a session id: one call of the outermost module (an agent's
    whole loop, one ``Evaluate`` example), marked by ``_ProgramRuns``. Without that callback (``dspy.configure
    (callbacks=...)`` replaced it): the outermost module on this thread. None outside any module."""
    run = _RUN.get()
    if run is not None:
        return _run_session(run)
    modules = dspy.settings.caller_modules
    return f"dspy:{id(modules[0]):x}:{threading.get_ident():x}" if modules else None


def _run_session(run: str) -> str:
    return f"dspy:{run}"


class _ProgramRuns(BaseCallback):
    """A DSPy callback (installed once, globally, by ``SGLangLM``): each call of an outermost module is one program
    run whose LM calls share one session, and when the run ends its sessions end on the engines they used, so the
    KV pinned for a next call that will not come is released at once (not at its time to live), and the server's
    program scheduling starts the next run afresh."""

    def __init__(self):
        self.tokens: dict[str, contextvars.Token] = {}  # outermost call id -> its _RUN token
        self.backends: dict[str, list] = {}  # session -> the backends that sent calls with it
        self.lock = threading.Lock()

    def on_module_start(self, call_id: str, instance: Any, inputs: dict) -> None:
        if _RUN.get() is None:
            self.tokens[call_id] = _RUN.set(call_id)

    def on_module_end(self, call_id: str, outputs: Any, exception: Exception | None = None) -> None:
        token = self.tokens.pop(call_id, None)
        if token is None:
            return
        _RUN.reset(token)
        session = _run_session(call_id)
        with self.lock:
            backends = self.backends.pop(session, ())
        for backend in backends:
            try:
                backend.end_session(session)
            except Exception:  # noqa: BLE001 - a program's result never fails for a pin released late
                pass

    def __reduce__(self):
        return _program_runs, ()  # one per process: copies and pickles of DSPy's settings refer to it

    def used(self, session: str | None, backend) -> None:
        if session is None or not session.startswith("dspy:") or _RUN.get() is None:
            return
        with self.lock:
            backends = self.backends.setdefault(session, [])
            if backend not in backends:
                backends.append(backend)


_PROGRAM_RUNS = _ProgramRuns()


def _program_runs() -> _ProgramRuns:
    return _PROGRAM_RUNS


def _install_program_runs() -> None:
    """Adds ``_PROGRAM_RUNS`` to DSPy's global callbacks (once; a later ``dspy.configure(callbacks=...)`` drops it).
    Set in the config dict directly: ``dspy.configure`` may be called from one thread only, which need not be the
    one that makes this LM."""
    with dspy.settings.lock:
        callbacks = main_thread_config.get("callbacks") or []
        if _PROGRAM_RUNS not in callbacks:
            main_thread_config["callbacks"] = [*callbacks, _PROGRAM_RUNS]


# Hint bookkeeping ------------------------------------------------------------------------------------------------
class _HintRegistry:
    """Remembers which prefixes were hinted (LRU, bounded) and lets concurrent callers wait for the one hint
    in flight instead of each prefilling the same prefix."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self.done: OrderedDict[str, bool] = OrderedDict()
        self.inflight: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.sent = 0

    def run_once(self, key: str, send) -> bool:
        """Calls send() unless this key was hinted already; returns whether this caller sent it."""
        with self.lock:
            if key in self.done:
                self.done.move_to_end(key)
                return False
            ev = self.inflight.get(key)
            owner = ev is None
            if owner:
                ev = self.inflight[key] = threading.Event()
        if not owner:
            ev.wait(timeout=600)
            return False
        ok = False
        try:
            send()
            ok = True
        finally:
            with self.lock:
                self.inflight.pop(key, None)
                if ok:
                    self.sent += 1
                    self.done[key] = True
                    while len(self.done) > self.capacity:
                        self.done.popitem(last=False)
            ev.set()
        return True

    def forget(self, key: str) -> None:
        with self.lock:
            self.done.pop(key, None)

    def clear(self) -> None:
        with self.lock:
            self.done.clear()


def _key(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _shared_prefix(messages: list[dict]) -> list[dict]:
    """What every call of one predictor shares: everything before the final user turn (system instructions
    + few-shot demo turns)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
    return messages[:last_user]


# Backends: one generation = n branches of one prompt, as plain dicts ------------------------------------------------
@dataclass
class _Branch:
    text: str
    finish: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: tuple | None = None


class _EngineBackend:
    """The in-process Engine: the prompt is rendered and tokenized here, so hints are exact token prefixes."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.tok = runtime.tokenizer
        self.hints = _HintRegistry()

    def _ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.runtime.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.tok.encode(text, add_special_tokens=False)

    def _hint(self, ids: list[int]) -> None:
        self.hints.run_once(_key(ids), lambda: self.runtime.generate(input_ids=list(ids),
                                                                     sampling_params={"max_new_tokens": 0}))

    def _prompt(self, messages: list[dict], sp: dict, hints: bool) -> tuple[list[int], int]:
        """(the prompt's ids, how many of them a prefix hint covers), the hint sent if it helps."""
        ids = self._ids(messages, True)
        want = sp.get("max_new_tokens") or 0
        ctx = int(self.runtime.context_len)
        if len(ids) + want > ctx:
            raise ContextLengthError(f"the prompt ({len(ids)} tokens) plus max_tokens ({want}) exceeds the context "
                                     f"length ({ctx})", provider="sglang")
        hinted = 0
        if hints:
            prefix = _shared_prefix(messages)
            if prefix:
                p_ids = self._ids(prefix, False)
                common = next((i for i, (a, b) in enumerate(zip(p_ids, ids)) if a != b), min(len(p_ids), len(ids)))
                if _MIN_HINT_TOKENS <= common < len(ids):
                    self._hint(ids[:common])
                    hinted = common
        return ids, hinted

    def stream(self, messages: list[dict], sp: dict, hints: bool):
        """The text pieces of one generation as they decode, then its ``_Branch`` (text: the whole reply)."""
        ids, _ = self._prompt(messages, sp, hints)
        try:
            chunks = self.runtime.generate(input_ids=ids, sampling_params=sp, stream=True, session_id=_SESSION.get())
            text, meta = "", {}
            for chunk in chunks:
                meta = chunk["meta_info"]
                if chunk["text"]:
                    text += chunk["text"]
                    yield chunk["text"]
        except ValueError as e:
            if _is_context_error(str(e)):
                raise ContextLengthError(str(e), provider="sglang") from e
            raise InvalidRequestError(str(e), provider="sglang") from e
        fr = meta.get("finish_reason")
        fr = fr.get("type") if isinstance(fr, dict) else fr
        yield _Branch(text, "length" if fr == "length" else "stop", meta.get("prompt_tokens", len(ids)),
                      meta.get("completion_tokens", 0), meta.get("cached_tokens", 0))

    def generate(self, messages: list[dict], sp: dict, n: int, top_logprobs: int | None, hints: bool) -> list[_Branch]:
        ids, hinted = self._prompt(messages, sp, hints)
        if n > 1:  # the fork: the whole prompt once, then n branches that all start from it
            self.runtime.generate(input_ids=list(ids), sampling_params={"max_new_tokens": 0})
        want_lp = top_logprobs is not None
        kw = dict(return_logprob=want_lp, top_logprobs_num=top_logprobs or 0, return_text_in_logprobs=True,
                  session_id=_SESSION.get())
        try:
            if n > 1:
                outs = self.runtime.generate(input_ids=[list(ids)] * n, sampling_params=[dict(sp) for _ in range(n)],
                                             **kw)
            else:
                outs = [self.runtime.generate(input_ids=ids, sampling_params=sp, **kw)]
        except ValueError as e:
            if _is_context_error(str(e)):
                raise ContextLengthError(str(e), provider="sglang") from e
            raise InvalidRequestError(str(e), provider="sglang") from e
        if hinted and outs[0]["meta_info"].get("cached_tokens", 0) < hinted // 2:
            self.hints.forget(_key(ids[:hinted]))  # evicted or flushed since: hint again next time
        branches = []
        for out in outs:
            meta = out["meta_info"]
            fr = meta.get("finish_reason")
            fr = fr.get("type") if isinstance(fr, dict) else fr
            lps = None
            if want_lp:
                tops = meta.get("output_top_logprobs") or []
                lps = tuple(TokenLogprob(token=str(t if t is not None else tid), logprob=float(lp), token_id=tid,
                                         top=tuple(TopLogprob(token=str(x[2] if x[2] is not None else x[1]),
                                                              logprob=float(x[0]), token_id=x[1])
                                                   for x in (tops[i] if i < len(tops) and tops[i] else ())))
                            for i, (lp, tid, t) in enumerate(meta.get("output_token_logprobs") or []))
            branches.append(_Branch(out["text"], "length" if fr == "length" else "stop", meta["prompt_tokens"],
                                    meta["completion_tokens"], meta.get("cached_tokens", 0), lps))
        return branches

    def stats(self) -> dict:
        return self.runtime.get_stats()

    def end_session(self, session_id: str) -> bool:
        return self.runtime.end_session(session_id)

    def flush(self) -> None:
        self.runtime.flush_cache()
        self.hints.clear()


class _HTTPBackend:
    """Our server's OpenAI-compatible chat endpoint (the chat template is applied server-side)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)
        self.hints = _HintRegistry()

    def _post(self, path: str, body: dict) -> dict:
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        try:
            r = self.client.post(path, json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"sglang server unreachable: {e}", provider="sglang") from e
        if r.status_code >= 400:
            self._raise_for(r, path)
        return r.json()

    @staticmethod
    def _raise_for(r, path: str) -> None:
        """The DSPy error for an error reply (400 context overflow, other 4xx, 5xx)."""
        try:
            msg = r.json().get("error", {}).get("message") or r.text
        except Exception:
            msg = r.text
        if r.status_code == 400 and _is_context_error(str(msg)):
            raise ContextLengthError(str(msg), provider="sglang", status=400)
        cls = InvalidRequestError if r.status_code < 500 else ServerError
        raise cls(f"{path}: {msg}", provider="sglang", status=r.status_code)

    def _hint(self, messages: list[dict]) -> None:
        # A 1-token call over the shared messages caches their rendering; continue_final_message keeps a
        # trailing demo answer open, as it is in the full prompt.
        cont = messages[-1]["role"] == "assistant"
        self.hints.run_once(_key(["p", messages]), lambda: self._post("/v1/chat/completions", {
            "messages": messages, "max_tokens": 1, "temperature": 0, "continue_final_message": cont}))

    def _send_hint(self, messages: list[dict], hints: bool) -> None:
        if hints:
            prefix = _shared_prefix(messages)
            if prefix and sum(len(m["content"]) for m in prefix) >= 4 * _MIN_HINT_TOKENS:
                self._hint(prefix)

    def stream(self, messages: list[dict], sp: dict, hints: bool):
        """The text pieces of one generation as the server streams them, then its ``_Branch``."""
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        self._send_hint(messages, hints)
        body = {**self._body(messages, sp, 1, None), "stream": True, "stream_options": {"include_usage": True}}
        text, finish, usage = "", "stop", {}
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    self._raise_for(r, "/v1/chat/completions")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    usage = event.get("usage") or usage
                    for c in event.get("choices") or ():
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            text += piece
                            yield piece
                        if c.get("finish_reason"):
                            finish = "length" if c["finish_reason"] == "length" else "stop"
        except httpx.HTTPError as e:
            raise ServerError(f"sglang server unreachable: {e}", provider="sglang") from e
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        yield _Branch(text, finish, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), cached)

    @staticmethod
    def _body(messages: list[dict], sp: dict, n: int, top_logprobs: int | None) -> dict:
        body: dict[str, Any] = {"messages": messages, "n": n}
        for ours, theirs in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k"), ("stop", "stop"), ("seed", "seed"),
                             ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                             ("regex", "regex")):
            if sp.get(ours) is not None:
                body[theirs] = sp[ours]
        if "json_schema" in sp:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": json.loads(sp["json_schema"])}}
        if top_logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = top_logprobs
        if _SESSION.get() is not None:
            body["session_id"] = _SESSION.get()
        return body

    def generate(self, messages: list[dict], sp: dict, n: int, top_logprobs: int | None, hints: bool) -> list[_Branch]:
        self._send_hint(messages, hints)
        if n > 1:  # the fork: the whole prompt once; the server then runs one request's n branches from it
            self._post("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0})
        resp = self._post("/v1/chat/completions", self._body(messages, sp, n, top_logprobs))
        u = resp.get("usage") or {}
        prompt = u.get("prompt_tokens", 0)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        branches = []
        for c in resp.get("choices", []):
            lps = None
            if top_logprobs is not None:
                lps = tuple(TokenLogprob(token=e["token"], logprob=float(e["logprob"]),
                                         bytes=tuple(e["bytes"]) if e.get("bytes") is not None else None,
                                         top=tuple(TopLogprob(token=t["token"], logprob=float(t["logprob"]))
                                                   for t in e.get("top_logprobs") or ()))
                            for e in (c.get("logprobs") or {}).get("content") or ())
            text = c["message"]["content"] or ""
            # The server counts the prompt once for n choices; each branch reports its own share of output.
            branches.append(_Branch(text, "length" if c.get("finish_reason") == "length" else "stop", prompt,
                                    0, cached, lps))
        if branches:
            branches[0].completion_tokens = u.get("completion_tokens", 0)
        return branches

    def end_session(self, session_id: str) -> bool:
        return bool(self._post("/end_session", {"session_id": session_id}).get("released"))

    def stats(self) -> dict:
        r = self.client.get("/get_stats")
        r.raise_for_status()
        return r.json()

    def flush(self) -> None:
        self.client.post("/flush_cache")
        self.hints.clear()


# The engine DSPy calls -----------------------------------------------------------------------------------------
_SUPPORTED = frozenset({"response_format", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                        "stop", "n", "logprobs", "top_logprobs", "seed", "frequency_penalty", "presence_penalty",
                        "tools", "tool_choice"})


def _text(msg: Message) -> str:
    """A message as the text the chat template gets: tool calls as the JSON the model is asked to write,
    tool results as text."""
    pieces = []
    for p in msg.parts:
        if isinstance(p, TextPart):
            pieces.append(p.text)
        elif isinstance(p, ToolCallPart):
            pieces.append(json.dumps({"tool_calls": [{"name": p.name, "arguments": p.input}]}))
        elif isinstance(p, ToolResultPart):
            body = "".join(getattr(c, "text", "") for c in p.content)
            pieces.append(f"Result of tool {p.name or ''} (call {p.id}){' [error]' if p.is_error else ''}: {body}")
        else:
            raise UnsupportedFeatureError(f"SGLangLM takes text messages only (got a {p.type} part)",
                                          provider="sglang")
    return "".join(pieces)


class SGLangEngine:
    """One attempt of one DSPy call: ``complete(Request) -> Response`` (the DSPy 3.4 engine contract)."""

    supports_response_schema = True
    supports_function_calling = True  # tools described in the system turn, calls constrained to their schemas
    supports_reasoning = False
    supported_params = _SUPPORTED

    def __init__(self, backend, *, prefix_hints: bool = True, constrain: bool = True,
                 max_string_length: int | None = None, max_items: int | None = None):
        self.backend = backend
        self.prefix_hints = prefix_hints
        self.constrain = constrain
        self.max_string_length = max_string_length
        self.max_items = max_items

    def with_options(self, **options) -> "SGLangEngine":
        opts = dict(prefix_hints=self.prefix_hints, constrain=self.constrain,
                    max_string_length=self.max_string_length, max_items=self.max_items)
        opts.update(options)
        return SGLangEngine(self.backend, **opts)

    @staticmethod
    def _tools(request) -> list:
        """The function tools this call may use (none when tool_choice is "none")."""
        choice = request.config.tool_choice
        if choice is not None and choice.mode == "none":
            return []
        if any(t.type != "function" for t in request.tools):
            raise UnsupportedFeatureError("SGLangLM runs function tools only (no provider built-in tools)",
                                          provider="sglang")
        allowed = set(choice.allowed) if choice is not None and choice.allowed else None
        return [t for t in request.tools if allowed is None or t.name in allowed]

    def _messages(self, request) -> list[dict]:
        out = []
        system = None
        if request.system is not None:
            system = request.system if isinstance(request.system, str) else "".join(p.text for p in request.system)
        tools = self._tools(request)
        if tools:
            system = (system + "\n\n" if system else "") + tools_prompt(tools)
        if system is not None:
            out.append({"role": "system", "content": system})
        for m in request.messages:
            role = {"developer": "system", "tool": "user"}.get(m.role, m.role)
            out.append({"role": role, "content": _text(m)})
        return out

    def _sampling(self, request, messages: list[dict]) -> dict:
        c = request.config
        if c.extensions or (c.reasoning is not None and not c.reasoning.is_off) or c.probabilities == "required":
            raise UnsupportedFeatureError("SGLangLM does not take Config.extensions, reasoning or probabilities",
                                          provider="sglang")
        sp: dict[str, Any] = {}
        if c.max_tokens is not None:
            sp["max_new_tokens"] = c.max_tokens
        for k in ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty"):
            if getattr(c, k) is not None:
                sp[k] = getattr(c, k)
        if c.stop:
            sp["stop"] = list(c.stop)
        if self.constrain:
            system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
            last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), None)
            sp.update(constraint_for(system, last_user, c.response_format, self.max_string_length, self.max_items))
            tools = self._tools(request)
            if tools:
                required = c.tool_choice is not None and c.tool_choice.mode == "required"
                answer = {k: sp.pop(k) for k in ("json_schema", "regex") if k in sp}
                sp.update(with_tool_calls(answer, tools, required, self.max_string_length, self.max_items))
        return sp

    def _run(self, request, n: int) -> list[Response]:
        messages = self._messages(request)
        sp = self._sampling(request, messages)
        branches = self.backend.generate(messages, sp, n, request.config.logprobs, self.prefix_hints)
        names = {t.name for t in self._tools(request)}
        out = []
        for b in branches:
            calls = parse_tool_calls(b.text, names) if names else None
            parts = ([ToolCallPart(id=f"call_{uuid.uuid4().hex[:24]}", name=name, input=args) for name, args in calls]
                     if calls else [TextPart(b.text)])
            out.append(Response(id=f"chatcmpl-{uuid.uuid4().hex}", model=request.model,
                                message=Message.assistant(parts), finish_reason="tool_call" if calls else b.finish,
                                usage=Usage(input_tokens=b.prompt_tokens, output_tokens=b.completion_tokens,
                                            cache_read_tokens=b.cached_tokens),
                                logprobs=b.logprobs))
        return out

    def complete(self, request) -> Response:
        fork = _FORK.get()
        if fork is None or fork.n <= 1:
            return self._run(request, 1)[0]
        if fork.request is request and fork.pending:
            return fork.pending.pop(0)
        responses = self._run(request, fork.n)
        fork.request, fork.pending = request, responses[1:]
        return responses[0]

    def stream(self, request):
        """Token pieces as they decode (one text part). Tool calls, logprobs and forks (n > 1) are read whole,
        then replayed as events."""
        fork = _FORK.get()
        if self._tools(request) or request.config.logprobs is not None or (fork is not None and fork.n > 1):
            yield from response_to_events(self.complete(request))
            return
        messages = self._messages(request)
        pieces = self.backend.stream(messages, self._sampling(request, messages), self.prefix_hints)
        yield StreamStartEvent(id=f"chatcmpl-{uuid.uuid4().hex}", model=request.model)
        for piece in pieces:
            if isinstance(piece, _Branch):
                usage = Usage(input_tokens=piece.prompt_tokens, output_tokens=piece.completion_tokens,
                              cache_read_tokens=piece.cached_tokens)
                yield StreamEndEvent(finish_reason=piece.finish, usage=usage)
            else:
                yield StreamDeltaEvent(delta=TextDelta(text=piece, part_index=0))

    def close(self) -> None:
        pass  # the runtime is shared by every SGLangLM over it


class AsyncSGLangEngine:
    """The async twin: the same attempt off the event loop (the runtime batches concurrent calls itself)."""

    def __init__(self, sync: SGLangEngine):
        self.sync = sync

    supports_response_schema = SGLangEngine.supports_response_schema
    supports_function_calling = SGLangEngine.supports_function_calling
    supported_params = SGLangEngine.supported_params

    async def complete(self, request) -> Response:
        return await asyncio.to_thread(self.sync.complete, request)

    async def stream(self, request):
        async for event in iterate_in_thread(self.sync.stream(request)):  # each event as it comes
            yield event

    async def aclose(self) -> None:
        pass


# The LM --------------------------------------------------------------------------------------------------------
_OPTIONS = ("prefix_hints", "constrain", "max_string_length", "max_items")


class SGLangLM(dspy.LM):
    """A DSPy LM backed by sglang_backend.

    ``SGLangLM()`` / ``SGLangLM(model_path=...)``: in-process Engine (``None`` = the embedded SmolLM2).
    ``SGLangLM(base_url="http://host:port", api_key=...)``: a running ``sglang-backend serve``.
    The usual ``dspy.LM`` keywords: ``temperature``, ``max_tokens``, ``cache``, ``num_retries``,
    ``callbacks`` and default request kwargs (``top_p``, ``stop``, ``n``, ``logprobs`` ...).
    Adapter options: ``prefix_hints`` (send shared prefixes first, default True), ``constrain`` (structured
    output and ChatAdapter sections as decoding constraints, default True), ``max_string_length`` /
    ``max_items`` (bounds on open string/array fields so constrained outputs close within max_tokens),
    ``engine_kwargs`` (ServerArgs for the in-process Engine), ``runtime`` (an existing Engine to share).
    Sessions: every call inside a DSPy program is sent with a session id (one per call of the outermost module:
    an agent's whole loop, one ``Evaluate`` example), so the server keeps the program's KV pinned between its calls
    (a ``ReAct`` loop's trajectory while its tool runs) and ends the session when that call returns (a DSPy
    callback, installed once); ``session_id="..."`` fixes one, ``auto_session=False`` sends none.
    """

    def __init__(self, model_path: str | None = None, base_url: str | None = None, *, api_key: str | None = None,
                 model: str | None = None, temperature: float | None = 0.0, max_tokens: int | None = 256,
                 cache: bool = True, num_retries: int = 0, callbacks=None, prefix_hints: bool = True,
                 constrain: bool = True, max_string_length: int | None = None, max_items: int | None = None,
                 engine_kwargs: dict | None = None, runtime: Any = None, timeout: float = 600.0,
                 session_id: str | None = None, auto_session: bool = True, **kwargs):
        if kwargs.pop("model_type", "chat") != "chat":
            raise ValueError("SGLangLM supports model_type='chat' only")
        if model_path is not None and base_url is not None:
            raise ValueError("give model_path (in-process engine) or base_url (server), not both")
        if base_url is not None:
            backend: Any = _HTTPBackend(base_url, api_key, timeout)
        else:
            backend = _EngineBackend(runtime if runtime is not None else
                                     _shared_runtime(model_path, dict(engine_kwargs or {})))
        engine = SGLangEngine(backend, prefix_hints=prefix_hints, constrain=constrain,
                              max_string_length=max_string_length, max_items=max_items)
        super().__init__(model or DEFAULT_MODEL_NAME, model_type="chat", temperature=temperature,
                         max_tokens=max_tokens, cache=cache, callbacks=callbacks, num_retries=num_retries,
                         engine=engine, async_engine=AsyncSGLangEngine(engine), **kwargs)
        self._init_args = dict(model_path=model_path, base_url=base_url, timeout=timeout,
                               engine_kwargs=dict(engine_kwargs or {}))
        self.api_key = api_key
        self.session_id = session_id
        self.auto_session = auto_session
        if auto_session:
            _install_program_runs()

    # n > 1: one fork per DSPy call (see the module docstring) ----------------------------------------------------
    def _fork_for(self, kwargs: dict) -> _Fork | None:
        n = kwargs.get("n", self.kwargs.get("n")) or 1
        return _Fork(n) if isinstance(n, int) and n > 1 else None

    def _session_for(self, kwargs: dict) -> str | None:
        session = kwargs.pop("session_id", None) or self.session_id
        if session is None and self.auto_session:
            session = _program_session()
            _PROGRAM_RUNS.used(session, self._engine_spec.backend)  # ended with its run
        return session

    def __call__(self, prompt=None, *, messages=None, **kwargs):
        session = _SESSION.set(self._session_for(kwargs))
        token = _FORK.set(self._fork_for(kwargs))
        try:
            return super().__call__(prompt, messages=messages, **kwargs)
        finally:
            _FORK.reset(token)
            _SESSION.reset(session)

    async def acall(self, prompt=None, *, messages=None, **kwargs):
        session = _SESSION.set(self._session_for(kwargs))
        token = _FORK.set(self._fork_for(kwargs))
        try:
            return await super().acall(prompt, messages=messages, **kwargs)
        finally:
            _FORK.reset(token)
            _SESSION.reset(session)

    # Options and runtime helpers ----------------------------------------------------------------------------
    @property
    def prefix_hints(self) -> bool:
        return self._engine_spec.prefix_hints

    @property
    def constrain(self) -> bool:
        return self._engine_spec.constrain

    def copy(self, **kwargs):
        options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
        if options:
            engine = self._engine_spec.with_options(**options)
            kwargs.update(engine=engine, async_engine=AsyncSGLangEngine(engine))
        return super().copy(**kwargs)

    @property
    def backend(self):
        return self._engine_spec.backend

    @property
    def runtime(self):
        """The in-process sglang_backend Engine (None for a server)."""
        return getattr(self.backend, "runtime", None)

    def get_stats(self) -> dict:
        return self.backend.stats()

    def flush_cache(self) -> None:
        """Empties the runtime's radix cache and forgets which prefixes were hinted."""
        self.backend.flush()

    @property
    def hints_sent(self) -> int:
        return self.backend.hints.sent

    # State (API keys are never saved) ---------------------------------------------------------------------------
    def dump_state(self) -> dict[str, Any]:
        keep = {k: v for k, v in self.kwargs.items() if k != "api_key"}
        state = {LM_CLASS_STATE_KEY: f"{type(self).__module__}.{type(self).__qualname__}", "model": self.model,
                 "cache": self.cache, "num_retries": self.num_retries, **keep, **self._init_args,
                 **{k: getattr(self._engine_spec, k) for k in _OPTIONS}}
        state.pop("api_key", None)
        return state

    @classmethod
    def load_state(cls, state: dict[str, Any], *, allow_custom_lm_class: bool = False, api_key: str | None = None):
        state = {k: v for k, v in state.items() if k not in (LM_CLASS_STATE_KEY, "model_type")}
        return cls(api_key=api_key, **state)
