"""DSPy adapter output formats -> our decoding constraints (JSON schema or regex).

The engine contract hands the LM a canonical ``Request`` only, not the signature. The signature's output
fields are still in it, rendered by DSPy's adapters in one fixed form in the system message::

    Your output fields are:
    1. `answer` (int): ...
    2. `size` (Literal['small', 'large']): ...

From that list we build:

* for ``JSONAdapter``: the JSON schema of the output object (used where DSPy itself can only send the bare
  ``{"type": "json_object"}``, e.g. ReAct's ``dict[str, Any]`` tool arguments), and bounds for the schemas
  DSPy does send;
* for ``ChatAdapter``: a regex over the ``[[ ## field ## ]]`` sections in order, ending with
  ``[[ ## completed ## ]]``. Every marker is a forced string, so the compressed FSM jump-forwards it.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from sglang_backend.runtime.constrained.json_schema import build_regex_from_schema

_FIELDS_BLOCK = re.compile(r"Your output fields are:\n(.*?)(?:\n\nAll interactions will be structured|\Z)", re.S)
_FIELD_LINE = re.compile(r"^\d+\. `([^`]+)` \((.*?)\):", re.M)
# dspy.Tool's str(): "(2) lookup, whose description is <desc>...</desc>. It takes arguments {...}." (ReAct)
_TOOL_LINE = re.compile(r"^\s*\(\d+\) (\S+?)(?:, whose description is <desc>.*?</desc>)?\. It takes arguments (\{.*\})\.$",
                        re.M)
CHAT_COMPLETED = "[[ ## completed ## ]]"


def output_fields(system: str | None) -> list[tuple[str, str]]:
    """[(name, type name)] of the output fields a DSPy adapter described in ``system`` ([] if none)."""
    if not system:
        return []
    m = _FIELDS_BLOCK.search(system)
    return _FIELD_LINE.findall(m.group(1)) if m else []


def tool_variants(system: str | None, fields: list[tuple[str, str]]) -> list[dict[str, dict]]:
    """ReAct: one {tool-name field: const name, tool-args field: that tool's argument schema} per tool listed in
    the instructions, so the arguments match the chosen tool ([] when the prompt lists no tools)."""
    tools = {}
    for name, args in _TOOL_LINE.findall(system or ""):
        try:
            tools[name] = ast.literal_eval(args)
        except (ValueError, SyntaxError):
            return []
    names = [n for n, t in fields if t.startswith("Literal[")
             and set(type_schema(t, None, None).get("enum", ())) == set(tools)]
    maps = [n for n, t in fields if t == "dict" or t.startswith("dict[")]
    if not tools or len(names) != 1 or len(maps) != 1:
        return []
    variants = []
    for tool, args in tools.items():
        props = {a: (spec if isinstance(spec, dict) and spec else {"type": "string"}) for a, spec in args.items()}
        variants.append({names[0]: {"const": tool}, maps[0]: {"type": "object", "properties": props,
                                                             "required": list(props), "additionalProperties": False}})
    return variants


def _split_args(inner: str) -> list[str]:
    """Top-level comma split of a type's bracket contents ("str, list[int]" -> ["str", "list[int]"])."""
    out, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def type_schema(type_name: str, max_string_length: int | None, max_items: int | None) -> dict:
    """JSON schema for a DSPy annotation name (as ``get_annotation_name`` renders it)."""
    t = type_name.strip()
    simple = {"int": {"type": "integer"}, "float": {"type": "number"}, "bool": {"type": "boolean"}}
    if t in simple:
        return dict(simple[t])
    if t.startswith("Literal[") and t.endswith("]"):
        try:
            values = ast.literal_eval("[" + t[len("Literal["):-1] + "]")
            return {"enum": values}
        except (ValueError, SyntaxError):
            pass
    if t.startswith("Optional[") and t.endswith("]"):
        return {"anyOf": [type_schema(t[9:-1], max_string_length, max_items), {"type": "null"}]}
    if t.startswith("list[") and t.endswith("]"):
        schema: dict = {"type": "array", "items": type_schema(t[5:-1], max_string_length, max_items)}
        if max_items:
            schema["maxItems"] = max_items
        return schema
    if t == "list":
        return {"type": "array", "items": {"type": "string"}, **({"maxItems": max_items} if max_items else {})}
    if t == "ToolCalls":  # dspy.ToolCalls as a text field (adapters without native function calling)
        call = {"type": "object", "properties": {"name": _string(max_string_length), "args": type_schema(
            "dict", max_string_length, max_items)}, "required": ["name", "args"], "additionalProperties": False}
        return {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1,
                                                                "maxItems": max_items or 4}},
                "required": ["tool_calls"], "additionalProperties": False}
    if t == "dict" or t.startswith("dict["):
        # Open mapping (ReAct's tool args): string keys, scalar values, a few entries so it closes in time.
        args = _split_args(t[5:-1]) if t.startswith("dict[") else []
        value = (type_schema(args[1], max_string_length, max_items) if len(args) == 2 and args[1] != "Any"
                 else {"anyOf": [_string(max_string_length), {"type": "number"}, {"type": "boolean"}]})
        return {"type": "object", "additionalProperties": value, "maxProperties": max_items or 4}
    return _string(max_string_length)


def _string(max_len: int | None) -> dict:
    return {"type": "string", **({"maxLength": max_len} if max_len else {})}


def signature_schema(fields: list[tuple[str, str]], max_string_length: int | None, max_items: int | None,
                     variants: list[dict[str, dict]] = ()) -> dict:
    def one(override: dict) -> dict:
        props = {name: bound_schema(override[name], max_string_length, max_items) if name in override
                 else type_schema(t, max_string_length, max_items) for name, t in fields}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    return {"anyOf": [one(v) for v in variants]} if variants else one({})


def bound_schema(schema: Any, max_string_length: int | None, max_items: int | None) -> Any:
    """Adds maxLength / maxItems where a schema leaves them open, so a constrained output fits max_tokens."""
    if isinstance(schema, list):
        return [bound_schema(s, max_string_length, max_items) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_schema(v, max_string_length, max_items) for k, v in schema.items()}
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if max_string_length and "string" in types and not any(k in out for k in ("maxLength", "enum", "const",
                                                                               "format", "pattern")):
        out["maxLength"] = max_string_length
    if max_items and "array" in types and "maxItems" not in out:
        out["maxItems"] = max_items
    return out


def _chat_value_regex(type_name: str, max_string_length: int | None, max_items: int | None) -> str:
    """Regex for one ChatAdapter field value, in the form DSPy's parse_value reads back."""
    t = type_name.strip()
    if t == "int":
        return r"-?[0-9]{1,12}"
    if t == "float":
        return r"-?[0-9]{1,12}(?:\.[0-9]{1,8})?"
    if t == "bool":
        return r"(?:True|False)"
    if t.startswith("Literal["):
        schema = type_schema(t, max_string_length, max_items)
        if "enum" in schema:
            return "(?:" + "|".join(re.escape(str(v)) for v in schema["enum"]) + ")"
    if t.startswith(("list", "dict", "ToolCalls")):
        return build_regex_from_schema(type_schema(t, max_string_length, max_items))
    # Free text: one line (a newline ends the field), at least one visible character, not starting with "[", a
    # space or "{": the prompt shows "{answer}" where a value goes, and small models copy it, or variants of it
    # ("{answer, completed}"), as the answer.
    return r"[^\n\[ {][^\n]" + ("{0,%d}" % (max_string_length - 1) if max_string_length else "*")


def chat_regex(fields: list[tuple[str, str]], max_string_length: int | None, max_items: int | None,
               variants: list[dict[str, dict]] = ()) -> str:
    def value(name: str, t: str, override: dict) -> str:
        if name not in override:
            return _chat_value_regex(t, max_string_length, max_items)
        schema = override[name]
        if "const" in schema:
            return re.escape(str(schema["const"]))
        return build_regex_from_schema(bound_schema(schema, max_string_length, max_items))

    def one(override: dict) -> str:
        return "".join(re.escape(f"[[ ## {name} ## ]]") + r"\n" + value(name, t, override) + r"\n\n"
                       for name, t in fields)

    body = "(?:" + "|".join(one(v) for v in variants) + ")" if variants else one({})
    return body + re.escape(CHAT_COMPLETED)


def constraint_for(system: str | None, last_user: str | None, response_format: dict | None,
                   max_string_length: int | None, max_items: int | None) -> dict:
    """The sampling-params constraint (``{"json_schema": ...}``, ``{"regex": ...}`` or ``{}``) for a request."""
    fields = output_fields(system)
    if response_format is not None:
        if response_format.get("type") == "json_schema":
            schema = bound_schema(response_format["schema"], max_string_length, max_items)
        elif fields:  # json_object: DSPy could not express the schema (open mappings); the field list can
            schema = signature_schema(fields, max_string_length, max_items, tool_variants(system, fields))
        else:
            schema = {"type": "object"}
        return {"json_schema": json.dumps(schema)}
    if fields and system and CHAT_COMPLETED in system and (last_user is None or "[[ ## " in last_user):
        return {"regex": chat_regex(fields, max_string_length, max_items, tool_variants(system, fields))}
    return {}


# Native function calling ------------------------------------------------------------------------------------------
def tools_prompt(tools) -> str:
    """The tools, described for a model without a tool-calling chat template (appended to the system turn)."""
    lines = ["You can call these tools:"]
    for t in tools:
        lines.append(f"- {t.name}: {t.description or ''} Arguments (JSON schema): {json.dumps(t.parameters)}")
    lines.append('To call tools, reply with only a JSON object {"tool_calls": [{"name": <tool name>, "arguments": '
                 '{...}}]}. Otherwise reply as described above.')
    return "\n".join(lines)


def tool_calls_schema(tools, max_string_length: int | None, max_items: int | None) -> dict:
    """JSON schema of a reply that calls one or more of ``tools`` with their declared arguments."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                               "arguments": bound_schema(t.parameters, max_string_length, max_items)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "object", "properties": {"tool_calls": {"type": "array", "items": {"anyOf": calls},
                                                            "minItems": 1, "maxItems": max_items or 4}},
            "required": ["tool_calls"], "additionalProperties": False}


def with_tool_calls(answer: dict, tools, required: bool, max_string_length: int | None,
                    max_items: int | None) -> dict:
    """A regex constraint: a tool-call object, or (unless a call is required) the answer's own constraint
    (free text not starting with "{" when the answer is unconstrained)."""
    calls = build_regex_from_schema(tool_calls_schema(tools, max_string_length, max_items))
    if required:
        return {"regex": calls}
    if "json_schema" in answer:
        other = build_regex_from_schema(json.loads(answer["json_schema"]))
    else:
        other = answer.get("regex", r"[^{\s][\s\S]*")
    return {"regex": f"(?:{calls}|{other})"}


def parse_tool_calls(text: str, names: set[str]) -> list[tuple[str, dict]] | None:
    """[(name, arguments)] when ``text`` is a tool-call reply to known tools, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    calls = obj.get("tool_calls") if isinstance(obj, dict) else None
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        if not isinstance(c, dict) or c.get("name") not in names or not isinstance(c.get("arguments", {}), dict):
            return None
        out.append((c["name"], c.get("arguments", {})))
    return out
