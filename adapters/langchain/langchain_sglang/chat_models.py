"""``ChatSGLang``: a LangChain chat model over sglang_backend.

Two transports, one request shape:

* in-process: ``ChatSGLang(model_path=...)`` (``None`` with no ``base_url`` = the embedded SmolLM2) drives an
  ``sglang_backend.Engine`` directly (engines are shared per model path inside the process);
* server: ``ChatSGLang(base_url="http://host:port")`` talks to our OpenAI-compatible ``/v1/chat/completions``
  (with its extra-body ``regex`` / ``json_schema`` constraints).

What LangChain features compile into on our runtime:

* tool calling -> tools described in the system turn; when a call is required (``tool_choice`` "any",
  "required", True or a tool name) the output is constrained by a JSON schema over
  ``{"name": <tool>, "arguments": <that tool's parameters>}`` so the model always emits a valid call;
* ``with_structured_output`` (json_schema, function_calling, json_mode) -> JSON-schema constrained decoding,
  so the output always parses;
* an output parser's JSON format instructions in the prompt (``prompt | llm | PydanticOutputParser``) -> the same
  constraint, with no structured-output call in user code (``format_instructions``);
* ``batch``/``abatch`` -> the inputs' common prefix is sent first with ``max_new_tokens=0`` (a fork hint) so it is
  prefilled once and every branch reuses it from the radix cache; concurrent branches over one prompt
  (``RunnableParallel``) share it through the radix cache and the scheduler's in-batch prefix dedup.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from operator import itemgetter
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import (
    BaseChatModel,
    LangSmithParams,
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough, ensure_config
from langchain_core.utils import secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from .format_instructions import schema_in_format_instructions

# Strings and arrays without bounds get these caps inside *constraints* (never in what the user sees as the
# schema): a small model can otherwise loop inside one string until the token budget ends and the JSON is cut.
CONSTRAINED_MAX_STRING = 200
CONSTRAINED_MAX_ITEMS = 16
CONSTRAINED_MIN_TOKENS = 256
TOOL_CALL_WHITESPACE = r"[ ]?"

_ENGINES: dict[str, Any] = {}
_ENGINES_LOCK = threading.Lock()


def get_engine(model_path: str | None = None, **engine_kwargs):
    """One in-process Engine per model path (loading a model per ChatSGLang instance would waste memory)."""
    key = model_path or "<embedded>"
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            # deferred: the Engine imports torch, which HTTP-only use never needs
            from sglang_backend import Engine

            _ENGINES[key] = Engine(model_path=model_path, **engine_kwargs)
        return _ENGINES[key]


def register_engine(engine: Any, model_path: str | None = None) -> None:
    """Makes ``ChatSGLang(model_path=model_path)`` use an Engine the caller already built."""
    with _ENGINES_LOCK:
        _ENGINES[model_path or "<embedded>"] = engine


def unregister_engine(model_path: str | None = None) -> None:
    with _ENGINES_LOCK:
        _ENGINES.pop(model_path or "<embedded>", None)


# Schemas ---------------------------------------------------------------------------------------------------------
def _bounded(schema: Any, max_string: int | None = CONSTRAINED_MAX_STRING) -> Any:
    """A copy of ``schema`` with unbounded strings/arrays capped (see CONSTRAINED_MAX_*)."""
    if not max_string:
        return schema
    if isinstance(schema, list):
        return [_bounded(s, max_string) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_bounded(v, max_string) if k not in ("enum", "const", "default", "examples") else v)
           for k, v in schema.items()}
    t = out.get("type")
    types = t if isinstance(t, list) else [t]
    if "string" in types and not any(k in out for k in ("maxLength", "enum", "const", "pattern", "format")):
        out["maxLength"] = max(max_string, out.get("minLength", 0))
    if "array" in types and "maxItems" not in out:
        out["maxItems"] = max(CONSTRAINED_MAX_ITEMS, out.get("minItems", 0))
    return out


def _tool_spec(tool: Any) -> dict:
    """Any LangChain tool form -> {"name", "description", "parameters"}."""
    fn = convert_to_openai_tool(tool)["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    params = dict(params)
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {"name": fn["name"], "description": fn.get("description", ""), "parameters": params}


def _call_schema(specs: list[dict], max_string: int | None) -> dict:
    """JSON schema of one tool call to any of ``specs``."""
    def closed(params: dict) -> dict:
        # Arguments are the declared parameters only (a call to a tool without parameters is ``{}``).
        return {"additionalProperties": False, **params}

    options = [{"type": "object",
                "properties": {"name": {"const": s["name"]},
                               "arguments": _bounded(closed(s["parameters"]), max_string)},
                "required": ["name", "arguments"], "additionalProperties": False} for s in specs]
    return options[0] if len(options) == 1 else {"anyOf": options}


_PROMPT_DROP = {"title", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
                "pattern", "minItems", "maxItems", "additionalProperties", "multipleOf", "format"}


def _prompt_schema(schema: Any) -> Any:
    """The parameters as shown to the model: names, types, descriptions, enums. Validation keywords stay in
    the constraint only (a small model tends to copy numbers it sees in them, e.g. a bound of 1000)."""
    if isinstance(schema, list):
        return [_prompt_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: (v if k in ("enum", "const", "required", "default") else _prompt_schema(v))
            for k, v in schema.items() if k not in _PROMPT_DROP}


def _tools_prompt(specs: list[dict]) -> str:
    lines = ["You can call these tools:"]
    for s in specs:
        lines.append(json.dumps({"name": s["name"], "description": s["description"],
                                 "parameters": _prompt_schema(s["parameters"])}))
    lines.append('To call a tool, reply with only a JSON object {"name": <tool name>, "arguments": {...}}. '
                 "After a tool result is given, answer the user in plain text.")
    return "\n".join(lines)


def _parse_tool_call(text: str, names: set[str]) -> dict | None:
    s = text.strip()
    if not s.startswith("{"):
        return None
    try:
        obj = json.loads(s)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "args": args, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "tool_call"}


# Messages --------------------------------------------------------------------------------------------------------
def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            kind = block.get("type")
            if kind == "text":
                parts.append(str(block.get("text", "")))
            elif kind in ("tool_use", "tool_call", "function_call", "reasoning", "thinking"):
                continue  # rendered from message.tool_calls / not model input
            else:
                raise ValueError(f"ChatSGLang: unsupported content block type {kind!r} (text-only model)")
    return "".join(parts)


def _to_chat(messages: Sequence[BaseMessage], system_extra: str | None) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text_of(m.content)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": _text_of(m.content)})
        elif isinstance(m, AIMessage):
            text = _text_of(m.content)
            calls = [json.dumps({"name": c["name"], "arguments": c["args"]}) for c in (m.tool_calls or [])]
            out.append({"role": "assistant", "content": "\n".join([t for t in [text, *calls] if t])})
        elif isinstance(m, ToolMessage):
            status = " (error)" if getattr(m, "status", "success") == "error" else ""
            name = f" {m.name}" if m.name else ""
            out.append({"role": "user", "content": f"Tool{name} result{status} for call {m.tool_call_id}: "
                                                   f"{_text_of(m.content)}"})
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": _text_of(m.content)})
        else:
            raise ValueError(f"ChatSGLang: unsupported message type {type(m).__name__}")
    # Merge consecutive same-role turns (some chat templates require alternation).
    merged: list[dict] = []
    for msg in out:
        if merged and merged[-1]["role"] == msg["role"] and msg["role"] != "system":
            merged[-1] = {"role": msg["role"], "content": merged[-1]["content"] + "\n\n" + msg["content"]}
        else:
            merged.append(msg)
    if system_extra:
        if merged and merged[0]["role"] == "system":
            merged[0] = {"role": "system", "content": merged[0]["content"] + "\n\n" + system_extra}
        else:
            merged.insert(0, {"role": "system", "content": system_extra})
    return merged


def _openai_logprobs(meta_info: dict, tokenizer) -> dict:
    """The engine's output logprobs ((logprob, id, text) entries) in OpenAI's chat shape, as the server's OpenAI
    route writes them (each token's own bytes)."""
    # deferred: the server's OpenAI layer (starlette) is loaded only for in-process logprobs
    from sglang_backend.runtime.entrypoints.openai_common import token_entry

    tops = meta_info.get("output_top_logprobs") or []
    content = []
    for i, (logprob, tid, _) in enumerate(meta_info.get("output_token_logprobs") or []):
        alternatives = tops[i] if i < len(tops) and tops[i] else []
        content.append({**token_entry(tokenizer, tid, logprob),
                        "top_logprobs": [token_entry(tokenizer, t, lp) for lp, t, _ in alternatives]})
    return {"content": content}


def _common_prefix(items: list) -> list:
    if not items:
        return []
    n = min(len(x) for x in items)
    k = 0
    while k < n and all(x[k] == items[0][k] for x in items[1:]):
        k += 1
    return items[0][:k]


def _common_str_prefix(texts: list[str]) -> str:
    return os.path.commonprefix(texts) if texts else ""


def _graph_thread_session() -> str | None:
    """The LangGraph thread this call runs in (``configurable.thread_id`` of the enclosing runnable's config), as a
    session id: a graph's steps on one thread are one program whose KV stays pinned between its calls."""
    thread_id = (ensure_config().get("configurable") or {}).get("thread_id")
    return None if thread_id is None else f"lc-thread:{thread_id}"


class _Request(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    messages: list[dict]
    sampling: dict
    model: str
    tool_names: list[str] = []
    force_tool: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    session_id: str | None = None
    whole: bool = False  # streamed as one final chunk (tool calls, structured outputs: they must parse whole)


# The model -------------------------------------------------------------------------------------------------------
class ChatSGLang(BaseChatModel):
    """Chat model over sglang_backend (in-process Engine or an sglang_backend server).

    Example:
        .. code-block:: python

            from langchain_sglang import ChatSGLang

            llm = ChatSGLang(temperature=0, max_tokens=64)                   # embedded SmolLM2, in-process
            llm = ChatSGLang(base_url="http://127.0.0.1:30000", api_key="...")  # our server
            llm.invoke("What is the capital of France?")
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model_name: str = Field(default="default", alias="model")
    """Model name reported in metadata and sent to the server (``default`` = whatever it serves)."""
    base_url: str | None = Field(default_factory=lambda: os.environ.get("SGLANG_BASE_URL"))
    """Server root (``http://host:port``); ``None`` runs the model in-process."""
    model_path: str | None = None
    """In-process model (HF dir, hub id or GGUF); ``None`` = the embedded SmolLM2-135M-Instruct."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("SGLANG_API_KEY", default=None))
    temperature: float | None = None
    max_tokens: int | None = Field(default=None, alias="max_new_tokens")
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    timeout: float | None = None
    """Seconds per request (server transport; in-process requests wait for completion)."""
    max_retries: int = 2
    """Retries of a server request on connection errors and 5xx answers."""
    streaming: bool = False
    n: int = 1
    """Completions per prompt, as ChatOpenAI's ``n``: ``generate`` returns them all, ``invoke`` the first. They are
    sampled in one request, so the prompt is prefilled once. Not with streaming."""
    logprobs: bool | None = None
    """Token logprobs in ``response_metadata["logprobs"]``, in OpenAI's shape (``{"content": [{"token",
    "logprob", "bytes", "top_logprobs"}]}``), as ChatOpenAI reports them."""
    top_logprobs: int | None = None
    """With ``logprobs``: the most likely alternatives per token (0-20)."""
    prefix_hint: bool = True
    """batch/abatch send the inputs' common prefix first (``max_new_tokens=0``) so it is prefilled once."""
    constrained_max_string_length: int | None = CONSTRAINED_MAX_STRING
    """Inside tool-call / structured-output constraints, strings without a ``maxLength`` get this one (so a small
    model cannot loop inside a string past the token budget and cut the JSON); ``None`` disables the cap."""
    constrain_format_instructions: bool = True
    """A prompt carrying a LangChain output parser's JSON format instructions (``PydanticOutputParser``,
    ``JsonOutputParser`` with a model) gets its schema as the generation constraint, so the parser downstream
    always parses (``format_instructions``); explicit constraints, tools and ``response_format`` come first."""
    session_id: str | None = None
    """The program / session these calls belong to: when a call finishes, its KV stays pinned for the session's
    next call (``ServerArgs.session_ttl``; the server's ``/end_session`` or ``Engine.end_session`` releases it).
    Precedence: a call's own ``session_id=`` keyword, then the ``thread_id`` of an enclosing LangGraph run
    (``lc-thread:<id>``: a model shared by several threads keeps them apart), then this field."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra ``Engine(...)`` arguments for the in-process transport."""

    _engine: Any = PrivateAttr(default=None)

    # LangChain plumbing -----------------------------------------------------------------------------------------
    @classmethod
    def from_engine(cls, engine: Any, **kwargs: Any) -> "ChatSGLang":
        """Wraps an existing ``sglang_backend.Engine``."""
        llm = cls(**kwargs)
        llm._engine = engine
        return llm

    @property
    def _llm_type(self) -> str:
        return "sglang"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_sglang", "chat_models"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "SGLANG_API_KEY"}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "base_url": self.base_url, "model_path": self.model_path,
                "temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                "stop": self.stop, "seed": self.seed}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="sglang", ls_model_name=kwargs.get("model", self.model_name),
                                 ls_model_type="chat")
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        ls_stop = stop or kwargs.get("stop") or self.stop
        if ls_stop:
            params["ls_stop"] = list(ls_stop)
        return params

    @property
    def engine(self):
        if self.base_url:
            raise RuntimeError("this ChatSGLang talks to a server (base_url); it has no in-process engine")
        if self._engine is None:
            self._engine = get_engine(self.model_path, **self.engine_kwargs)
        return self._engine

    # Request building ---------------------------------------------------------------------------------------------
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, **kwargs: Any) -> _Request:
        kwargs.pop("ls_structured_output_format", None)
        kwargs.pop("stream_options", None)
        tools = kwargs.pop("tools", None) or []
        tool_choice = kwargs.pop("tool_choice", None)
        response_format = kwargs.pop("response_format", None)
        regex = kwargs.pop("regex", None)
        json_schema = kwargs.pop("json_schema", None)
        model = kwargs.pop("model", None) or self.model_name
        max_tokens = kwargs.pop("max_tokens", kwargs.pop("max_new_tokens", self.max_tokens))
        temperature = kwargs.pop("temperature", self.temperature)
        top_p = kwargs.pop("top_p", self.top_p)
        seed = kwargs.pop("seed", self.seed)
        stops = list(self.stop or []) + list(stop or []) + list(kwargs.pop("stop", None) or [])
        n = int(kwargs.pop("n", None) or self.n)
        logprobs = bool(kwargs.pop("logprobs", self.logprobs))
        top_logprobs = int(kwargs.pop("top_logprobs", None) or self.top_logprobs or 0)
        session_id = kwargs.pop("session_id", None) or _graph_thread_session() or self.session_id
        if n < 1 or not 0 <= top_logprobs <= 20:
            raise ValueError(f"n must be >= 1 (got {n}) and top_logprobs within 0-20 (got {top_logprobs})")

        system_extra = []
        specs = [_tool_spec(t) for t in tools]
        names = [s["name"] for s in specs]
        force = False
        constraint: dict = {}
        if specs and tool_choice not in (None, "auto", "none", False):
            if tool_choice in ("any", "required", True):
                chosen = specs
            else:
                name = tool_choice
                if isinstance(tool_choice, dict):
                    name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
                chosen = [s for s in specs if s["name"] == name]
                if not chosen:
                    raise ValueError(f"tool_choice {tool_choice!r} names no bound tool (bound: {names})")
            # A regex with optional single spaces around separators rather than the default ``": "`` literal:
            # jump-forward then stops before each value, so the model picks its natural " 3" token instead of
            # a digit after a forced space (which a small model gets wrong).
            from sglang_backend.runtime.constrained.json_schema import build_regex_from_schema

            constraint["regex"] = build_regex_from_schema(
                _call_schema(chosen, self.constrained_max_string_length), whitespace=TOOL_CALL_WHITESPACE)
            force = True
        if specs and tool_choice != "none":
            system_extra.append(_tools_prompt(specs))
        if response_format is not None and not force:
            rf = response_format if isinstance(response_format, dict) else dict(response_format)
            if rf.get("type") == "json_schema":
                spec = rf.get("json_schema") or {}
                schema = spec.get("schema", spec)
                system_extra.append("Reply with only a JSON object that follows this JSON schema:\n"
                                    + json.dumps(schema))
                constraint["json_schema"] = json.dumps(_bounded(schema, self.constrained_max_string_length))
            elif rf.get("type") == "json_object":
                constraint["json_schema"] = json.dumps(_bounded(rf.get("schema") or {"type": "object"},
                                                                self.constrained_max_string_length))
                system_extra.append("Reply with only a JSON object.")
        if not constraint:
            if regex is not None:
                constraint["regex"] = regex
            elif json_schema is not None:
                constraint["json_schema"] = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
            elif not specs and self.constrain_format_instructions:
                schema = schema_in_format_instructions(messages, _text_of)
                if schema is not None:
                    constraint["json_schema"] = json.dumps(_bounded(schema, self.constrained_max_string_length))

        sampling: dict[str, Any] = {}
        if max_tokens is not None:
            sampling["max_new_tokens"] = int(max_tokens)
        if constraint:
            # A constrained output cut by the token budget would not parse: give it room to finish.
            sampling["max_new_tokens"] = max(sampling.get("max_new_tokens", 0), CONSTRAINED_MIN_TOKENS)
            sampling.update(constraint)
        if temperature is not None:
            sampling["temperature"] = float(temperature)
        if top_p is not None:
            sampling["top_p"] = float(top_p)
        if seed is not None:
            sampling["seed"] = int(seed)
        if stops and not constraint:
            sampling["stop"] = stops
        for k in ("top_k", "min_p", "frequency_penalty", "presence_penalty", "min_new_tokens", "ignore_eos"):
            if k in kwargs:
                sampling[k] = kwargs.pop(k)
        chat = _to_chat(messages, "\n\n".join(system_extra) if system_extra else None)
        return _Request(messages=chat, sampling=sampling, model=model, tool_names=names, force_tool=force,
                        whole=bool(names) or response_format is not None, n=n, logprobs=logprobs or top_logprobs > 0,
                        top_logprobs=top_logprobs, session_id=session_id)

    # Transports ---------------------------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key is not None:
            h["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
        return h

    def _server_body(self, req: _Request, stream: bool, max_tokens: int | None = None) -> dict:
        sp = dict(req.sampling)
        body: dict[str, Any] = {"messages": req.messages, "stream": stream}
        if req.model and req.model != "default":
            body["model"] = req.model
        mnt = sp.pop("max_new_tokens", None) if max_tokens is None else max_tokens
        if mnt is not None:
            body["max_tokens"] = mnt
        for k in ("temperature", "top_p", "seed", "stop", "regex", "json_schema", "top_k", "min_p",
                  "frequency_penalty", "presence_penalty", "ignore_eos"):
            if k in sp:
                body[k] = sp[k]
        if "min_new_tokens" in sp:
            body["min_tokens"] = sp["min_new_tokens"]
        if req.n > 1:
            body["n"] = req.n
        if req.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = req.top_logprobs
        if req.session_id:
            body["session_id"] = req.session_id
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def _http_timeout(self):
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        return httpx.Timeout(self.timeout if self.timeout is not None else 600.0)

    def _retrying(self, fn: Callable[[], Any]) -> Any:
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        for attempt in range(self.max_retries + 1):
            try:
                return fn()
            except (httpx.TransportError, _Retryable):
                if attempt >= self.max_retries:
                    raise
                time.sleep(min(0.5 * 2 ** attempt, 4.0))

    async def _aretrying(self, fn: Callable[[], Any]) -> Any:
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        for attempt in range(self.max_retries + 1):
            try:
                return await fn()
            except (httpx.TransportError, _Retryable):
                if attempt >= self.max_retries:
                    raise
                await asyncio.sleep(min(0.5 * 2 ** attempt, 4.0))

    @staticmethod
    def _check(resp) -> None:
        if resp.status_code >= 500:
            raise _Retryable(f"server error {resp.status_code}: {resp.text[:500]}")
        if resp.status_code >= 400:
            raise ValueError(f"sglang server rejected the request ({resp.status_code}): {resp.text[:1000]}")

    @staticmethod
    def _meta_from_engine(out: dict) -> dict:
        mi = out.get("meta_info", {})
        fr = mi.get("finish_reason")
        return {"prompt_tokens": mi.get("prompt_tokens", 0), "completion_tokens": mi.get("completion_tokens", 0),
                "cached_tokens": mi.get("cached_tokens", 0),
                "finish_reason": fr.get("type") if isinstance(fr, dict) else fr}

    @staticmethod
    def _meta_from_openai(obj: dict, finish_reason: str | None) -> dict:
        u = obj.get("usage") or {}
        return {"prompt_tokens": u.get("prompt_tokens", 0), "completion_tokens": u.get("completion_tokens", 0),
                "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0,
                "finish_reason": finish_reason}

    @staticmethod
    def _engine_args(req: _Request) -> tuple[dict, dict]:
        """The in-process request's sampling params (``n`` among them) and logprob arguments."""
        sampling = {**req.sampling, "n": req.n} if req.n > 1 else req.sampling
        extra: dict[str, Any] = {"session_id": req.session_id} if req.session_id else {}
        if req.logprobs:
            extra.update(return_logprob=True, top_logprobs_num=req.top_logprobs, return_text_in_logprobs=True)
        return sampling, extra

    def _choices_from_engine(self, out: dict | list[dict], req: _Request) -> list[tuple[str, dict]]:
        """(text, meta) per completion; the usage of the whole request on each, as ChatOpenAI reports ``n``."""
        # deferred: the server's OpenAI layer (starlette) is loaded only for in-process logprobs
        from sglang_backend.runtime.entrypoints.openai_common import without_stop_token

        outs = out if isinstance(out, list) else [out]
        metas = [self._meta_from_engine(o) for o in outs]
        total = sum(m["completion_tokens"] for m in metas)
        for o, m in zip(outs, metas):
            m["completion_tokens"] = total
            if req.logprobs:
                m["logprobs"] = _openai_logprobs(without_stop_token(o)["meta_info"], self.engine.tokenizer)
        return [(o["text"], m) for o, m in zip(outs, metas)]

    def _choices_from_openai(self, obj: dict) -> list[tuple[str, dict]]:
        choices = []
        for choice in obj["choices"]:
            meta = self._meta_from_openai(obj, choice.get("finish_reason"))
            if choice.get("logprobs") is not None:
                meta["logprobs"] = choice["logprobs"]
            choices.append((choice["message"].get("content") or "", meta))
        return choices

    def _complete(self, req: _Request) -> list[tuple[str, dict]]:
        if not self.base_url:
            prompt = self.engine.apply_chat_template(req.messages)
            sampling, extra = self._engine_args(req)
            return self._choices_from_engine(self.engine.generate(prompt, sampling, **extra), req)
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        def call():
            with httpx.Client(timeout=self._http_timeout()) as c:
                r = c.post(self._url("/v1/chat/completions"), json=self._server_body(req, False),
                           headers=self._headers())
                self._check(r)
                return r.json()

        return self._choices_from_openai(self._retrying(call))

    async def _acomplete(self, req: _Request) -> list[tuple[str, dict]]:
        if not self.base_url:
            prompt = self.engine.apply_chat_template(req.messages)
            sampling, extra = self._engine_args(req)
            return self._choices_from_engine(await self.engine.async_generate(prompt, sampling, **extra), req)
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        async def call():
            async with httpx.AsyncClient(timeout=self._http_timeout()) as c:
                r = await c.post(self._url("/v1/chat/completions"), json=self._server_body(req, False),
                                 headers=self._headers())
                self._check(r)
                return r.json()

        return self._choices_from_openai(await self._aretrying(call))

    def _stream_pieces(self, req: _Request) -> Iterator[tuple[str, dict | None]]:
        """(text piece, final meta or None)."""
        if not self.base_url:
            prompt = self.engine.apply_chat_template(req.messages)
            last = None
            for chunk in self.engine.generate(prompt, req.sampling, stream=True, session_id=req.session_id):
                last = chunk
                if chunk.get("text"):
                    yield chunk["text"], None
            yield "", (self._meta_from_engine(last) if last else None)
            return
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        finish, usage_obj = None, {}
        with httpx.Client(timeout=self._http_timeout()) as c:
            with c.stream("POST", self._url("/v1/chat/completions"), json=self._server_body(req, True),
                          headers=self._headers()) as r:
                if r.status_code >= 400:
                    r.read()
                    self._check(r)
                for line in r.iter_lines():
                    piece, finish, usage_obj = self._sse(line, finish, usage_obj)
                    if piece:
                        yield piece, None
        yield "", self._meta_from_openai(usage_obj, finish)

    async def _astream_pieces(self, req: _Request) -> AsyncIterator[tuple[str, dict | None]]:
        if not self.base_url:
            prompt = self.engine.apply_chat_template(req.messages)
            last = None
            async for chunk in await self.engine.async_generate(prompt, req.sampling, stream=True,
                                                                session_id=req.session_id):
                last = chunk
                if chunk.get("text"):
                    yield chunk["text"], None
            yield "", (self._meta_from_engine(last) if last else None)
            return
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        finish, usage_obj = None, {}
        async with httpx.AsyncClient(timeout=self._http_timeout()) as c:
            async with c.stream("POST", self._url("/v1/chat/completions"), json=self._server_body(req, True),
                                headers=self._headers()) as r:
                if r.status_code >= 400:
                    await r.aread()
                    self._check(r)
                async for line in r.aiter_lines():
                    piece, finish, usage_obj = self._sse(line, finish, usage_obj)
                    if piece:
                        yield piece, None
        yield "", self._meta_from_openai(usage_obj, finish)

    @staticmethod
    def _sse(line: str, finish, usage_obj):
        if not line.startswith("data:"):
            return "", finish, usage_obj
        data = line[5:].strip()
        if not data or data == "[DONE]":
            return "", finish, usage_obj
        obj = json.loads(data)
        if obj.get("usage"):
            usage_obj = obj
        piece = ""
        for ch in obj.get("choices") or []:
            piece += (ch.get("delta") or {}).get("content") or ""
            finish = ch.get("finish_reason") or finish
        return piece, finish, usage_obj

    # Results ------------------------------------------------------------------------------------------------------
    @staticmethod
    def _usage(meta: dict) -> UsageMetadata:
        inp, out = int(meta.get("prompt_tokens") or 0), int(meta.get("completion_tokens") or 0)
        return UsageMetadata(input_tokens=inp, output_tokens=out, total_tokens=inp + out,
                             input_token_details={"cache_read": int(meta.get("cached_tokens") or 0)})

    def _message(self, text: str, meta: dict, req: _Request) -> AIMessage:
        call = _parse_tool_call(text, set(req.tool_names)) if req.tool_names else None
        finish = meta.get("finish_reason")
        response_metadata = {"model_name": req.model, "finish_reason": "tool_calls" if call else finish,
                             "model_provider": "sglang"}
        if "logprobs" in meta:
            response_metadata["logprobs"] = meta["logprobs"]
        if call is not None:
            return AIMessage(content="", tool_calls=[call], usage_metadata=self._usage(meta),
                             response_metadata=response_metadata)
        return AIMessage(content=text, usage_metadata=self._usage(meta), response_metadata=response_metadata)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming and not kwargs.get("tools"):
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        req = self._prepare(messages, stop, **kwargs)
        return ChatResult(generations=[ChatGeneration(message=self._message(text, meta, req))
                                       for text, meta in self._complete(req)])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming and not kwargs.get("tools"):
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        req = self._prepare(messages, stop, **kwargs)
        return ChatResult(generations=[ChatGeneration(message=self._message(text, meta, req))
                                       for text, meta in await self._acomplete(req)])

    def _final_chunk(self, text: str, meta: dict | None, req: _Request) -> ChatGenerationChunk:
        meta = meta or {}
        msg = self._message(text, meta, req)
        tool_call_chunks = [{"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i,
                             "type": "tool_call_chunk"} for i, c in enumerate(msg.tool_calls)]
        return ChatGenerationChunk(message=AIMessageChunk(
            content=msg.content if not tool_call_chunks else "", tool_call_chunks=tool_call_chunks,
            usage_metadata=msg.usage_metadata, response_metadata=msg.response_metadata, chunk_position="last"))

    @staticmethod
    def _streamable(req: _Request) -> _Request:
        if req.n > 1:
            raise ValueError(f"n must be 1 when streaming (got n={req.n})")
        return req

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        req = self._streamable(self._prepare(messages, stop, **kwargs))
        if req.whole:  # a tool call / structured output is emitted whole, once it parses
            text, meta = self._complete(req)[0]
            chunk = self._final_chunk(text, meta, req)
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
            return
        for piece, meta in self._stream_pieces(req):
            if meta is None:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            else:
                chunk = ChatGenerationChunk(message=AIMessageChunk(
                    content="", usage_metadata=self._usage(meta), chunk_position="last",
                    response_metadata={"model_name": req.model, "finish_reason": meta.get("finish_reason"),
                                       "model_provider": "sglang"}))
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        req = self._streamable(self._prepare(messages, stop, **kwargs))
        if req.whole:
            text, meta = (await self._acomplete(req))[0]
            chunk = self._final_chunk(text, meta, req)
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
            return
        async for piece, meta in self._astream_pieces(req):
            if meta is None:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            else:
                chunk = ChatGenerationChunk(message=AIMessageChunk(
                    content="", usage_metadata=self._usage(meta), chunk_position="last",
                    response_metadata={"model_name": req.model, "finish_reason": meta.get("finish_reason"),
                                       "model_provider": "sglang"}))
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # Prefix hints for batch ---------------------------------------------------------------------------------------
    def _hint_request(self, inputs: list[LanguageModelInput], kwargs: dict) -> _Request | None:
        if not self.prefix_hint or len(inputs) < 2:
            return None
        try:
            reqs = [self._prepare(self._convert_input(x).to_messages(), None, **dict(kwargs)) for x in inputs]
        except Exception:
            return None
        return _HintSet(reqs)

    def send_prefix_hint(self, inputs: list[LanguageModelInput], **kwargs: Any) -> int:
        """Prefills the inputs' common prompt prefix once (``max_new_tokens=0``); returns its length in chars
        (in-process) or messages (server). Called by batch/abatch; public so callers can pre-warm."""
        hs = self._hint_request(inputs, kwargs)
        if hs is None:
            return 0
        if not self.base_url:
            prefix = _common_str_prefix([self.engine.apply_chat_template(r.messages) for r in hs.reqs])
            if prefix:
                self.engine.generate(prefix, {"max_new_tokens": 0})
            return len(prefix)
        common = _common_prefix([r.messages for r in hs.reqs])
        if not common:
            return 0
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        body = {"messages": common, "max_tokens": 1, "temperature": 0, "continue_final_message": True}
        try:
            with httpx.Client(timeout=self._http_timeout()) as c:
                c.post(self._url("/v1/chat/completions"), json=body, headers=self._headers())
        except httpx.HTTPError:
            return 0  # a hint only
        return len(common)

    async def asend_prefix_hint(self, inputs: list[LanguageModelInput], **kwargs: Any) -> int:
        if not self.base_url:
            return await asyncio.to_thread(self.send_prefix_hint, inputs, **kwargs)
        hs = self._hint_request(inputs, kwargs)
        if hs is None:
            return 0
        common = _common_prefix([r.messages for r in hs.reqs])
        if not common:
            return 0
        import httpx  # optional: only the HTTP backend needs it (not a dependency of sglang_backend)

        body = {"messages": common, "max_tokens": 1, "temperature": 0, "continue_final_message": True}
        try:
            async with httpx.AsyncClient(timeout=self._http_timeout()) as c:
                await c.post(self._url("/v1/chat/completions"), json=body, headers=self._headers())
        except httpx.HTTPError:
            return 0
        return len(common)

    def batch(self, inputs: list[LanguageModelInput], config: Any = None, *, return_exceptions: bool = False,
              **kwargs: Any) -> list[BaseMessage]:
        if inputs:
            self.send_prefix_hint(list(inputs), **kwargs)
        return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)

    async def abatch(self, inputs: list[LanguageModelInput], config: Any = None, *,
                     return_exceptions: bool = False, **kwargs: Any) -> list[BaseMessage]:
        if inputs:
            await self.asend_prefix_hint(list(inputs), **kwargs)
        return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)

    # Tools and structured output ----------------------------------------------------------------------------------
    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict | bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None and tool_choice not in ("auto", "none", "any", "required", True, False):
            name = tool_choice if isinstance(tool_choice, str) else (
                (tool_choice.get("function") or {}).get("name") or tool_choice.get("name"))
            if name not in [f["function"]["name"] for f in formatted]:
                raise ValueError(f"tool_choice {tool_choice!r} names no bound tool")
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: Any = None, *,
                               method: Literal["function_calling", "json_mode", "json_schema"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Every method is compiled to JSON-schema constrained decoding, so outputs always parse."""
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema is required for method='function_calling'")
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": convert_to_json_schema(schema)})
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic else
                                JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method == "json_schema":
            if schema is None:
                raise ValueError("schema is required for method='json_schema'")
            fn = convert_to_openai_tool(schema)["function"]
            json_schema = dict(fn.get("parameters") or {})
            llm = self.bind(response_format={"type": "json_schema",
                                             "json_schema": {"name": fn["name"], "schema": json_schema}},
                            ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                         "schema": convert_to_json_schema(schema)})
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        elif method == "json_mode":
            rf: dict[str, Any] = {"type": "json_object"}
            if schema is not None:
                rf["schema"] = dict(convert_to_openai_tool(schema)["function"].get("parameters") or {})
            llm = self.bind(response_format=rf, ls_structured_output_format={
                "kwargs": {"method": method},
                "schema": convert_to_json_schema(schema) if schema is not None else None})
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"unknown method {method!r}: expected json_schema, function_calling or json_mode")
        if not include_raw:
            return llm | parser
        parser_assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
        with_fallback = parser_assign.with_fallbacks([parser_none], exception_key="parsing_error")
        return RunnableMap(raw=llm) | with_fallback


class _HintSet:
    def __init__(self, reqs: list[_Request]):
        self.reqs = reqs


class _Retryable(Exception):
    pass
