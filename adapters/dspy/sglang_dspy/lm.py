"""SGLangLM: a dspy.BaseLM over the in-process Engine or an sglang_backend HTTP server.

DSPy 3.4 runs a BaseLM subclass through ``forward``/``aforward`` (the 3.4 "legacy" contract, wrapped by
``dspy.clients.engines.legacy_engine.LegacyEngine``): DSPy passes the rendered OpenAI-style ``messages``
and the per-call kwargs, and expects an OpenAI-shaped chat completion back. That contract is the one that
still hands the LM ``n`` (canonical lm15 engines get one candidate per call, which would rule out the
shared-prefix ``n`` batch), so it is the one used here. DSPy does not cache custom BaseLM subclasses'
calls (``cache`` is accepted and kept in the state for API compatibility).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from typing import Any

from dspy.clients.base_lm import BaseLM
from dspy.utils.exceptions import ContextWindowExceededError

# DSPy 3.4 warns once per call site that forward()-based LMs are deprecated for 3.5; the adapter is that
# plugin on purpose (see the module docstring), so the user should not see the warning for it.
warnings.filterwarnings("ignore", message=r".*forward\(\).*", category=DeprecationWarning, module=r"dspy\..*")
warnings.filterwarnings("ignore", message=r".*[Ll]egacy.*", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=r".*OpenAI-style messages.*", category=DeprecationWarning)

_ENGINES: dict[str, Any] = {}
_ENGINES_LOCK = threading.Lock()
_MIN_HINT_TOKENS = 8


def _shared_engine(model_path: str | None, engine_kwargs: dict) -> Any:
    """One in-process Engine per (model_path, kwargs) for the whole process: copies, load_state and several
    SGLangLM objects over the same model share one scheduler and one radix cache."""
    key = json.dumps([model_path, engine_kwargs], sort_keys=True, default=str)
    with _ENGINES_LOCK:
        eng = _ENGINES.get(key)
        if eng is None:
            from sglang_backend import Engine

            eng = Engine(model_path=model_path, **engine_kwargs)
            _ENGINES[key] = eng
        return eng


# Schema handling -----------------------------------------------------------------------------------------------
def response_format_to_schema(response_format: Any) -> dict | None:
    """OpenAI/DSPy response_format -> a JSON schema dict (None for plain text)."""
    if response_format is None:
        return None
    try:
        from pydantic import BaseModel

        if isinstance(response_format, type) and issubclass(response_format, BaseModel):
            return response_format.model_json_schema()
    except Exception:  # pragma: no cover - pydantic always present with dspy
        pass
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind == "json_schema":
            js = response_format.get("json_schema") or {}
            return js.get("schema", js) if isinstance(js, dict) else None
        if kind == "json_object":
            return {"type": "object"}
        if kind in (None, "text"):
            return None
        if "properties" in response_format or "$defs" in response_format:
            return response_format
    return None


def bound_schema(schema: Any, max_string_length: int | None, max_items: int | None) -> Any:
    """Adds maxLength / maxItems where a schema leaves them open, so a constrained output fits max_tokens."""
    if isinstance(schema, list):
        return [bound_schema(s, max_string_length, max_items) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_schema(v, max_string_length, max_items) for k, v in schema.items()}
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if max_string_length and "string" in types and not any(k in out for k in ("maxLength", "enum", "const", "format", "pattern")):
        out["maxLength"] = max_string_length
    if max_items and "array" in types and "maxItems" not in out:
        out["maxItems"] = max_items
    return out


# Logprobs / usage ----------------------------------------------------------------------------------------------
def _openai_logprobs(meta: dict) -> dict:
    content = []
    tops = meta.get("output_top_logprobs") or []
    for i, item in enumerate(meta.get("output_token_logprobs") or []):
        lp, tid, text = (list(item) + [None, None, None])[:3]
        entry = {"token": text if text is not None else str(tid), "logprob": lp, "bytes": None, "top_logprobs": []}
        if i < len(tops) and tops[i]:
            entry["top_logprobs"] = [{"token": t[2] if len(t) > 2 and t[2] is not None else str(t[1]),
                                      "logprob": t[0], "bytes": None} for t in tops[i]]
        content.append(entry)
    return {"content": content}


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "cache_read_input_tokens": cached}


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


# Hint bookkeeping ----------------------------------------------------------------------------------------------
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


def _split_prefix(messages: list[dict]) -> list[dict]:
    """The part of a DSPy adapter's messages that every call of the same predictor shares: everything
    before the final user turn (system instructions + few-shot demo turns)."""
    if len(messages) < 2:
        return []
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
    return messages[:last_user]


def _plain_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
        out.append({"role": m.get("role", "user"), "content": content if content is not None else ""})
    return out


# Backends ------------------------------------------------------------------------------------------------------
class _EngineBackend:
    def __init__(self, engine):
        self.engine = engine
        self.tok = engine.tokenizer
        self.hints = _HintRegistry()

    def _ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.tok.encode(text, add_special_tokens=False)

    def context_len(self) -> int:
        return int(self.engine.context_len)

    def hint_ids(self, ids: list[int]) -> None:
        self.engine.generate(input_ids=list(ids), sampling_params={"max_new_tokens": 0})

    def complete(self, lm: "SGLangLM", messages, sp: dict, n: int, logprobs: bool, top: int, prefix_hints: bool):
        ids = self._ids(messages, True)
        want = sp.get("max_new_tokens") or 0
        if len(ids) + want > self.context_len():
            raise ContextWindowExceededError(model=lm.model, message=(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({want}) exceeds the context length "
                f"({self.context_len()})"))
        hinted_prefix = 0
        if prefix_hints:
            prefix = _split_prefix(messages)
            if prefix:
                p_ids = self._ids(prefix, False)
                common = 0
                for a, b in zip(p_ids, ids):
                    if a != b:
                        break
                    common += 1
                if common >= _MIN_HINT_TOKENS and common < len(ids):
                    key = hashlib.sha1(json.dumps(ids[:common]).encode()).hexdigest()
                    self.hints.run_once(key, lambda: self.hint_ids(ids[:common]))
                    hinted_prefix = common
            if n > 1:  # fork: the whole prompt once, then n branches that all hit it
                key = hashlib.sha1(json.dumps(ids).encode()).hexdigest()
                self.hints.run_once(key, lambda: self.hint_ids(ids))
        try:
            if n > 1:
                outs = self.engine.generate(input_ids=[ids] * n, sampling_params=[dict(sp) for _ in range(n)],
                                            return_logprob=logprobs, top_logprobs_num=top if logprobs else 0,
                                            return_text_in_logprobs=True)
            else:
                outs = [self.engine.generate(input_ids=ids, sampling_params=sp, return_logprob=logprobs,
                                             top_logprobs_num=top if logprobs else 0, return_text_in_logprobs=True)]
        except ValueError as e:
            if _is_context_error(str(e)):
                raise ContextWindowExceededError(model=lm.model, message=str(e)) from e
            raise
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            fr = meta.get("finish_reason")
            fr = fr.get("type") if isinstance(fr, dict) else fr
            choices.append({"index": i, "message": {"role": "assistant", "content": out["text"]},
                            "finish_reason": "length" if fr == "length" else "stop",
                            "logprobs": _openai_logprobs(meta) if logprobs else None})
        if hinted_prefix and outs and outs[0]["meta_info"].get("cached_tokens", 0) < hinted_prefix // 2:
            # The prefix was evicted (or the cache flushed) since it was hinted: hint again next time.
            self.hints.forget(hashlib.sha1(json.dumps(ids[:hinted_prefix]).encode()).hexdigest())
        # OpenAI's convention (and our server's): the prompt is counted once for n choices.
        usage = _usage(outs[0]["meta_info"]["prompt_tokens"], sum(o["meta_info"]["completion_tokens"] for o in outs),
                       outs[0]["meta_info"].get("cached_tokens", 0))
        usage["branch_cached_tokens"] = [o["meta_info"].get("cached_tokens", 0) for o in outs]
        return choices, usage

    def stats(self) -> dict:
        return self.engine.get_stats()

    def flush(self) -> None:
        self.engine.flush_cache()
        self.hints.clear()


class _HTTPBackend:
    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        import httpx

        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)
        self.hints = _HintRegistry()
        self._ctx: int | None = None

    def _post(self, lm, path: str, body: dict) -> dict:
        r = self.client.post(path, json=body)
        if r.status_code >= 400:
            try:
                msg = r.json().get("error", {}).get("message") or r.text
            except Exception:
                msg = r.text
            if r.status_code == 400 and _is_context_error(str(msg)):
                raise ContextWindowExceededError(model=lm.model, message=str(msg))
            raise RuntimeError(f"sglang server {path} -> {r.status_code}: {msg}")
        return r.json()

    def context_len(self) -> int | None:
        if self._ctx is None:
            try:
                info = self.client.get("/get_model_info").json()
                self._ctx = int(info.get("context_len") or info.get("context_length") or 0) or None
            except Exception:
                self._ctx = None
        return self._ctx

    def _hint(self, lm, messages: list[dict]) -> None:
        # The chat template lives on the server: a 1-token chat call over the shared messages caches their
        # rendering (continue_final_message keeps a trailing demo answer open, as in the full prompt).
        cont = messages[-1]["role"] == "assistant"
        self._post(lm, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0,
                                                "continue_final_message": cont})

    def complete(self, lm: "SGLangLM", messages, sp: dict, n: int, logprobs: bool, top: int, prefix_hints: bool):
        if prefix_hints:
            prefix = _split_prefix(messages)
            if prefix and sum(len(m["content"]) for m in prefix) >= 4 * _MIN_HINT_TOKENS:
                key = hashlib.sha1(json.dumps(prefix, sort_keys=True).encode()).hexdigest()
                self.hints.run_once(key, lambda: self._hint(lm, prefix))
            if n > 1:
                key = hashlib.sha1(json.dumps(["full", messages], sort_keys=True).encode()).hexdigest()
                self.hints.run_once(key, lambda: self._post(lm, "/v1/chat/completions", {
                    "messages": messages, "max_tokens": 1, "temperature": 0}))
        body: dict[str, Any] = {"messages": messages, "n": n}
        if sp.get("max_new_tokens") is not None:
            body["max_tokens"] = sp["max_new_tokens"]
        for k in ("temperature", "top_p", "top_k", "min_p", "stop", "seed", "frequency_penalty", "presence_penalty"):
            if sp.get(k) is not None:
                body[k] = sp[k]
        if "json_schema" in sp:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": json.loads(sp["json_schema"])}}
        if "regex" in sp:
            body["regex"] = sp["regex"]
        if logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = top
        resp = self._post(lm, "/v1/chat/completions", body)
        u = resp.get("usage") or {}
        cached = ((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        usage = _usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0), cached)
        choices = [{"index": c.get("index", i), "message": {"role": "assistant", "content": c["message"]["content"]},
                    "finish_reason": c.get("finish_reason"), "logprobs": c.get("logprobs")}
                   for i, c in enumerate(resp.get("choices", []))]
        return choices, usage

    def stats(self) -> dict:
        r = self.client.get("/get_stats")
        r.raise_for_status()
        return r.json()

    def flush(self) -> None:
        self.client.post("/flush_cache")
        self.hints.clear()


# The LM ----------------------------------------------------------------------------------------------------------
_PASSTHROUGH = ("top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty")


class SGLangLM(BaseLM):
    """A DSPy LM backed by sglang_backend.

    ``SGLangLM()`` / ``SGLangLM(model_path=...)``: in-process Engine (``None`` = the embedded SmolLM2).
    ``SGLangLM(base_url="http://host:port", api_key=...)``: a running ``sglang-backend serve``.
    Usual DSPy keywords: ``temperature``, ``max_tokens``, ``cache``, ``num_retries``, ``callbacks`` and any
    default request kwargs (``top_p``, ``stop``, ``n``, ``logprobs``...).
    Adapter options: ``prefix_hints`` (send shared prefixes first, default True), ``max_string_length`` /
    ``max_items`` (bounds added to open string/array fields of structured-output schemas),
    ``engine_kwargs`` (ServerArgs for the in-process engine), ``engine`` (an existing Engine to share).
    """

    def __init__(self, model_path: str | None = None, base_url: str | None = None, *, api_key: str | None = None,
                 model: str | None = None, model_type: str = "chat", temperature: float | None = 0.0,
                 max_tokens: int | None = 256, cache: bool = False, num_retries: int = 0, callbacks=None,
                 prefix_hints: bool = True, max_string_length: int | None = None, max_items: int | None = None,
                 engine_kwargs: dict | None = None, engine: Any = None, timeout: float = 600.0, **kwargs):
        if model_type != "chat":
            raise ValueError("SGLangLM supports model_type='chat' only")
        if model_path is not None and base_url is not None:
            raise ValueError("give model_path (in-process engine) or base_url (server), not both")
        self.model_path = model_path
        self.base_url = base_url
        self.api_key = api_key
        self.prefix_hints = prefix_hints
        self.max_string_length = max_string_length
        self.max_items = max_items
        self.engine_kwargs = dict(engine_kwargs or {})
        self.timeout = timeout
        name = model or ("sglang/" + (base_url or model_path or "embedded-smollm2-135m-instruct"))
        super().__init__(model=name, model_type=model_type, temperature=temperature, max_tokens=max_tokens,
                         cache=cache, callbacks=callbacks, num_retries=num_retries, **kwargs)
        if base_url is not None:
            self._backend = _HTTPBackend(base_url, api_key, timeout)
        else:
            self._backend = _EngineBackend(engine if engine is not None else
                                           _shared_engine(model_path, self.engine_kwargs))

    # Capabilities that DSPy's adapters consult --------------------------------------------------------------
    @property
    def supports_response_schema(self) -> bool:
        return True

    @property
    def supports_function_calling(self) -> bool:
        return False

    @property
    def supported_params(self) -> set[str]:
        return {"response_format", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "n",
                "logprobs", "top_logprobs", "seed", "frequency_penalty", "presence_penalty", "regex", "json_schema"}

    # Runtime helpers ---------------------------------------------------------------------------------------------
    @property
    def engine(self):
        return getattr(self._backend, "engine", None)

    def get_stats(self) -> dict:
        return self._backend.stats()

    def flush_cache(self) -> None:
        """Empties the runtime's radix cache and forgets which prefixes were hinted."""
        self._backend.flush()

    @property
    def hints_sent(self) -> int:
        return self._backend.hints.sent

    # DSPy contract ----------------------------------------------------------------------------------------------
    def _sampling(self, kw: dict) -> tuple[dict, int, bool, int]:
        sp: dict[str, Any] = {}
        max_tokens = kw.get("max_completion_tokens") or kw.get("max_tokens")
        if max_tokens is not None:
            sp["max_new_tokens"] = int(max_tokens)
        if kw.get("temperature") is not None:
            sp["temperature"] = float(kw["temperature"])
        for k in _PASSTHROUGH:
            if kw.get(k) is not None:
                sp[k] = kw[k]
        stop = kw.get("stop")
        if stop:
            sp["stop"] = [stop] if isinstance(stop, str) else list(stop)
        schema = response_format_to_schema(kw.get("response_format"))
        if kw.get("json_schema") is not None:
            js = kw["json_schema"]
            schema = json.loads(js) if isinstance(js, str) else js
        if schema is not None:
            schema = bound_schema(schema, self.max_string_length, self.max_items)
            sp["json_schema"] = json.dumps(schema)
        elif kw.get("regex"):
            sp["regex"] = kw["regex"]
        n = int(kw.get("n") or kw.get("num_generations") or 1)
        logprobs = bool(kw.get("logprobs"))
        top = int(kw.get("top_logprobs") or 0)
        return sp, n, logprobs, top

    def forward(self, prompt=None, messages=None, **kwargs):
        kw = {**self.kwargs, **kwargs}
        if kw.get("tools"):
            raise NotImplementedError("SGLangLM does not do native function calling; use ChatAdapter/JSONAdapter "
                                      "with use_native_function_calling=False")
        messages = _plain_messages(messages or [{"role": "user", "content": prompt or ""}])
        sp, n, logprobs, top = self._sampling(kw)
        choices, usage = self._backend.complete(self, messages, sp, n, logprobs, top, self.prefix_hints)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "choices": choices, "usage": usage}

    async def aforward(self, prompt=None, messages=None, **kwargs):
        return await asyncio.to_thread(self.forward, prompt, messages, **kwargs)

    # State ---------------------------------------------------------------------------------------------------------
    def dump_state(self) -> dict[str, Any]:
        state = super().dump_state()
        state.update(model_path=self.model_path, base_url=self.base_url, prefix_hints=self.prefix_hints,
                     max_string_length=self.max_string_length, max_items=self.max_items,
                     engine_kwargs=copy.deepcopy(self.engine_kwargs), timeout=self.timeout)
        state.pop("api_key", None)
        return state

    @classmethod
    def load_state(cls, state: dict[str, Any], *, allow_custom_lm_class: bool = False, api_key: str | None = None):
        from dspy.clients.base_lm import LM_CLASS_STATE_KEY

        state = {k: v for k, v in state.items() if k != LM_CLASS_STATE_KEY}
        return cls(api_key=api_key, **state)
