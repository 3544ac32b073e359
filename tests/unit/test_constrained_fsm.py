"""Regex -> byte DFA, compressed FSM (paper Fig. 4), and JSON schema -> regex, without a tokenizer."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from sglang_backend.runtime.constrained.compressed_fsm import CompressedFSM, utf8_complete_prefix_len
from sglang_backend.runtime.constrained.json_schema import (
    DATE,
    DATE_TIME,
    _int_range,
    _number_range,
    build_regex_from_schema,
)
from sglang_backend.runtime.constrained.regex_fsm import compile_regex

# The paper's Fig. 2 / Fig. 4 regex (written as the paper does; `\{`/`\}` are literal braces).
PAPER_REGEX = r"""\{"summary": "[\w\d\s]*", "grade": "[ABCD][+-]?"\}"""
FIG4_REGEX = r"""\{"summary": "[\w\d\s]*", "grade": "[ABCD]"\}"""


# ---------------------------------------------------------------------------------------------
# regex -> byte DFA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, yes, no",
    [
        (r"\d{3}-\d{4}", ["555-1234"], ["5551234", "555-123", "55a-1234"]),
        (r"(red|green|blue)", ["red", "blue"], ["re", "redd", ""]),
        (r"a{2,3}b?", ["aa", "aab", "aaab"], ["a", "aaaab", "b"]),
        (r"霍格沃茨特快列车|霍比特人比尔博", ["霍格沃茨特快列车", "霍比特人比尔博"], ["霍", "霍比", "霍格沃茨"]),
        (r"[\u4e00-\u9fa5]{2}", ["你好", "中文"], ["你", "ab", "你好吗"]),
        (r"caf[eé]", ["cafe", "café"], ["cafè", "caf"]),
        (r"^abc$", ["abc"], ["ab", "abcd"]),
        (r"\Aabc\Z", ["abc"], ["abcc"]),
        (r"(?i:hello)", ["hello", "HeLLo"], ["hell"]),
        (r"[^\n]+", ["x y", "😀"], ["a\nb", ""]),
        (r".", ["a", "é", "霍", "😀", "\x00"], ["\n", "ab"]),
        (r"[😀-😂]+", ["😀😂", "😁"], ["😃", ""]),
        (r"\x41\u0042", ["AB"], ["A"]),
        (r"a\$b", ["a$b"], ["ab"]),
    ],
)
def test_regex_accepts_and_rejects(pattern, yes, no):
    dfa = compile_regex(pattern)
    for s in yes:
        assert dfa.accepts(s), (pattern, s)
    for s in no:
        assert not dfa.accepts(s), (pattern, s)


def test_byte_dfa_only_accepts_valid_utf8():
    dfa = compile_regex(r".*")
    assert dfa.accepts("héllo 霍 😀".encode())
    for bad in [b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff", b"\x80", b"\xe4\xbd"]:
        assert not dfa.accepts(bad), bad
    # A character's bytes are intermediate states: half a character is a live prefix, not a match.
    s = dfa.walk(dfa.initial, "霍".encode()[:2])
    assert s >= 0 and not dfa.accepting[s]


def test_dfa_is_trimmed():
    dfa = compile_regex(r"ab|ac|(x|y)*z")
    dist = dfa.distances_to_accept()
    assert (dist >= 0).all()  # every state can still reach acceptance
    assert dfa.accepts(dfa.shortest_completion(dfa.initial))


@pytest.mark.parametrize(
    "pattern, reason",
    [
        ("(ab", "missing )"),
        ("[b-a]", "bad character range"),
        ("a{3,1}", "min repeat greater than max"),
        (r"(a)\1", "unsupported"),
        (r"\bword\b", "unsupported"),
        (r"(?<=a)b", "unsupported"),
        ("*a", "nothing to repeat"),
    ],
)
def test_invalid_regex_raises(pattern, reason):
    with pytest.raises(ValueError, match=r"invalid regex") as ei:
        compile_regex(pattern)
    assert reason in str(ei.value)


@pytest.mark.parametrize("pattern", [r"[^\s\S]", r"a[^\w\W]b", r"(?=b)a"])
def test_unsatisfiable_regex_raises(pattern):
    with pytest.raises(ValueError, match="matches no string"):
        compile_regex(pattern)


def test_regex_too_complex_raises():
    # (a|b)*a(a|b){n} needs 2**(n+1) DFA states.
    with pytest.raises(ValueError, match="regex too complex"):
        compile_regex(r"(a|b)*a(a|b){16}", max_byte_states=5000)
    with pytest.raises(ValueError, match="regex too complex"):
        compile_regex(r"(a|b)*a(a|b){16}", max_char_states=5000, engine="interegular")
    with pytest.raises(ValueError, match="regex too complex"):
        compile_regex(r"(a|b)*a(a|b){20}", timeout_s=0.2)
    with pytest.raises(ValueError, match="regex too complex"):
        compile_regex(r"[\u4e00-\u9fa5]{40}", max_byte_states=100)


def test_non_string_regex_raises():
    with pytest.raises(ValueError, match="invalid regex"):
        compile_regex(123)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Compressed FSM (paper §4, Fig. 4; Appendix B.1)
# ---------------------------------------------------------------------------------------------


def test_fig4_compressed_edges():
    dfa = compile_regex(FIG4_REGEX)
    cfsm = CompressedFSM(dfa)
    # From the start state, `{"summary": "` is ONE compressed edge (all its edges are singular).
    edges = cfsm.edges(dfa.initial)
    assert len(edges) == 1
    label, inside = edges[0]
    assert label == b'{"summary": "'
    assert cfsm.forced_text(dfa.initial) == '{"summary": "'
    # Inside the string there is a choice: nothing is forced.
    assert cfsm.forced_bytes(inside) == b""
    # Closing the string: `", "grade": "` is one compressed edge, then a choice among [ABCD].
    closing = [(lab, tgt) for lab, tgt in cfsm.edges(inside) if lab.startswith(b'"')]
    assert closing == [(b'", "grade": "', closing[0][1])]
    grade = closing[0][1]
    grade_edges = {lab: tgt for lab, tgt in cfsm.edges(grade)}
    # Each grade letter is followed by the forced tail `"}` which ends in the accepting state.
    assert set(grade_edges) == {b'A"}', b'B"}', b'C"}', b'D"}'}
    final = grade_edges[b'A"}']
    assert dfa.accepting[final] and cfsm.edges(final) == []
    # The compressed graph: start -> inside-string states (one-character edges among themselves; the
    # DFA is not minimised, so "just opened" and "after a character" may be two states) -> grade -> final.
    g = cfsm.graph()
    string_states = set(g) - {dfa.initial, grade, final}
    assert inside in string_states
    for s in string_states:
        for lab, tgt in g[s]:
            if lab.startswith(b'"'):
                assert (lab, tgt) == (b'", "grade": "', grade)
            else:
                assert len(lab) == 1 and re.fullmatch(r"[\w\d\s]", lab.decode()) and tgt in string_states


def test_paper_regex_forced_strings():
    dfa = compile_regex(PAPER_REGEX)
    cfsm = CompressedFSM(dfa)
    s = dfa.walk(dfa.initial, b'{"summary": "good essay", "grade": "B')
    # After the letter: optional [+-] then `"}` -> a choice, nothing forced.
    assert cfsm.forced_text(s) == ""
    s2 = dfa.walk(s, b"+")
    assert cfsm.forced_text(s2) == '"}'
    assert dfa.accepting[dfa.walk(s2, b'"}')]


def test_forced_string_stops_at_accepting_state_and_choices():
    dfa = compile_regex(r"abc(def)?")
    cfsm = CompressedFSM(dfa)
    assert cfsm.forced_bytes(dfa.initial) == b"abc"  # stops ON the accepting state
    s = dfa.walk(dfa.initial, b"abc")
    assert dfa.accepting[s] and cfsm.forced_bytes(s) == b""  # accepting with continuation: a choice
    assert cfsm.forced_bytes(dfa.walk(s, b"d")) == b"ef"


def test_forced_text_multibyte():
    dfa = compile_regex("霍格沃茨特快列车|霍比特人比尔博")
    cfsm = CompressedFSM(dfa)
    assert cfsm.forced_text(dfa.initial) == "霍"  # the shared first character
    s = dfa.walk(dfa.initial, "霍比".encode())
    assert cfsm.forced_text(s) == "特人比尔博"
    # After the lead byte E6 shared by 格 (E6 A0 BC) and 比 (E6 AF 94) there is still a choice.
    assert cfsm.forced_bytes(dfa.walk(dfa.initial, "霍格".encode()[:4])) == b""
    # Mid-character (a token ended inside 格): the rest of the character is forced as bytes,
    # but there is no whole-character text to jump with.
    mid = dfa.walk(dfa.initial, "霍格".encode()[:5])
    assert cfsm.forced_bytes(mid) == "霍格沃茨特快列车".encode()[5:]
    assert cfsm.forced_text(mid) == ""


def test_utf8_complete_prefix_len():
    data = "a霍b".encode()
    for cut in range(len(data) + 1):
        n = utf8_complete_prefix_len(data[:cut])
        data[:n].decode("utf-8")  # whole characters
        assert cut - n < 3


# ---------------------------------------------------------------------------------------------
# JSON schema -> regex
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lo, hi",
    [(0, 150), (1, 9), (7, 7), (-20, 5), (-105, -3), (95, 1005), (0, None), (13, None), (None, 42), (None, -7),
     (-3, None)],
)
def test_integer_ranges_exact(lo, hi):
    rx = re.compile(_int_range(lo, hi))
    for v in range(-1200, 1200):
        expected = (lo is None or v >= lo) and (hi is None or v <= hi)
        assert bool(rx.fullmatch(str(v))) == expected, (lo, hi, v)
    assert not rx.fullmatch("007")


@pytest.mark.parametrize("lo, hi", [(0, 10), (-5, 5), (-10.5, -2.5), (1, None), (None, 0)])
def test_number_ranges_sound(lo, hi):
    rx = re.compile(_number_range(lo, hi))
    for v in ["0", "-0", "1.5", "10", "10.0", "10.01", "-5", "-5.5", "-2.5", "-3", "123", "-0.5", "7.25"]:
        if rx.fullmatch(v):
            x = float(v)
            assert (lo is None or x >= lo) and (hi is None or x <= hi), (lo, hi, v)


def test_date_regex_exact():
    import datetime

    rx = re.compile(DATE)
    day = datetime.date(1999, 1, 1)
    while day.year < 2005:  # includes the 2000 (leap) and 2004 leap days
        assert rx.fullmatch(day.isoformat())
        day += datetime.timedelta(days=1)
    for bad in ["2023-02-29", "1900-02-29", "2023-04-31", "2023-13-01", "2023-00-10", "2023-1-01"]:
        assert not rx.fullmatch(bad), bad
    assert rx.fullmatch("2000-02-29") and rx.fullmatch("2024-02-29")
    assert re.fullmatch(DATE_TIME, "2024-02-29T23:59:59.123+05:30")


def test_schema_layout_default_and_compact():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}}},
              "required": ["a", "b"]}
    doc = {"a": 1, "b": [True, False]}
    assert re.fullmatch(build_regex_from_schema(schema), json.dumps(doc))
    assert re.fullmatch(build_regex_from_schema(schema, whitespace="compact"), json.dumps(doc, separators=(",", ":")))
    flex = build_regex_from_schema(schema, whitespace=r"[ \n]{0,2}")
    assert re.fullmatch(flex, '{ "a" : 1 ,\n"b":[ true,false ] }')


def test_schema_optional_properties_all_subsets():
    props = {k: {"type": "integer"} for k in "abcd"}
    for required in [[], ["b"], ["a", "d"], ["a", "b", "c", "d"]]:
        rx = re.compile(build_regex_from_schema({"type": "object", "properties": props, "required": required}))
        for r in range(5):
            for keys in itertools.combinations("abcd", r):
                doc = json.dumps({k: 1 for k in keys})
                assert bool(rx.fullmatch(doc)) == set(required).issubset(keys), (required, doc)


def test_schema_arrays_min_max_items():
    rx = re.compile(build_regex_from_schema({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}))
    for n in range(6):
        assert bool(rx.fullmatch(json.dumps(list(range(n))))) == (2 <= n <= 3)


def test_schema_refs_and_recursion():
    schema = {
        "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                           "next": {"$ref": "#/$defs/node"}}, "required": ["v"]}},
        "$ref": "#/$defs/node",
    }
    rx = re.compile(build_regex_from_schema(schema))
    assert rx.fullmatch('{"v": 1, "next": {"v": 2}}')
    assert rx.fullmatch('{"v": 1}')
    # A required recursive branch cannot be bounded: unsatisfiable.
    bad = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
           "$ref": "#/$defs/n"}
    with pytest.raises(ValueError, match="unsatisfiable"):
        build_regex_from_schema(bad)


@pytest.mark.parametrize(
    "schema, match",
    [
        ({"type": "strin"}, "invalid schema"),
        ({"type": "string", "minLength": -1}, "invalid schema"),
        ({"$ref": "#/$defs/missing"}, "cannot resolve"),
        ({"$ref": "http://example.com/s.json"}, "only local"),
        ("{not json", "not valid JSON"),
        ([1, 2], "expected a JSON object"),
        ({"type": "string", "pattern": "(unclosed"}, "invalid schema"),
        ({"not": {"type": "string"}}, "unsupported schema keyword"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "unsatisfiable"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "unsatisfiable"),
        ({"enum": []}, "invalid schema"),
        (False, "unsatisfiable"),
    ],
)
def test_invalid_or_unsatisfiable_schema(schema, match):
    with pytest.raises(ValueError, match=match):
        build_regex_from_schema(schema)


@pytest.mark.parametrize("pattern", [r"^\d{5}$", r"[^@]+@[^@]+", r".{2}", r"\S+", r"(?i:ab)c", r'a"b', r"[\n\t ]x",
                                     r"[\u4e00-\u9fa5]+"])
def test_schema_pattern_is_json_escaped(pattern):
    """A string's `pattern` applies to the decoded value; the regex is over its JSON encoding."""
    rx = re.compile(build_regex_from_schema({"type": "string", "pattern": pattern}))
    for value in ["12345", "a@b", '"@\\', 'x"', "\n\t", "ab", "ABc", 'a"b', "\nx", "AB123", "é€", "中文"]:
        expected = bool(re.fullmatch(pattern.strip("^$"), value))
        assert bool(rx.fullmatch(json.dumps(value, ensure_ascii=False))) == expected, (pattern, value)
    with pytest.raises(ValueError, match="lookarounds"):
        build_regex_from_schema({"type": "string", "pattern": "(?=a)a"})


def test_pydantic_model_schema():
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=20)
        zip: str = Field(pattern=r"^\d{5}$")

    class Person(BaseModel):
        name: str
        age: int = Field(ge=0, le=130)
        role: Literal["admin", "user"]
        address: Address
        nickname: Optional[str] = None

    rx = re.compile(build_regex_from_schema(Person))
    doc = Person(name="Ann", age=31, role="user", address=Address(city="Oslo", zip="01234"))
    assert rx.fullmatch(json.dumps(doc.model_dump(exclude_none=True)))
    assert rx.fullmatch(json.dumps(doc.model_dump()))  # nickname: null
    assert not rx.fullmatch(json.dumps({**doc.model_dump(), "age": 131}))


# ---------------------------------------------------------------------------------------------
# The two regex engines agree (byte NFA + subset construction vs interegular's to_fsm)
# ---------------------------------------------------------------------------------------------

ENGINE_PATTERNS = [
    PAPER_REGEX,
    r"霍格沃茨特快列车|霍比特人比尔博",
    r"[\u4e00-\u9fa5]{2,5}",
    r"(😀|😃|😄){1,3}",
    r".{1,6}",
    r"(?s:.)x",
    r"(?i)caf[eé]",
    r"[^\n]{0,8}\n",
    r"(a|)+b",
    r"\x00[\x01-\x7f]|[^a-z]{2}",
    r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    build_regex_from_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 5},
                                                              "n": {"type": "number"}}}),
]


def _random_members(dfa, rng, count=25):
    out = []
    for _ in range(count):
        s, data = dfa.initial, bytearray()
        for _ in range(rng.randrange(0, 40)):
            row = dfa.row(s)
            opts = [b for b in range(256) if row[b] >= 0]
            if not opts:
                break
            b = rng.choice(opts)
            data.append(b)
            s = row[b]
        data += dfa.shortest_completion(s)
        out.append(bytes(data))
    return out


@pytest.mark.parametrize("pattern", ENGINE_PATTERNS)
def test_engines_agree(pattern):
    import random

    a = compile_regex(pattern, engine="nfa")
    b = compile_regex(pattern, engine="interegular")
    rng = random.Random(0)
    flags = re.S if "(?s" in pattern else 0
    for x, y in ((a, b), (b, a)):
        for data in _random_members(x, rng):
            assert y.accepts(data), (pattern, data)
            assert re.fullmatch(pattern, data.decode("utf-8"), flags), (pattern, data)
    # Random byte strings: same verdicts.
    for _ in range(200):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 8)))
        assert a.accepts(data) == b.accepts(data)


def test_lookahead_falls_back_to_interegular():
    dfa = compile_regex(r"(?=ab)\w+")  # lookaround: not in the NFA engine; to_fsm handles it
    assert dfa.accepts("abc") and not dfa.accepts("bac")
    with pytest.raises(ValueError, match="NFA engine"):
        compile_regex(r"(?=ab)\w+", engine="nfa")
