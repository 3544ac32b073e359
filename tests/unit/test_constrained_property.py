"""Property test: simulated constrained decoding over SmolLM2's real vocabulary.

Seeded random walks over the token masks (random logits, random temperatures, jump-forward on and off,
re-tokenization through the real tokenizer) must always produce text that full-matches the regex / is a
JSON document valid under the schema. No model is needed, so this is fast.
"""

from __future__ import annotations

import datetime
import json
import random
import re
import uuid

import numpy as np
import pytest
import torch

from sglang_backend.runtime.constrained import GrammarCache, apply_jump_forward, get_vocabulary

REGEXES = [
    # IPv4, dates, times
    r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"([01]\d|2[0-3]):[0-5]\d(:[0-5]\d)?",
    r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z",
    r"(1[0-2]|0?[1-9]):[0-5]\d (AM|PM)",
    # emails, urls, ids
    r"[a-z0-9._%+-]{1,12}@[a-z0-9-]{1,10}\.(com|org|net|io)",
    r"\w+@\w+\.com",
    r"https?://[a-z0-9.-]{1,15}\.[a-z]{2,6}(/[a-z0-9_-]{0,8}){0,3}",
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    r"#[0-9a-fA-F]{6}",
    r"[A-Z]{3}-\d{3}",
    # phone numbers
    r"\(\d{3}\) \d{3}-\d{4}",
    r"\+\d{1,3} \d{3} \d{3} \d{4}",
    # numbers
    r"-?\d+\.\d+",
    r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?",
    r"-?(0|[1-9]\d*)",
    r"\d{1,3}(,\d{3})*",
    r"(100|[1-9]?\d)%",
    r"\d{5}(-\d{4})?",
    r"\d{4}( \d{4}){3}",
    # enums / alternations
    r"(red|green|blue)",
    r"(Excellent|Above Average|Fair|Below Average)",
    r"yes|no",
    r"(true|false)",
    r"(Mr|Mrs|Ms|Dr)\. [A-Z][a-z]{1,10}",
    r"The answer is (\d|10)\.",
    # unicode alternations and classes
    r"霍格沃茨特快列车|霍比特人比尔博",
    r"[\u4e00-\u9fa5]{2,5}",
    r"(😀|😃|😄){1,3}",
    r"[α-ω]{1,8}",
    r"caf[eé] (crème|brûlée)",
    r"[\u0400-\u04FF]{1,6}",
    r"[🌀-🗿]{1,4}",
    r"(你好|こんにちは|안녕하세요|Здравствуйте), (world|世界)!",
    # quantifiers and structure
    r"a{3,5}b{0,2}c?",
    r"(ab|cd)+",
    r"x*y+z?",
    r".{1,10}",
    r"[^\n]{0,20}\n",
    r'"[^"]{0,30}"',
    r"((a|b)(c|d)){2}",
    r"(?i:hello) world",
    r"(?P<year>\d{4})/(?P<month>\d{2})",
    r"\[(\d+(, \d+)*)?\]",
    r"""\{"summary": "[\w\d\s]*", "grade": "[ABCD][+-]?"\}""",
    r"^Step \d: [a-z ]{3,20}\.$",
]

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 40},
                                      "grade": {"enum": ["A", "B", "C", "D"]}}, "required": ["summary", "grade"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string", "format": "email"}},
                 "required": ["id", "email"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"enum": ["霍格沃茨", "比尔博", "café", 42, None, True]},
    {"const": {"version": 1, "tags": ["x", "y"]}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5},
                                      "c": {"type": "boolean"}}},
    {"$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}\\d{3}$"},
                                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                        "required": ["sku", "qty"]}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 3}},
     "required": ["items"]},
    {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "integer"}, {"type": "null"}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0, "maximum": 100}},
                "required": ["kind", "r"]},
               {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1}},
                "required": ["kind", "side"]}]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                      "at": {"type": "string", "format": "time"},
                                      "ts": {"type": "string", "format": "date-time"},
                                      "id": {"type": "string", "format": "uuid"}},
     "required": ["day", "at", "ts", "id"]},
    {"type": "string", "minLength": 3, "maxLength": 10},
    {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^\\(\\d{3}\\) \\d{3}-\\d{4}$"}},
     "required": ["phone"]},
    {"type": "object", "properties": {"t": {"type": "number", "minimum": -10, "maximum": 10},
                                      "p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
     "required": ["t", "p"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "nothing": {"type": "null"},
                                      "maybe": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["flag", "nothing", "maybe"]},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                "required": ["x", "y"]}, "maxItems": 2},
    {"$defs": {"tree": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"},
                                                                  "maxItems": 2}},
                        "required": ["v"]}},
     "$ref": "#/$defs/tree"},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 999}, "maxProperties": 3},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"type": "boolean"}],
     "minItems": 3},
    {"type": "object", "properties": {"payload": {}}, "required": ["payload"]},
    {"type": "object", "properties": {"名前": {"type": "string", "maxLength": 6}, "emoji": {"enum": ["😀", "🚀"]}},
     "required": ["名前", "emoji"]},
    # patterns whose classes admit '"', '\\' and control characters: they must come out JSON-escaped
    {"type": "object", "properties": {"handle": {"type": "string", "pattern": "^\\S{1,12}$"},
                                      "mail": {"type": "string", "pattern": "^[^@]{1,8}@[^@]{1,8}$"}},
     "required": ["handle", "mail"]},
]


def _pydantic_schema():
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=10)
        species: Literal["cat", "dog", "owl"]

    class Owner(BaseModel):
        owner: str = Field(min_length=1, max_length=10)
        pets: list[Pet] = Field(max_length=2)
        nickname: Optional[str] = Field(default=None, max_length=5)

    return Owner.model_json_schema()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # 49k-element ops are ~20 us on one thread but can take milliseconds with 2 intra-op threads on a
    # shared, loaded machine; the simulation does a few per step.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="module")
def grammar_cache(tokenizer, tmp_path_factory):
    cache = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, backend="fsm",  # our engine's internals
                         cache_dir=str(tmp_path_factory.mktemp("fsm_cache")))
    yield cache
    cache.shutdown()


def simulate(grammar, tokenizer, rng: random.Random, jump_forward: bool, max_steps: int = 24):
    """One seeded random decode. Returns (text, number of jump-forwards, hit EOS)."""
    vocab = get_vocabulary(tokenizer)
    m = grammar.matcher()
    out: list[int] = []
    temperature = rng.choice([0.25, 0.7, 1.0, 2.0])
    nrng = np.random.default_rng(rng.randrange(1 << 30))
    eos = next(iter(grammar.eos_token_ids))
    n_jumps, steps, hit_eos = 0, 0, False
    while not m.is_finished() and steps < max_steps:
        if jump_forward:
            before = b"".join(vocab.token_bytes[t] for t in out)
            n_drop, new_ids, forced = apply_jump_forward(m, tokenizer, out)
            if forced:
                out = out[:len(out) - n_drop] + new_ids
                assert b"".join(vocab.token_bytes[t] for t in out) == before + forced.encode()
                n_jumps += 1
                continue
        # Gumbel-max on logits/temperature == a sample from softmax(logits / temperature).
        scores = nrng.standard_normal(grammar.vocab_size, dtype=np.float32) / temperature
        scores += nrng.gumbel(size=grammar.vocab_size).astype(np.float32)
        scores[eos] += 3.0  # make ending in accepting states likely
        logits = torch.from_numpy(scores)
        m.fill_mask(logits)
        tok = int(torch.argmax(logits))
        assert logits[tok] > float("-inf")
        assert m.is_allowed(tok)
        m.advance(tok)
        steps += 1
        if tok == eos:
            hit_eos = True
            break
        out.append(tok)
    if not m.is_finished():
        # Out of steps: close the output along a shortest completion, token by token through the masks.
        for tok in vocab.greedy_tokenize(m.shortest_completion()):
            assert m.is_allowed(tok)
            m.advance(tok)
            out.append(tok)
    assert m.is_accepting()
    data = b"".join(vocab.token_bytes[t] for t in out)
    text = data.decode("utf-8")  # strict: outputs are always valid UTF-8
    assert tokenizer.decode(out) == text
    return text, n_jumps, hit_eos


@pytest.mark.parametrize("idx", range(len(REGEXES)))
def test_random_decodes_match_regex(grammar_cache, tokenizer, idx):
    pattern = REGEXES[idx]
    grammar = grammar_cache.compile("regex", pattern)
    rng = random.Random(1000 + idx)
    check = re.compile(pattern)
    for walk in range(4):
        text, _, _ = simulate(grammar, tokenizer, rng, jump_forward=bool(walk % 2))
        assert check.fullmatch(text), (pattern, text)


def _check_formats(doc, schema):
    """jsonschema does not check formats without optional packages: check ours by parsing."""
    if isinstance(doc, dict):
        props = schema.get("properties", {})
        for k, v in doc.items():
            sub = props.get(k, {})
            fmt = sub.get("format")
            if fmt == "date":
                datetime.date.fromisoformat(v)
            elif fmt == "date-time":
                datetime.datetime.fromisoformat(v)
            elif fmt == "time":
                datetime.time.fromisoformat(v)
            elif fmt == "uuid":
                uuid.UUID(v)
            elif fmt == "email":
                assert re.fullmatch(r"[^@\s]+@[^@\s]+\.[a-zA-Z]{2,}", v), v
            _check_formats(v, sub)


@pytest.mark.parametrize("idx", range(len(SCHEMAS) + 1))
def test_random_decodes_match_json_schema(grammar_cache, tokenizer, idx):
    import jsonschema

    schema = SCHEMAS[idx] if idx < len(SCHEMAS) else _pydantic_schema()
    grammar = grammar_cache.compile("json_schema", json.dumps(schema))
    rng = random.Random(2000 + idx)
    for walk in range(4):
        text, _, _ = simulate(grammar, tokenizer, rng, jump_forward=bool(walk % 2))
        doc = json.loads(text)
        # The draft's own format checker (the global FormatChecker() has draft-3 'time' semantics).
        jsonschema.validate(doc, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        _check_formats(doc, schema)


def test_masks_match_brute_force(grammar_cache, tokenizer):
    """The trie-walk index equals an independent per-token walk of the DFA (token-byte matrix sorted
    by length, one numpy step per byte position, all sampled states at once)."""
    vocab = get_vocabulary(tokenizer)
    eos = tokenizer.eos_token_id
    ids = np.array(sorted((i for i in range(len(vocab.token_bytes)) if vocab.token_bytes[i]),
                          key=lambda i: -len(vocab.token_bytes[i])))
    lens = np.array([len(vocab.token_bytes[i]) for i in ids])
    mat = np.zeros((len(ids), lens.max()), dtype=np.int64)
    for r, i in enumerate(ids.tolist()):
        mat[r, : lens[r]] = list(vocab.token_bytes[i])
    live_rows = [int((lens > j).sum()) for j in range(mat.shape[1])]  # rows still walking at position j
    for pattern in [r"""\{"summary": "[\w\d\s]*", "grade": "[ABCD][+-]?"\}""", r"霍格沃茨特快列车|霍比特人比尔博",
                    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]){0,100}"', r".{0,3}[😀-😂]"]:
        g = grammar_cache.compile("regex", pattern)
        n = g.num_states
        table = np.vstack([np.where(g.dfa.transitions >= 0, g.dfa.transitions, n), np.full((1, 256), n)])
        states = np.array(range(n) if n <= 48 else random.Random(7).sample(range(n), 24))
        cur = np.repeat(states[:, None], len(ids), axis=1)  # [state, token]
        for j, k in enumerate(live_rows):
            cur[:, :k] = table[cur[:, :k], mat[None, :k, j]]
        for row, state in enumerate(states.tolist()):
            expected = np.zeros(g.vocab_size, dtype=bool)
            expected[ids[cur[row] != n]] = True
            expected[eos] = bool(g.dfa.accepting[state])
            assert np.array_equal(g.index.allowed_bool(state), expected), (pattern, state)


def test_jump_forward_saves_steps(grammar_cache, tokenizer):
    """On the paper's regex, jump-forward covers the constant parts without sampling."""
    g = grammar_cache.compile("regex", r"""\{"summary": "[\w\d\s]*", "grade": "[ABCD][+-]?"\}""")
    rng = random.Random(3)
    jumps = [simulate(g, tokenizer, rng, jump_forward=True)[1] for _ in range(3)]
    assert all(j >= 1 for j in jumps)  # at least the opening `{"summary": "`
