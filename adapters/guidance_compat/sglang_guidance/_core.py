"""Guidance-style programs on sglang_backend.

The model value is immutable: ``lm + x`` returns a new model (a fork) and leaves ``lm`` as it was, so
``[lm + gen(...) for _ in range(4)]`` are four branches over one prompt — they share its KV through the radix
cache. Every operation compiles to our primitives on one of our DSL backends (``EngineBackend`` in-process,
``RuntimeEndpoint`` over HTTP): text is appended to the prompt string, ``gen`` is one generate call (stop,
regex, temperature, max tokens), ``json`` one JSON-schema constrained call, ``select`` either our likelihood
ranking (prefix prefilled once, each option scored from the cache) or a regex-constrained generation over the
options (guidance's semantics).
"""

from __future__ import annotations

import contextvars
import functools
import json as _json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from sglang_backend.lang.ir import SglSamplingParams

DEFAULT_MAX_TOKENS = 128

# Active role blocks (``with user(): ...``), innermost last.
_ROLES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("sglang_guidance_roles", default=())


class _PromptState:
    """What our DSL backends read from a program state: the prompt text so far (and its images: none here)."""

    def __init__(self, text: str):
        self.text_ = text
        self.images_: list = []


# Program pieces ----------------------------------------------------------------------------------------------------
class Node:
    """Something a model can be extended with: ``lm + node``. Nodes concatenate with ``+`` (also with str)."""

    def apply(self, lm: "Model") -> "Model":  # pragma: no cover - abstract
        raise NotImplementedError

    def __add__(self, other: Any) -> "Concat":
        return Concat([self, other])

    def __radd__(self, other: Any) -> "Concat":
        return Concat([other, self])


@dataclass
class Concat(Node):
    parts: list

    def apply(self, lm: "Model") -> "Model":
        for p in self.parts:
            lm = lm + p
        return lm

    def __add__(self, other: Any) -> "Concat":
        return Concat([*self.parts, other])

    def __radd__(self, other: Any) -> "Concat":
        return Concat([other, *self.parts])


def _store(captures: dict, name: str | None, value: Any, list_append: bool) -> dict:
    if name is None:
        return captures
    captures = dict(captures)
    if list_append:
        captures[name] = [*captures.get(name, []), value]
    else:
        captures[name] = value
    return captures


@dataclass
class Gen(Node):
    name: str | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    regex: str | None = None
    stop: str | list[str] | None = None
    temperature: float = 0.0
    top_p: float | None = None
    json_schema: str | None = None
    list_append: bool = False
    save_stop_text: bool | str = False

    def apply(self, lm: "Model") -> "Model":
        lm = lm._sync_roles()
        params = SglSamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                   regex=self.regex, json_schema=self.json_schema,
                                   stop=self.stop if self.stop else None)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if lm._role is not None and not self.regex and not self.json_schema:
            # Inside a role block, the turn ends where the chat template ends it.
            params.stop = stops + [s for s in lm._template.stop_str if s not in stops] or None
        text, meta = lm._backend.generate(_PromptState(lm._text), params)
        captures = _store(lm._captures, self.name, text, self.list_append)
        if self.save_stop_text and meta:
            matched = (meta.get("finish_reason") or {}).get("matched") if isinstance(meta.get("finish_reason"), dict) \
                else None
            key = self.save_stop_text if isinstance(self.save_stop_text, str) else f"{self.name}_stop_text"
            captures = _store(captures, key, matched, False)
        return lm._replace(text=lm._text + text, captures=captures,
                           meta=_store(lm._meta, self.name, meta, False))


@dataclass
class Select(Node):
    options: Sequence[str] = ()
    name: str | None = None
    mode: str = "constrained"
    list_append: bool = False
    choices_method: Any = None

    def apply(self, lm: "Model") -> "Model":
        lm = lm._sync_roles()
        options = [str(o) for o in self.options]
        if not options:
            raise ValueError("select needs at least one option")
        if self.mode == "likelihood":
            decision = lm._backend.select(_PromptState(lm._text), options, 0.0, self.choices_method)
            choice, meta = decision.decision, decision.meta_info
        elif self.mode == "constrained":
            # Guidance's semantics: the model decodes greedily under a grammar that admits exactly the options.
            regex = "(" + "|".join(re.escape(o) for o in sorted(options, key=len, reverse=True)) + ")"
            text, meta = lm._backend.generate(_PromptState(lm._text),
                                              SglSamplingParams(max_new_tokens=_max_tokens(lm, options),
                                                                temperature=0.0, regex=regex))
            choice = text if text in options else max((o for o in options if text.startswith(o)), key=len,
                                                      default=text)
        else:
            raise ValueError(f"select mode must be 'constrained' or 'likelihood', not {self.mode!r}")
        return lm._replace(text=lm._text + choice, captures=_store(lm._captures, self.name, choice, self.list_append),
                           meta=_store(lm._meta, self.name, meta, False))


def _max_tokens(lm: "Model", options: list[str]) -> int:
    tok = getattr(lm._backend, "tokenize", None)
    try:
        return max(len(tok(o)) for o in options) + 4 if tok else 64
    except Exception:
        return 64


@dataclass
class Call(Node):
    """A call of a ``@guidance`` function, applied when added to a model."""

    fn: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def apply(self, lm: "Model") -> "Model":
        out = self.fn(lm, *self.args, **self.kwargs)
        if out is None:
            raise TypeError(f"@guidance function {self.fn.__name__} must return the model")
        if isinstance(out, Model):
            return out
        return lm + out  # a stateless function may return a node or text


@dataclass
class _RoleMark(Node):
    role: str | None
    closing: bool

    def apply(self, lm: "Model") -> "Model":
        return lm._close_role() if self.closing else lm._open_role(self.role)


# The model value ---------------------------------------------------------------------------------------------------
class Model:
    """An immutable LM state: prompt text + captures, over one of our backends."""

    def __init__(self, backend: Any, echo: bool = False):
        self._backend = backend
        self._template = backend.get_chat_template()
        self._text = ""
        self._captures: dict[str, Any] = {}
        self._meta: dict[str, Any] = {}
        self._role: str | None = None
        self._role_start = 0
        self._messages: tuple[dict, ...] = ()
        self.echo = echo

    # Value semantics ---------------------------------------------------------------------------------------------
    def _replace(self, **updates) -> "Model":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        for k, v in updates.items():
            setattr(new, "_" + k, v)
        return new

    def __add__(self, other: Any) -> "Model":
        if isinstance(other, Model):
            raise TypeError("cannot add two models")
        lm = self
        if isinstance(other, str):
            lm = lm._sync_roles()
            return lm._replace(text=lm._text + other)
        if isinstance(other, Node):
            return other.apply(lm)
        if isinstance(other, (int, float)):
            return lm + str(other)
        raise TypeError(f"cannot add {type(other).__name__} to a model")

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"<sglang_guidance.Model {len(self._text)} chars, captures={list(self._captures)}>"

    def __getitem__(self, name: str) -> Any:
        return self._captures[name]

    def __contains__(self, name: str) -> bool:
        return name in self._captures

    def get(self, name: str, default: Any = None) -> Any:
        return self._captures.get(name, default)

    def set(self, name: str, value: Any) -> "Model":
        return self._replace(captures={**self._captures, name: value})

    def remove(self, name: str) -> "Model":
        captures = dict(self._captures)
        captures.pop(name, None)
        return self._replace(captures=captures)

    def copy(self) -> "Model":
        return self._replace()

    def meta(self, name: str) -> Any:
        """Runtime meta info of a capture (prompt/completion/cached tokens, finish reason, select scores)."""
        return self._meta.get(name)

    @property
    def text(self) -> str:
        return self._text

    def messages(self) -> list[dict]:
        """The closed role turns so far (plus the open one)."""
        msgs = list(self._messages)
        if self._role is not None:
            msgs.append({"role": self._role, "content": self._text[self._role_start:]})
        return msgs

    # Role blocks -------------------------------------------------------------------------------------------------
    def _sync_roles(self) -> "Model":
        """Closes/opens role turns so the text lands in the role of the innermost active ``with`` block."""
        active = _ROLES.get()
        want = active[-1] if active else None
        if want == self._role:
            return self
        lm = self._close_role() if self._role is not None else self
        return lm._open_role(want) if want is not None else lm

    def _open_role(self, role: str) -> "Model":
        prefix, _ = self._template.get_prefix_and_suffix(role, list(self._messages))
        text = self._text + prefix
        return self._replace(text=text, role=role, role_start=len(text))

    def _close_role(self) -> "Model":
        if self._role is None:
            return self
        _, suffix = self._template.get_prefix_and_suffix(self._role, list(self._messages))
        msg = {"role": self._role, "content": self._text[self._role_start:]}
        return self._replace(text=self._text + suffix, role=None, messages=self._messages + (msg,))


@contextmanager
def _role_block(role: str) -> Iterator[None]:
    token = _ROLES.set(_ROLES.get() + (role,))
    try:
        yield
    finally:
        _ROLES.reset(token)


def system() -> contextmanager:
    """``with system(): lm += "..."``"""
    return _role_block("system")


def user() -> contextmanager:
    return _role_block("user")


def assistant() -> contextmanager:
    return _role_block("assistant")


def role(name: str) -> contextmanager:
    return _role_block(name)


def end_role() -> Node:
    """Closes the open role turn now (normally it closes when text is next added outside the block)."""
    return _RoleMark(None, True)


# Library functions -------------------------------------------------------------------------------------------------
def gen(name: str | None = None, *, max_tokens: int | None = DEFAULT_MAX_TOKENS, regex: str | None = None,
        stop: str | list[str] | None = None, temperature: float = 0.0, top_p: float | None = None,
        list_append: bool = False, save_stop_text: bool | str = False, stop_regex: str | None = None) -> Gen:
    """Generates text (guidance's ``gen``): greedy by default, ``stop`` strings excluded from the capture."""
    if stop_regex is not None:
        raise NotImplementedError("stop_regex is not supported; use stop strings or regex")
    return Gen(name=name, max_tokens=max_tokens, regex=regex, stop=stop, temperature=temperature, top_p=top_p,
               list_append=list_append, save_stop_text=save_stop_text)


def select(options: Sequence[str], name: str | None = None, *, mode: str = "constrained",
           list_append: bool = False, choices_method: Any = None) -> Select:
    """Picks one of ``options``.

    ``mode="constrained"`` (guidance's semantics, the default): greedy decoding constrained to the options.
    ``mode="likelihood"``: our ``sgl.select`` ranking — every option scored by (token-length-normalised)
    log-likelihood after the prompt, which is prefilled once and shared from the radix cache.
    """
    return Select(options=list(options), name=name, mode=mode, list_append=list_append,
                  choices_method=choices_method)


def json(name: str | None = None, *, schema: Any = None, max_tokens: int | None = 512, temperature: float = 0.0,
         list_append: bool = False) -> Gen:
    """Generates JSON valid under ``schema`` (a JSON-schema dict or a pydantic model class); ``None`` = any
    JSON object. The capture is the JSON text."""
    if schema is None:
        schema_dict: Any = {"type": "object"}
    elif isinstance(schema, dict):
        schema_dict = schema
    elif hasattr(schema, "model_json_schema"):
        schema_dict = schema.model_json_schema()
    else:
        raise TypeError("schema must be a JSON schema dict or a pydantic model class")
    return Gen(name=name, max_tokens=max_tokens, json_schema=_json.dumps(schema_dict), temperature=temperature,
               list_append=list_append)


def guidance(f: Callable | None = None, *, stateless: bool = False, cache: bool = False, dedent: bool = True,
             model: Any = None) -> Any:
    """``@guidance`` decorator: ``@guidance def prog(lm, x): lm += ...; return lm`` and then ``lm + prog(x)``.

    ``stateless``/``cache``/``dedent`` are accepted for compatibility; every function runs eagerly against the
    model it is added to.
    """

    def wrap(fn: Callable) -> Callable[..., Call]:
        @functools.wraps(fn)
        def make(*args: Any, **kwargs: Any) -> Call:
            return Call(fn, args, kwargs)

        make.__wrapped__ = fn
        return make

    return wrap(f) if f is not None else wrap
