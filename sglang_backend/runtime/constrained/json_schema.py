"""JSON Schema (or a pydantic model) -> regex whose matches are JSON documents valid under the schema.

Output layout (the whitespace policy)
-------------------------------------
``whitespace="default"``: exactly ``json.dumps``'s default layout - one space after ``:`` and ``,``, none
elsewhere: ``{"a": 1, "b": [1, 2]}``. Deterministic layout means every separator and every key is a
forced string, which is what jump-forward (compressed FSM) feeds on; and it is the layout models see
most often in training data. ``whitespace="compact"``: ``{"a":1,"b":[1,2]}``. Any other string is used as
a regex for the (optional) whitespace allowed around every structural character, e.g. ``r"[ \\n]{0,2}"``
(flexible, but no more forced strings at those points).

Supported keywords
------------------
``type`` (also lists), ``enum``, ``const``, ``properties`` + ``required`` (properties are emitted in
schema order; optional ones may be skipped), ``additionalProperties`` (a schema: free-form string keys
with that value type, with ``minProperties``/``maxProperties``), ``items``/``prefixItems`` (and the draft-4
list form), ``minItems``/``maxItems``, ``$ref`` to ``#``, ``#/$defs/...``, ``#/definitions/...`` or any local
JSON pointer (recursion bounded by ``max_recursion_depth``: a branch deeper than that is dropped, and
if it was required the schema is unsatisfiable), ``anyOf``/``oneOf`` (alternation; ``oneOf``'s exclusivity
is not enforced), ``allOf`` (merged when it is a list of object/plain schemas), ``nullable``, strings with
``minLength``/``maxLength``/``pattern``/``format`` (``date``, ``time``, ``date-time``, ``email``, ``uuid``,
``ipv4``, ``uri``; unknown formats are ignored as the spec allows), integers with
``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` (exact digit-range regexes), numbers
with integer-valued bounds (exact; fractional bounds are tightened to the enclosed integers, so the
language is a valid subset), booleans, null. A schema without a type is any JSON value (nested to
``max_nesting_depth``).

Digit bounds (issue 25): a JSON number the schema leaves unbounded is still a bounded string, or a sampling
model can write digits until ``max_tokens`` (one emitted 170-digit integers). Defaults: at most
``MAX_INTEGER_DIGITS`` = 19 digits in an integer (or a number's integer part; int64 needs 19), at most
``MAX_FRACTION_DIGITS`` = 16 after the point (float64 carries 15-17 significant digits) and
``MAX_EXPONENT_DIGITS`` = 3 in an exponent (float64's reaches 308). A schema's own ``minimum``/``maximum``
replaces the integer-part bound on that side (a bound wider than 19 digits widens it). A string schema
without ``maxLength`` gets at most ``MAX_STRING_LENGTH`` = 512 characters (a ``minLength`` above it is kept
as the bound), so an object of bounded fields has a longest form and a ``max_tokens`` that fits it always
ends in ``stop`` (``tests/integration/test_structured_parse.py``). Our own DFA engine compiles schemas
without that cap (``max_string_length=None``: a counted repeat multiplies its DFA states, 9 s instead of 1 s
for the bench schema); llguidance, the default engine, takes it in its stride. Arrays keep no default bound
(a counted repeat of a whole item): ``maxItems`` bounds them.

Limits (sound, not complete): ``uniqueItems``, ``multipleOf``, ``not``, ``if``/``then``/``else``,
``patternProperties`` and ``dependencies`` are not enforced (``ValueError`` for the ones that would make
us generate invalid output: ``not``, ``if``, ``multipleOf`` other than integer steps of 1);
``pattern`` must full-match the decoded string (anchors are optional; an unanchored pattern is treated
as anchored - a subset of JSON Schema's search semantics); it is re-rendered from its parse tree so that
``"``, ``\\``, newline, tab and CR it allows come out JSON-escaped and other control characters are left
out (lookarounds are rejected).
Invalid schemas raise ``ValueError`` (meta-schema check through ``jsonschema`` when it is installed).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import interegular
from interegular import patterns as P

from . import budget as _budget
from .regex_fsm import _preprocess

__all__ = ["build_regex_from_schema", "schema_from_pydantic", "MAX_STRING_LENGTH", "STRING_CHAR", "WHITESPACE_DEFAULT"]

WHITESPACE_DEFAULT = "default"

# One character of a JSON string body: anything but '"', '\\' and control characters, or an escape.
# \\u escapes exclude lone surrogates (which would decode to un-encodable Python strings).
STRING_CHAR = (r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]'
               r'|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))')
STRING = r'"' + STRING_CHAR + r'*"'
MAX_INTEGER_DIGITS = 19
MAX_STRING_LENGTH = 512
MAX_FRACTION_DIGITS = 16
MAX_EXPONENT_DIGITS = 3
_FRACTION = rf"(?:\.[0-9]{{1,{MAX_FRACTION_DIGITS}}})?"
_EXPONENT = rf"(?:[eE][+-]?[0-9]{{1,{MAX_EXPONENT_DIGITS}}})?"
INTEGER = rf"-?(?:0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}})"
NUMBER = INTEGER + _FRACTION + _EXPONENT
BOOLEAN = r"(?:true|false)"
NULL = r"null"

_D = r"[0-9]"
# Years 0001-9999 (Python's datetime range; RFC 3339 validators reject 0000 too).
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])"
              r"|(?:0[13-9]|1[0-2])-(?:29|30)"
              r"|(?:0[13578]|1[02])-31)")
DATE = r"(?:" + _YEAR + "-" + _MONTH_DAY + r"|" + _LEAP_YEAR + r"-02-29)"
TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
DATE_TIME = DATE + r"T" + TIME
EMAIL = (r"[a-zA-Z0-9](?:[a-zA-Z0-9._%+-]{0,30}[a-zA-Z0-9])?@[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,30}[a-zA-Z0-9])?"
         r"(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,30}[a-zA-Z0-9])?)*\.[a-zA-Z]{2,10}")
UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4 = _OCTET + r"(?:\." + _OCTET + r"){3}"
URI = r"[a-zA-Z][a-zA-Z0-9+.-]*://[a-zA-Z0-9._~%!$&'()*+,;=:@/?#-]+"

FORMATS = {"date": DATE, "time": TIME, "date-time": DATE_TIME, "email": EMAIL, "uuid": UUID,
           "ipv4": IPV4, "uri": URI}

_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def _escape(text: str) -> str:
    """Regex for the literal ``text`` (interegular-compatible escaping)."""
    out = []
    for ch in text:
        cp = ord(ch)
        if cp < 0x20 or cp == 0x7F:
            out.append("\\x%02x" % cp)
        elif ch in ".^$*+?{}[]\\|()-#&~":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


_JSON_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _json_escape_regex(ch: str) -> str:
    """Regex for the JSON-encoded form of the special character ``ch`` ('"', '\\' or a control char)."""
    enc = _JSON_SHORT_ESCAPES.get(ch) or "\\u%04x" % ord(ch)
    return _escape(enc)


def _class_text(chars) -> str:
    """Body of a character class for ``chars`` (consecutive code points merged into ranges)."""

    def lit(c: str) -> str:
        cp = ord(c)
        if cp < 0x20 or cp == 0x7F:
            return "\\x%02x" % cp
        return "\\" + c if c in "\\]^-[" else c

    cps = sorted(ord(c) for c in chars)
    out, i = [], 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(lit(chr(cps[i])) + "-" + lit(chr(cps[j])))
        else:
            out.extend(lit(chr(c)) for c in cps[i:j + 1])
        i = j + 1
    return "".join(out)


_SPECIAL = frozenset(['"', "\\"] + [chr(i) for i in range(0x20)])
# Specials we write (as JSON escapes) when the pattern allows them; other control characters are left
# out - sound (a subset of the pattern's language) and keeps the automaton small.
_ESCAPED_SPECIALS = frozenset(['"', "\\", "\n", "\t", "\r"])


def _render_string_pattern(node, insensitive: bool = False) -> str:
    """Render an interegular parse tree as a regex over the JSON *encoding* of the matched text: every
    character class loses '"', '\\' and control characters; '"', '\\', newline, tab and carriage
    return come back as their JSON escapes, other control characters are dropped."""
    name = type(node).__name__
    if isinstance(node, P.Pattern):
        insensitive = bool((P.REFlags.CASE_INSENSITIVE if insensitive else P.REFlags(0)) | node.added_flags) and not (
            node.removed_flags & P.REFlags.CASE_INSENSITIVE)
        return "(?:" + "|".join(_render_string_pattern(o, insensitive) for o in node.options) + ")"
    if isinstance(node, P._Concatenation):
        out = []
        for part in node.parts:
            if not isinstance(part, P._BasePattern):
                raise ValueError("unsupported schema pattern: lookarounds are not supported in 'pattern'")
            out.append(_render_string_pattern(part, insensitive))
        return "".join(out)
    if isinstance(node, P._Repeated):
        base = _render_string_pattern(node.base, insensitive)
        hi = "" if node.max is None else str(node.max)
        return f"(?:{base}){{{node.min},{hi}}}"
    if name.endswith("EmptyCls"):
        return ""
    if name.endswith("DotCls"):
        chars, negated = frozenset("\n"), True
    elif isinstance(node, P._CharGroup):
        chars, negated = node.chars, node.negated
        if insensitive:
            chars = frozenset(v for c in chars for v in (c, c.lower(), c.upper()) if len(v) == 1)
    else:
        raise ValueError(f"unsupported schema pattern element {name}")
    if negated:
        specials = sorted((_SPECIAL - chars) & _ESCAPED_SPECIALS)
        opts = [f"[^{_class_text(chars | _SPECIAL)}]"]
    else:
        specials = sorted(chars & _ESCAPED_SPECIALS)
        safe = chars - _SPECIAL
        opts = [f"[{_class_text(safe)}]"] if safe else []
    opts += [_json_escape_regex(c) for c in specials]
    if not opts:
        return "[^\\s\\S]"  # matches nothing
    return opts[0] if len(opts) == 1 else "(?:" + "|".join(opts) + ")"


def _string_pattern_regex(pattern: str) -> str:
    """Regex for the body of a JSON string whose decoded value full-matches ``pattern``."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"invalid schema: invalid regex {pattern!r} in pattern: {e}") from None
    try:
        tree = interegular.parse_pattern(_preprocess(pattern))
    except Exception as e:
        raise ValueError(f"unsupported schema pattern {pattern!r}: {e or type(e).__name__}") from None
    return _render_string_pattern(tree)


def _alt(parts: list[str | None]) -> str | None:
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    uniq = list(dict.fromkeys(parts))
    return uniq[0] if len(uniq) == 1 else "(?:" + "|".join(uniq) + ")"


# ---------------------------------------------------------------------------------------------
# Integer ranges
# ---------------------------------------------------------------------------------------------


def _same_len_range(a: str, b: str) -> str:
    """Regex for decimal strings of equal length between ``a`` and ``b`` (inclusive, a <= b)."""
    if a == b:
        return a
    if len(a) == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return a[0] + _same_len_range(a[1:], b[1:])
    rest = len(a) - 1
    if a[1:] == "0" * rest and b[1:] == "9" * rest:
        return f"[{a[0]}-{b[0]}][0-9]{{{rest}}}"
    parts = []
    lo_first = a[0]
    if a[1:] != "0" * rest:
        parts.append(a[0] + _same_len_range(a[1:], "9" * rest))
        lo_first = str(int(a[0]) + 1)
    hi_first = b[0]
    tail = None
    if b[1:] != "9" * rest:
        tail = b[0] + _same_len_range("0" * rest, b[1:])
        hi_first = str(int(b[0]) - 1)
    if int(lo_first) <= int(hi_first):
        head = lo_first if lo_first == hi_first else f"[{lo_first}-{hi_first}]"
        parts.append(f"{head}[0-9]{{{rest}}}")
    if tail is not None:
        parts.append(tail)
    return "(?:" + "|".join(parts) + ")"


def _nonneg_int_range(lo: int, hi: int | None) -> str | None:
    """Canonical decimal integers in [lo, hi] (hi None = unbounded), lo >= 0."""
    if hi is not None and lo > hi:
        return None
    parts = []
    max_len = len(str(hi)) if hi is not None else len(str(lo))
    for length in range(len(str(lo)), max_len + 1):
        low = max(lo, 10 ** (length - 1) if length > 1 else 0)
        high = 10 ** length - 1 if hi is None else min(hi, 10 ** length - 1)
        if low <= high:
            parts.append(_same_len_range(str(low), str(high)))
    longest = max(MAX_INTEGER_DIGITS, max_len)  # no upper bound: the default digit bound (module docstring)
    if hi is None and max_len < longest:
        parts.append(f"[1-9][0-9]{{{max_len},{longest - 1}}}")
    return _alt(parts)


def _int_range(lo: int | None, hi: int | None) -> str | None:
    if lo is None and hi is None:
        return INTEGER
    if lo is not None and hi is not None and lo > hi:
        return None
    parts = []
    if hi is None or hi >= 0:
        parts.append(_nonneg_int_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        mag_lo = max(-hi, 1) if hi is not None else 1
        mag_hi = -lo if lo is not None else None
        r = _nonneg_int_range(mag_lo, mag_hi)
        if r is not None:
            parts.append("-" + r)
    return _alt(parts)


def _decimal_mag(lo: int, hi: int | None) -> str | None:
    """Decimals (no exponent) with lo <= value <= hi, lo >= 0 integer, hi integer or None."""
    frac = _FRACTION
    if hi is None:
        r = _nonneg_int_range(lo, None)
        return None if r is None else r + frac
    if lo > hi:
        return None
    parts = []
    below = _nonneg_int_range(lo, hi - 1) if hi - 1 >= lo else None
    if below is not None:
        parts.append(below + frac)
    parts.append(_escape(str(hi)) + rf"(?:\.0{{1,{MAX_FRACTION_DIGITS}}})?")
    return _alt(parts)


def _number_range(lo: float | None, hi: float | None) -> str | None:
    lo_i = None if lo is None else math.ceil(lo)
    hi_i = None if hi is None else math.floor(hi)
    if lo_i is None and hi_i is None:
        return NUMBER
    if lo_i is not None and hi_i is not None and lo_i > hi_i:
        return None
    parts = []
    if hi_i is None or hi_i >= 0:
        parts.append(_decimal_mag(max(lo_i, 0) if lo_i is not None else 0, hi_i))
    if lo_i is None or lo_i < 0:
        mag_lo = max(-hi_i, 0) if hi_i is not None else 0
        mag_hi = -lo_i if lo_i is not None else None
        r = _decimal_mag(mag_lo, mag_hi)
        if r is not None:
            parts.append("-" + r)
    return _alt(parts)


# ---------------------------------------------------------------------------------------------
# Schema walker
# ---------------------------------------------------------------------------------------------


class _Converter:
    def __init__(self, root: dict | bool, whitespace: str, max_recursion_depth: int, max_nesting_depth: int):
        self.root = root
        if whitespace == "default":
            self.item_sep, self.key_sep, self.ws = ", ", ": ", ""
        elif whitespace == "compact":
            self.item_sep, self.key_sep, self.ws = ",", ":", ""
        else:
            try:
                re.compile(whitespace)
            except re.error as e:
                raise ValueError(f"invalid whitespace pattern {whitespace!r}: {e}") from None
            self.item_sep, self.key_sep, self.ws = ",", ":", f"(?:{whitespace})"
        self.max_recursion_depth = max_recursion_depth
        self.max_nesting_depth = max_nesting_depth
        self.max_string_length: int | None = MAX_STRING_LENGTH
        self.ref_stack: list[str] = []

    # -- separators and literals -------------------------------------------------------------
    def lit(self, text: str) -> str:
        """A structural literal with optional whitespace around (flexible mode)."""
        if not self.ws:
            return _escape(text)
        return self.ws + _escape(text.strip()) + self.ws

    @property
    def comma(self) -> str:
        return self.lit(self.item_sep)

    @property
    def colon(self) -> str:
        return self.lit(self.key_sep)

    def dumps(self, value: Any) -> str:
        if self.ws:  # flexible: emit compact, whitespace between tokens is allowed anyway
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        return json.dumps(value, ensure_ascii=False, separators=(self.item_sep, self.key_sep))

    def literal_value(self, value: Any) -> str:
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            raise ValueError(f"invalid schema: {value!r} is not a JSON value")
        return _escape(self.dumps(value))

    # -- refs ------------------------------------------------------------------------------------
    def resolve(self, ref: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"invalid schema: only local $ref ('#/...') is supported, got {ref!r}")
        node: Any = self.root
        pointer = ref[1:]
        if pointer in ("", "/"):
            return node
        if not pointer.startswith("/"):
            # '#Name' anchors: look for a matching $anchor / $id in $defs
            for defs_key in ("$defs", "definitions"):
                for d in (self.root.get(defs_key) or {}).values() if isinstance(self.root, dict) else ():
                    if isinstance(d, dict) and d.get("$anchor") == pointer:
                        return d
            raise ValueError(f"invalid schema: cannot resolve $ref {ref!r}")
        for part in pointer[1:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"invalid schema: cannot resolve $ref {ref!r}")
        return node

    # -- main dispatch -----------------------------------------------------------------------------
    def visit(self, schema: Any, nesting: int = 0) -> str | None:
        """The regex for ``schema``, within the active compile budget: its deadline is checked at every node
        and the regex size after every node, so a schema whose ``$ref`` expansion explodes fails early."""
        budget = _budget.current()
        if budget is None:
            return self._visit(schema, nesting)
        budget.check("JSON schema -> regex")
        regex = self._visit(schema, nesting)
        if regex is not None:
            budget.check_regex_size(len(regex))
        return regex

    def _visit(self, schema: Any, nesting: int = 0) -> str | None:
        if schema is True or schema == {}:
            return self.any_value(self.max_nesting_depth)
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise ValueError(f"invalid schema: expected an object or boolean, got {type(schema).__name__}")
        if nesting > 64:
            raise ValueError("invalid schema: nested too deeply")

        if "$ref" in schema:
            ref = schema["$ref"]
            if self.ref_stack.count(ref) >= self.max_recursion_depth:
                return None  # recursion bound: drop this branch
            target = self.resolve(ref)
            siblings = {k: v for k, v in schema.items() if k not in ("$ref", "$defs", "definitions", "title",
                                                                       "description", "default", "examples")}
            self.ref_stack.append(ref)
            try:
                if siblings and isinstance(target, dict):
                    return self.visit(self._merge([target, siblings]), nesting + 1)
                return self.visit(target, nesting + 1)
            finally:
                self.ref_stack.pop()

        for bad in ("not", "if"):
            if bad in schema:
                raise ValueError(f"unsupported schema keyword {bad!r}")

        if "allOf" in schema:
            subs = schema["allOf"]
            if not isinstance(subs, list) or not subs:
                raise ValueError("invalid schema: allOf must be a non-empty list")
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            resolved = [self.resolve(s["$ref"]) if isinstance(s, dict) and set(s) == {"$ref"} else s for s in subs]
            return self.visit(self._merge(resolved + ([rest] if rest else [])), nesting + 1)

        for key in ("anyOf", "oneOf"):
            if key in schema:
                subs = schema[key]
                if not isinstance(subs, list) or not subs:
                    raise ValueError(f"invalid schema: {key} must be a non-empty list")
                rest = {k: v for k, v in schema.items() if k != key and k not in ("title", "description", "default")}
                opts = []
                for s in subs:
                    if rest and isinstance(s, dict):
                        s = self._merge([rest, s])
                    opts.append(self.visit(s, nesting + 1))
                return _alt(opts)

        nullable = schema.get("nullable") is True

        if "const" in schema:
            r = self.literal_value(schema["const"])
            return _alt([r, NULL]) if nullable else r
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError("invalid schema: enum must be a non-empty list")
            r = _alt([self.literal_value(v) for v in values])
            return _alt([r, NULL]) if nullable else r

        types = schema.get("type")
        if types is None:
            if "properties" in schema or "additionalProperties" in schema or "required" in schema:
                types = "object"
            elif "items" in schema or "prefixItems" in schema:
                types = "array"
            elif any(k in schema for k in ("minLength", "maxLength", "pattern", "format")):
                types = "string"
            elif any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
                types = "number"
            else:
                return self.any_value(self.max_nesting_depth)
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types:
            raise ValueError(f"invalid schema: bad type {schema.get('type')!r}")
        for t in types:
            if t not in _TYPES:
                raise ValueError(f"invalid schema: unknown type {t!r}")
        if nullable and "null" not in types:
            types = list(types) + ["null"]
        opts = [self.visit_type(t, schema, nesting) for t in types]
        return _alt(opts)

    def _merge(self, schemas: list) -> dict:
        out: dict = {}
        for s in schemas:
            if s is True:
                continue
            if not isinstance(s, dict):
                raise ValueError("unsupported allOf: only object schemas can be merged")
            for k, v in s.items():
                if k == "properties":
                    out.setdefault("properties", {}).update(v)
                elif k == "required":
                    out["required"] = list(dict.fromkeys(list(out.get("required", [])) + list(v)))
                elif k in out and out[k] != v and k not in ("title", "description", "default", "examples"):
                    if k in ("minimum", "minLength", "minItems", "exclusiveMinimum", "minProperties"):
                        out[k] = max(out[k], v)
                    elif k in ("maximum", "maxLength", "maxItems", "exclusiveMaximum", "maxProperties"):
                        out[k] = min(out[k], v)
                    else:
                        raise ValueError(f"unsupported allOf: conflicting {k!r}")
                else:
                    out[k] = v
        return out

    def visit_type(self, t: str, schema: dict, nesting: int) -> str | None:
        if t == "string":
            return self.string(schema)
        if t == "integer":
            return self.integer(schema)
        if t == "number":
            return self.number(schema)
        if t == "boolean":
            return BOOLEAN
        if t == "null":
            return NULL
        if t == "array":
            return self.array(schema, nesting)
        return self.object(schema, nesting)

    # -- primitives --------------------------------------------------------------------------------
    def string(self, schema: dict) -> str | None:
        min_len = schema.get("minLength", 0)
        max_len = schema.get("maxLength")
        for name, v in (("minLength", min_len), ("maxLength", max_len)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"invalid schema: {name} must be a non-negative integer, got {v!r}")
        if max_len is not None and min_len > max_len:
            return None
        if "pattern" in schema:
            pat = schema["pattern"]
            if not isinstance(pat, str):
                raise ValueError("invalid schema: pattern must be a string")
            return f'"{_string_pattern_regex(pat)}"'
        fmt = schema.get("format")
        if fmt in FORMATS:
            return f'"{FORMATS[fmt]}"'
        if max_len is None and self.max_string_length is not None:  # the default cap (module docstring)
            max_len = max(min_len, self.max_string_length)
        if max_len is None:
            return f'"{STRING_CHAR}*"' if min_len == 0 else f'"{STRING_CHAR}{{{min_len},}}"'
        return f'"{STRING_CHAR}{{{min_len},{max_len}}}"'

    @staticmethod
    def _bounds(schema: dict) -> tuple[float | None, float | None, bool, bool]:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        lo_ex = hi_ex = False
        emin, emax = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(emin, bool):  # draft 4
            lo_ex = emin
        elif emin is not None:
            if lo is None or emin >= lo:
                lo, lo_ex = emin, True
        if isinstance(emax, bool):
            hi_ex = emax
        elif emax is not None:
            if hi is None or emax <= hi:
                hi, hi_ex = emax, True
        for v in (lo, hi):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"invalid schema: numeric bound {v!r} is not a number")
        return lo, hi, lo_ex, hi_ex

    def integer(self, schema: dict) -> str | None:
        lo, hi, lo_ex, hi_ex = self._bounds(schema)
        lo_i = None if lo is None else (math.floor(lo) + 1 if lo_ex else math.ceil(lo))
        hi_i = None if hi is None else (math.ceil(hi) - 1 if hi_ex else math.floor(hi))
        self._check_multiple(schema)
        return _int_range(lo_i, hi_i)

    def number(self, schema: dict) -> str | None:
        lo, hi, lo_ex, hi_ex = self._bounds(schema)
        self._check_multiple(schema)
        if lo is not None and lo_ex:
            lo = math.floor(lo) + 1
        if hi is not None and hi_ex:
            hi = math.ceil(hi) - 1
        return _number_range(lo, hi)

    @staticmethod
    def _check_multiple(schema: dict) -> None:
        m = schema.get("multipleOf")
        if m is not None and m != 1:
            raise ValueError(f"unsupported schema keyword 'multipleOf' (value {m!r})")

    # -- containers --------------------------------------------------------------------------------
    def array(self, schema: dict, nesting: int) -> str | None:
        min_items = schema.get("minItems", 0)
        max_items = schema.get("maxItems")
        for name, v in (("minItems", min_items), ("maxItems", max_items)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"invalid schema: {name} must be a non-negative integer, got {v!r}")
        if max_items is not None and min_items > max_items:
            return None
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        if isinstance(items, list):  # draft 4 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        open_, close = self.lit("["), self.lit("]")
        if prefix is not None:
            if not isinstance(prefix, list):
                raise ValueError("invalid schema: prefixItems must be a list")
            regs = [self.visit(s, nesting + 1) for s in prefix]
            # Emit exactly k items for the allowed k (k <= len(prefix)); no extra items.
            opts = []
            hi = len(prefix) if max_items is None else min(len(prefix), max_items)
            for k in range(min_items, hi + 1):
                if any(r is None for r in regs[:k]):
                    break
                opts.append(open_ + self.comma.join(regs[:k]) + close if k else open_ + close)
            return _alt(opts)
        if items is None or items is True:
            item = self.any_value(max(0, self.max_nesting_depth - 1))
        else:
            item = self.visit(items, nesting + 1)
        if item is None:
            return open_ + close if min_items == 0 else None
        if max_items == 0:
            return open_ + close
        lo = max(min_items - 1, 0)
        hi = "" if max_items is None else str(max_items - 1)
        rep = f"{{{lo},{hi}}}"
        body = f"{item}(?:{self.comma}{item}){rep}"
        if min_items == 0:
            body = f"(?:{body})?"
        return open_ + body + close

    def object(self, schema: dict, nesting: int) -> str | None:
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise ValueError("invalid schema: properties must be an object")
        required = schema.get("required") or []
        if not isinstance(required, list):
            raise ValueError("invalid schema: required must be a list")
        open_, close = self.lit("{"), self.lit("}")
        addl = schema.get("additionalProperties", None)
        if not props:
            if required:
                # Required keys without declared schemas: any value.
                props = {k: True for k in required}
            else:
                if addl is False:
                    return open_ + close
                value = (self.any_value(max(0, self.max_nesting_depth - 1)) if addl in (None, True)
                         else self.visit(addl, nesting + 1))
                if value is None:
                    return open_ + close
                pair = STRING + self.colon + value
                min_p = schema.get("minProperties", 0)
                max_p = schema.get("maxProperties")
                if max_p == 0:
                    return open_ + close
                lo = max(min_p - 1, 0)
                hi = "" if max_p is None else str(max_p - 1)
                body = f"{pair}(?:{self.comma}{pair}){{{lo},{hi}}}"
                if min_p == 0:
                    body = f"(?:{body})?"
                return open_ + body + close
        for r in required:
            if r not in props:
                props = dict(props)
                props[r] = True
        entries: list[tuple[str, bool]] = []
        for name, sub in props.items():
            value = self.visit(sub, nesting + 1)
            is_req = name in required
            if value is None:
                if is_req:
                    return None
                continue
            entries.append((_escape(json.dumps(name, ensure_ascii=False)) + self.colon + value, is_req))
        if not entries:
            return open_ + close
        comma = self.comma
        first_req = next((i for i, (_, r) in enumerate(entries) if r), None)
        if first_req is not None:
            out = ""
            for reg, _ in entries[:first_req]:
                out += f"(?:{reg}{comma})?"
            out += entries[first_req][0]
            for reg, r in entries[first_req + 1:]:
                out += f"{comma}{reg}" if r else f"(?:{comma}{reg})?"
            return open_ + out + close
        # All optional: choose the first present property, then any later ones in order.
        alts = []
        for i, (reg, _) in enumerate(entries):
            tail = "".join(f"(?:{comma}{r2})?" for r2, _ in entries[i + 1:])
            alts.append(reg + tail)
        return open_ + f"(?:{'|'.join(alts)})?" + close

    def any_value(self, depth: int) -> str:
        prims = [STRING, NUMBER, BOOLEAN, NULL]
        if depth <= 0:
            return "(?:" + "|".join(prims) + ")"
        inner = self.any_value(depth - 1)
        arr = self.lit("[") + f"(?:{inner}(?:{self.comma}{inner})*)?" + self.lit("]")
        obj = self.lit("{") + f"(?:{STRING}{self.colon}{inner}(?:{self.comma}{STRING}{self.colon}{inner})*)?" + self.lit("}")
        return "(?:" + "|".join(prims + [arr, obj]) + ")"


def schema_from_pydantic(model) -> dict:
    """The JSON schema of a pydantic v2 model class (or instance)."""
    if hasattr(model, "model_json_schema"):
        return model.model_json_schema()
    if hasattr(model, "schema"):  # pydantic v1
        return model.schema()
    raise ValueError(f"{model!r} is not a pydantic model")


def _check_schema(schema: Any) -> None:
    try:
        import jsonschema  # optional dependency (the test and dspy extras)
    except ImportError:  # optional: our own checks still catch what we rely on
        return
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        path = "/".join(str(p) for p in e.path)
        raise ValueError(f"invalid schema: {e.message}" + (f" (at {path})" if path else "")) from None


def build_regex_from_schema(schema: Any, whitespace: str = WHITESPACE_DEFAULT, *, max_recursion_depth: int = 3,
                            max_nesting_depth: int = 2, max_string_length: int | None = MAX_STRING_LENGTH) -> str:
    """Regex for JSON documents valid under ``schema`` (``max_string_length``: the default cap of strings
    without ``maxLength``, None for none).

    ``schema`` may be a dict, a JSON string, or a pydantic model class. Raises ``ValueError`` for
    invalid or unsatisfiable schemas and for keywords we cannot honour, and ``budget.GrammarTooComplex`` (also a
    ``ValueError``) past the active compile budget (see ``budget``; the default one when none is active).
    """
    if isinstance(schema, type) or hasattr(schema, "model_json_schema"):
        schema = schema_from_pydantic(schema)
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"invalid schema: not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"invalid schema: expected a JSON object, got {type(schema).__name__}")
    _check_schema(schema)
    conv = _Converter(schema, whitespace, max_recursion_depth, max_nesting_depth)
    conv.max_string_length = max_string_length
    with _budget.active(_budget.GrammarBudget()):  # the caller's budget if one is active, else the default one
        regex = conv.visit(schema)
    if regex is None:
        raise ValueError("schema is unsatisfiable: no JSON value satisfies it (within the supported subset)")
    return regex
