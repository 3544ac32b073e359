"""Tool (function) calling for every API family of the HTTP layer: one mechanism from ``tools`` to the prompt,
to the decoding constraint, and from the generated text back to calls.

Formats (``FORMATS``): how a model writes a call, picked from its chat template (:func:`detect_format`) or by
``--tool-call-parser``:

* ``hermes`` (Hermes, Qwen 2.5/3, and the fallback): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
* ``llama3`` (Llama 3.x JSON): ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
  several separated by ``;``
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``

Public API (the Ollama ``/api/chat`` and ``/v1/responses`` routes import it too):

* :func:`validate_tools` (``tools`` + ``tool_choice`` -> :class:`ToolSpec`; ``APIError`` 400 when malformed)
* :func:`detect_format`, :func:`template_renders_tools`
* :func:`prompt_messages` (the conversation with tools, assistant calls and tool results, for the chat template;
  a template that does not render ``tools`` gets a Hermes tool description in the system message)
* :func:`tool_constraint` (sampling params: ``{"ebnf": <llguidance Lark grammar>}``; ``required`` and a named
  tool force a call, ``auto`` lets text run until the model opens a call and then forces a valid one)
* :func:`parse_tool_calls` (text -> ``(content, calls)``) and :class:`ToolCallStreamParser` (text deltas ->
  content deltas and OpenAI ``delta.tool_calls`` entries); calls are OpenAI-shaped:
  ``{"id": "call_...", "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}``.

Arguments follow the tool's ``parameters`` schema through our JSON-schema regexes (``constrained.json_schema``:
the same layout, digit bounds and keyword support as ``response_format``), embedded as Lark terminals.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..constrained import budget as grammar_budget
from ..constrained.json_schema import build_regex_from_schema
from ..constrained.llguidance_backend import check_repeats, regex_to_lark_grammar
from ..managers.detokenizer_manager import partial_stop_suffix_len
from .errors import APIError

FORMATS = ("hermes", "llama3", "mistral")
PARSER_SETTINGS = ("auto",) + FORMATS
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 64 * 1024  # one tool's parameters, serialized
# All tools' argument regexes together may take this many times ServerArgs.grammar_max_regex_chars (the limit of one
# response_format grammar): a request's tools are several schemas. 256 KiB at the default.
TOOLS_REGEX_CHARS_FACTOR = 4
DEFAULT_MAX_REGEX_CHARS = TOOLS_REGEX_CHARS_FACTOR * grammar_budget.DEFAULT_MAX_REGEX_CHARS
# Most calls in one reply: a small model at temperature 0 otherwise repeats one call until max_tokens.
MAX_PARALLEL_CALLS = 8
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# Per format: the text that opens calls, the keys of a call, what may separate calls, what ends one call.
TRIGGERS = {"hermes": "<tool_call>", "llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
ARGUMENT_KEYS = {"hermes": "arguments", "llama3": "parameters", "mistral": "arguments"}
CLOSERS = {"hermes": "</tool_call>", "llama3": "", "mistral": ""}


# Validation ---------------------------------------------------------------------------------------------------------
@dataclass
class ToolSpec:
    """A request's validated tools: ``functions`` by name ({"name", "description", "parameters", "strict"}),
    ``choice`` ("auto" | "none" | "required" | a tool's name), ``parallel`` (more than one call allowed)."""

    functions: dict[str, dict] = field(default_factory=dict)
    choice: str = "auto"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether tools are offered to the model (any, and tool_choice is not "none")."""
        return bool(self.functions) and self.choice != "none"

    def openai_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": {k: v for k, v in f.items() if k != "strict"}}
                for f in self.functions.values()]


def _check_parameters(name: str, params, param: str) -> dict:
    if params is None:
        return dict(EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise APIError(f"tool {name!r}: parameters must be a JSON schema object", param=param)
    if len(json.dumps(params)) > MAX_SCHEMA_CHARS:
        raise APIError(f"tool {name!r}: parameters schema is larger than {MAX_SCHEMA_CHARS} characters", param=param)
    if params.get("type", "object") != "object":
        raise APIError(f"tool {name!r}: parameters must be an object schema (type 'object')", param=param)
    try:
        import jsonschema  # a dependency of the server (the schema meta-check); local: only this check needs it
        jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator).check_schema(params)
    except jsonschema.exceptions.SchemaError as e:
        raise APIError(f"tool {name!r}: invalid parameters schema: {e.message}", param=param) from None
    return params


def _check_tool(i: int, tool, param: str) -> dict:
    where = f"{param}[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise APIError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=param)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise APIError(f"{where}.function must be an object with a 'name'", param=param)
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise APIError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'; got {name!r}",
                       param=param)
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(f"tool {name!r}: description must be a string", param=param)
    strict = fn.get("strict") or False
    if not isinstance(strict, bool):
        raise APIError(f"tool {name!r}: strict must be a boolean", param=param)
    return {"name": name, "description": description or "",
            "parameters": _check_parameters(name, fn.get("parameters"), param), "strict": strict}


def _check_choice(tool_choice, functions: dict) -> str:
    if tool_choice is None:
        return "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise APIError(f"tool_choice must be 'auto', 'none', 'required' or a function; got {tool_choice!r}",
                           param="tool_choice")
        if tool_choice == "required" and not functions:
            raise APIError("tool_choice 'required' needs tools", param="tool_choice")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise APIError("tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")
    if not functions:
        raise APIError("tool_choice names a function but the request has no tools", param="tool_choice")
    if name not in functions:
        raise APIError(f"tool_choice names {name!r}, which is not among the tools {sorted(functions)}",
                       param="tool_choice")
    return name


def validate_tools(tools, tool_choice=None, parallel_tool_calls: bool | None = None,
                   param: str = "tools") -> ToolSpec:
    """The request's ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``), ``tool_choice`` and
    ``parallel_tool_calls``, checked: ``APIError`` (400) for a malformed tool, a duplicate or invalid name, an
    invalid or oversized parameters schema, an unknown ``tool_choice`` or one that names no declared tool."""
    if tools is not None and not isinstance(tools, list):
        raise APIError("tools must be a list", param=param)
    if tools and len(tools) > MAX_TOOLS:
        raise APIError(f"at most {MAX_TOOLS} tools", param=param)
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        fn = _check_tool(i, tool, param)
        if fn["name"] in functions:
            raise APIError(f"two tools are named {fn['name']!r}", param=param)
        functions[fn["name"]] = fn
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return ToolSpec(functions, _check_choice(tool_choice, functions), parallel_tool_calls is not False)


# Format and prompt --------------------------------------------------------------------------------------------------
def template_text(tokenizer) -> str:
    """The tokenizer's chat template source ("" when it has none; named templates joined)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def template_renders_tools(template: str) -> bool:
    """Whether the chat template uses the ``tools`` variable (SmolLM2's does not)."""
    return re.search(r"\btools\b", template) is not None


def detect_format(template: str, setting: str = "auto") -> str:
    """The call format: ``setting`` unless "auto", else the one the chat template writes (hermes by default,
    which is also what the fallback tool prompt teaches)."""
    if setting != "auto":
        if setting not in FORMATS:
            raise ValueError(f"tool_call_parser must be one of {PARSER_SETTINGS}, got {setting!r}")
        return setting
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template or not template_renders_tools(template):
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def tools_system_prompt(spec: ToolSpec) -> str:
    """A Hermes-style tool description (Qwen 2.5's wording), for templates that do not render ``tools``."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in spec.openai_tools())
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _history_arguments(call, spec: ToolSpec, known: set[str]) -> dict:
    """One assistant ``tool_calls`` entry, checked, with its arguments as a dict (templates render dicts)."""
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError("an assistant message's tool_calls entries need function.name", param="messages")
    if spec.functions and name not in spec.functions:
        raise APIError(f"an assistant message calls {name!r}, which is not among the tools "
                       f"{sorted(spec.functions)}", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise APIError(f"the arguments of the call to {name!r} in the history are not JSON", param="messages")
    if not isinstance(args, dict):
        raise APIError(f"the arguments of the call to {name!r} in the history must be a JSON object",
                       param="messages")
    if isinstance(call.get("id"), str):
        known.add(call["id"])
    return {"id": call.get("id") or new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def format_call_text(name: str, arguments: dict, fmt: str) -> str:
    """One call as the model writes it in format ``fmt``."""
    key = ARGUMENT_KEYS[fmt]
    body = json.dumps({"name": name, key: arguments}, ensure_ascii=False)
    if fmt == "hermes":
        return f"<tool_call>\n{body}\n</tool_call>"
    return f"[TOOL_CALLS][{body}]" if fmt == "mistral" else f"<|python_tag|>{body}"


def _fallback_message(msg: dict, calls: list[dict] | None) -> dict:
    """A tool-call or tool-result message written out as Hermes text (templates that know no tools)."""
    if msg["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"}
    text = "\n".join(format_call_text(c["function"]["name"], c["function"]["arguments"], "hermes") for c in calls)
    return {"role": "assistant", "content": "\n".join(x for x in (msg.get("content"), text) if x)}


def prompt_messages(messages: list[dict], spec: ToolSpec, renders_tools: bool) -> tuple[list[dict], dict]:
    """The conversation for the chat template, and its extra template arguments (``{"tools": [...]}`` when the
    template renders them). ``messages`` are template messages ({"role", "content", "tool_calls"?,
    "tool_call_id"?}); assistant calls must name declared tools and carry JSON object arguments, and a tool
    message must answer an earlier call (``APIError`` 400). Without template support, the tools become a
    Hermes description in the system message and calls/results become Hermes text."""
    known: set[str] = set()
    out = []
    for msg in messages:
        calls = [_history_arguments(c, spec, known) for c in msg.get("tool_calls") or []]
        if msg["role"] == "tool":
            call_id = msg.get("tool_call_id")
            if call_id is not None and known and call_id not in known:
                raise APIError(f"a tool message answers tool_call_id {call_id!r}, which no earlier assistant "
                               f"message called", param="messages")
        if not renders_tools and (calls or msg["role"] == "tool"):
            out.append(_fallback_message(msg, calls))
            continue
        out.append({**msg, "tool_calls": calls} if calls else {k: v for k, v in msg.items() if k != "tool_calls"})
    if not spec.active:
        return out, {}
    if renders_tools:
        return out, {"tools": spec.openai_tools()}
    prompt = tools_system_prompt(spec)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}, *out[1:]], {}
    return [{"role": "system", "content": prompt}, *out], {}


# Constraint ---------------------------------------------------------------------------------------------------------
def _trigger_lark(fmt: str, special_tokens: dict[str, int] | None) -> str:
    """The grammar's call opener: a special token by id where the tokenizer has it as one, else literal text."""
    trigger = TRIGGERS[fmt]
    token_id = (special_tokens or {}).get(trigger)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(trigger)  # a JSON string is a Lark string


def _call_terminals(spec: ToolSpec, fmt: str, max_regex_chars: int) -> list[str]:
    """Lark terminal definitions, one per callable tool, each matching one call object of that tool."""
    names = list(spec.functions) if spec.choice in ("auto", "required") else [spec.choice]
    key, total, defs = ARGUMENT_KEYS[fmt], 0, []
    for i, name in enumerate(names):
        params = spec.functions[name]["parameters"]
        if params.get("properties") == {} and "additionalProperties" not in params:
            params = {**params, "additionalProperties": False}  # a tool without arguments takes {} (not any keys)
        call_schema = {"type": "object", "properties": {"name": {"const": name}, key: params},
                       "required": ["name", key]}
        try:
            regex = build_regex_from_schema(call_schema)
            check_repeats(regex)  # as for response_format: llguidance would only fail mid-decode
        except ValueError as e:  # unsupported keywords, unsatisfiable, past the compile budget
            raise APIError(f"tool {name!r}: its parameters schema cannot be used: {e}", param="tools") from None
        total += len(regex)
        if total > max_regex_chars:
            raise APIError(f"the tools' parameters schemas are too large (their grammar exceeds {max_regex_chars} "
                           f"characters)", param="tools")
        defs.append(f"CALL_{i}: " + regex_to_lark_grammar(regex)[len("start: "):])
    return defs


def _call_rules(fmt: str, parallel: bool, n_terminals: int) -> list[str]:
    """``calls``: one call, or up to ``MAX_PARALLEL_CALLS``, in the format's layout, after its opener."""
    one = "call: " + " | ".join(f"CALL_{i}" for i in range(n_terminals))
    more = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"
    if fmt == "hermes":
        tail = ' ("\\n" open "\\n" call "\\n</tool_call>")' + more if parallel else ""
        return ['calls: "\\n" call "\\n</tool_call>"' + tail, one]
    if fmt == "mistral":
        return ['calls: "[" call' + (' (", " call)' + more if parallel else "") + ' "]"', one]
    return ["calls: call" + (' ("; " call)' + more if parallel else ""), one]


def tool_constraint(spec: ToolSpec, fmt: str, special_tokens: dict[str, int] | None = None,
                    max_regex_chars: int = DEFAULT_MAX_REGEX_CHARS) -> dict:
    """Sampling params constraining the output to ``spec``'s tool choice in format ``fmt``: ``{}`` when tools are
    off ("none"), else ``{"ebnf": <Lark grammar>}`` (llguidance). ``required`` / a named tool: the output is
    only calls (one for a named tool or without ``spec.parallel``, else at most ``MAX_PARALLEL_CALLS``);
    ``auto``: any text without the call opener, or text then the opener then valid calls (so a started call
    always parses). ``special_tokens`` maps an opener that is one
    special token of the tokenizer to its id (see :func:`special_trigger_ids`). ``APIError`` (400) for a
    parameters schema the grammar engine cannot take."""
    if not spec.active:
        return {}
    defs = _call_terminals(spec, fmt, max_regex_chars)
    opener = _trigger_lark(fmt, special_tokens)
    special = opener.startswith("<[")
    parallel = spec.parallel and spec.choice in ("auto", "required")  # a named tool: that one call
    if spec.choice != "auto":
        start = "start: calls" if fmt == "llama3" and not special else "start: open calls"
    elif fmt == "llama3" and not special:  # a call is JSON from the first byte; text never starts with "{"
        start = 'start: FREE | calls\nFREE: /[^{](?s:.*)/ | ""'
    elif special:  # text cannot contain a special token: any text, then optionally calls
        text = "/[^{](?s:.*)/" if fmt == "llama3" else "/(?s:.+)/"  # llama3: a reply starting "{" is a call
        start = f"start: TEXT | TEXT? open calls{' | calls' if fmt == 'llama3' else ''}\nTEXT: {text}"
    else:  # text without the opener; or text up to the first opener (lazy), then calls
        lit = re.escape(TRIGGERS[fmt])
        start = f"start: FREE | lead calls\nFREE: /(?s:.*)/ & ~/(?s:.*){lit}(?s:.*)/\nlead[lazy]: /(?s:.*){lit}/"
    grammar = "\n".join([start, f"open: {opener}", *_call_rules(fmt, parallel, len(defs)), *defs])
    return {"ebnf": grammar}


def special_trigger_ids(tokenizer, fmt: str) -> dict[str, int]:
    """{opener: token id} when the format's opener is one special token of ``tokenizer`` (Mistral's
    ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``); such text is only seen with ``skip_special_tokens`` off."""
    trigger = TRIGGERS[fmt]
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for tid, tok in decoder.items():
        if str(tok) == trigger and (getattr(tok, "special", False) or trigger in special):
            return {trigger: int(tid)}
    return {}


# Parsing ------------------------------------------------------------------------------------------------------------
def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole generated text: the text outside calls (None when only calls, or empty)
    and the complete calls, OpenAI-shaped. A call that does not parse stays in the content (a call cut off by
    ``max_tokens`` after complete calls is dropped)."""
    parser = ToolCallStreamParser(fmt)
    parts = [e["content"] for e in parser.feed(text) + parser.finish() if "content" in e]
    content = "".join(parts)
    if parser.calls:
        content = content.strip()
    return (content or None) if parser.calls else (content if content else None), parser.calls


def _scan_object(text: str, start: int) -> tuple[int | None, dict]:
    """Scans the JSON object at ``text[start] == "{"``: (its end, or None while incomplete; spans of its
    top-level string values and of its object values by key: {key: (value start, value end or None)})."""
    depth, i, key, expect_key, spans, in_str = 0, start, None, False, {}, False
    str_start = 0
    while i < len(text):
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_str = False
                if depth == 1 and expect_key:
                    key, expect_key = text[str_start + 1:i], False
                elif depth == 1 and key is not None:
                    spans[key], key = (str_start, i + 1), None
        elif ch == '"':
            in_str, str_start = True, i
            if depth == 1 and key is not None and expect_key is False and key not in spans:
                spans[key] = (i, None)
        elif ch in "{[":
            depth += 1
            if depth == 1:
                expect_key = True
            elif depth == 2 and key is not None and key not in spans:
                spans[key] = (i, None)
        elif ch in "}]":
            depth -= 1
            if depth == 1 and key is not None and key in spans and spans[key][1] is None:
                spans[key], key = (spans[key][0], i + 1), None
            if depth == 0:
                return i + 1, spans
        elif ch == "," and depth == 1:
            expect_key, key = True, None
        i += 1
    return None, spans


class ToolCallStreamParser:
    """Splits streamed text (``feed(delta)``, then ``finish()``) into events: ``{"content": str}`` for text
    outside calls, and ``{"tool_call": delta}`` with OpenAI ``delta.tool_calls`` entries: first
    ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`` as soon as the call's name is
    known, then ``{"index", "function": {"arguments": fragment}}`` as its arguments arrive. ``calls`` holds the
    complete calls (OpenAI-shaped); a call still open at ``finish`` (cut off by ``max_tokens``) is not among them.
    Text that may begin the call opener is held back until it is known not to."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool call format {fmt!r}; expected one of {FORMATS}")
        self.fmt, self.trigger, self.closer = fmt, TRIGGERS[fmt], CLOSERS[fmt]
        self.key = ARGUMENT_KEYS[fmt]
        self.buf = ""
        self.in_calls = False
        self.calls: list[dict] = []
        self.seen_text = False  # llama3: a call opens only at the very start (after whitespace)
        self._current: dict | None = None  # the call being streamed: {"id", "name", "sent"}
        self._closing = False  # a call ended; its closing tag (hermes) is still to come

    # -- text outside calls -----------------------------------------------------------------------
    def _text_events(self, final: bool) -> list[dict]:
        at = self.buf.find(self.trigger)
        if self.fmt == "llama3" and not self.seen_text:
            stripped = self.buf.lstrip()
            if stripped.startswith("{"):
                self.buf, self.in_calls = stripped, True
                return []
            if not stripped and not final:
                return []
        if at >= 0:
            text, self.buf, self.in_calls = self.buf[:at], self.buf[at + len(self.trigger):], True
        else:
            keep = 0 if final else partial_stop_suffix_len(self.buf, [self.trigger])  # held back until more comes
            text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        self.seen_text = self.seen_text or bool(text.strip())
        if self.calls and not text.strip():  # the layout between and after calls is no content
            return []
        return [{"content": text}] if text else []

    # -- calls ------------------------------------------------------------------------------------
    def _skip_separators(self) -> bool:
        """Drops what may separate calls; False when the calls are over (other text follows)."""
        seps = " \t\r\n" + {"mistral": "[,", "llama3": ";"}.get(self.fmt, "")
        self.buf = self.buf.lstrip(seps)
        if self.fmt == "llama3" and self.buf.startswith(self.trigger):
            self.buf = self.buf[len(self.trigger):].lstrip(seps)
        if self.fmt == "mistral" and self.buf.startswith("]"):
            self.buf = self.buf[1:]
            return False
        if self.fmt == "hermes" and self.buf.startswith(self.trigger):
            self.buf = self.buf[len(self.trigger):].lstrip(seps)
        return not self.buf or self.buf.startswith("{")

    def _stream_call(self, end: int | None, spans: dict) -> list[dict]:
        """Events for the call object at the start of ``buf`` (its name, then its arguments so far)."""
        events = []
        name_span = spans.get("name")
        if self._current is None and name_span and name_span[1] is not None:
            try:
                name = json.loads(self.buf[name_span[0]:name_span[1]])
            except json.JSONDecodeError:
                name = None
            if isinstance(name, str):
                self._current = {"id": new_call_id(), "name": name, "sent": 0}
                events.append({"tool_call": {"index": len(self.calls), "id": self._current["id"], "type": "function",
                                             "function": {"name": name, "arguments": ""}}})
        args_span = spans.get(self.key)
        if self._current is not None and args_span:
            stop = args_span[1] if args_span[1] is not None else len(self.buf)
            fragment = self.buf[args_span[0] + self._current["sent"]:stop]
            if end is None:  # an unfinished value: hold back trailing whitespace (it may end the object)
                fragment = fragment.rstrip()
            if fragment:
                self._current["sent"] += len(fragment)
                events.append({"tool_call": {"index": len(self.calls), "function": {"arguments": fragment}}})
        return events

    def _complete_call(self, end: int) -> list[dict]:
        """The call object ``buf[:end]`` is complete: record it (or, when it is no call, give it back as text)."""
        raw, self.buf = self.buf[:end], self.buf[end:]
        current, self._current = self._current, None
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            obj = None
        args = obj.get(self.key, obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return [] if current else [{"content": raw}]
        call_id = current["id"] if current else new_call_id()
        text = json.dumps(args, ensure_ascii=False)
        events = [] if current else [{"tool_call": {"index": len(self.calls), "id": call_id, "type": "function",
                                                    "function": {"name": obj["name"], "arguments": text}}}]
        self.calls.append({"id": call_id, "type": "function", "function": {"name": obj["name"], "arguments": text}})
        return events

    def _close(self) -> bool:
        """Consumes the closing tag after a call; False while it may still be arriving."""
        rest = self.buf.lstrip()
        if len(rest) < len(self.closer) and self.closer.startswith(rest):
            return False
        if rest.startswith(self.closer):
            self.buf = rest[len(self.closer):]
        self._closing = self.in_calls = False
        return True

    def _call_events(self) -> list[dict]:
        events: list[dict] = []
        while True:
            if self._closing:
                self._close()
                return events
            if not self._skip_separators():
                self.in_calls = False
                return events
            if not self.buf:
                return events
            end, spans = _scan_object(self.buf, 0)
            events += self._stream_call(end, spans)
            if end is None:
                return events
            events += self._complete_call(end)
            if self.closer:
                self._closing = True
                self._close()
                return events

    # -- public -----------------------------------------------------------------------------------
    def feed(self, delta: str) -> list[dict]:
        """Events for the next piece of generated text."""
        self.buf += delta
        return self._drain(final=False)

    def _drain(self, final: bool) -> list[dict]:
        events: list[dict] = []
        while self.buf:
            before = (self.in_calls, len(self.buf))
            events += self._call_events() if self.in_calls else self._text_events(final)
            if (self.in_calls, len(self.buf)) == before:
                break
        return events

    def finish(self) -> list[dict]:
        """Events for the text still held back, at the end of the generation."""
        events = self._drain(final=True)
        if self.buf and not self.in_calls:
            events.append({"content": self.buf})
        elif self.buf and not self._closing and not self.calls:  # a call cut off (max_tokens): it stays text,
            self._current = None  # unless calls came before it (then it is dropped: the reply is those calls)
            events.append({"content": ("" if self.fmt == "llama3" else self.trigger) + self.buf})
        self.buf = ""
        return events
