"""The real ``guidance`` package's ``guidance.models.experimental.SglangModel`` against our server.

SglangModel streams chat completions with logprobs and sends each constraint its own way: ``gen(regex=...)`` as
``extra_body={"regex": ...}``, ``guidance.json`` as a json_schema ``response_format``, and ``select`` / grammars
built from guidance's combinators as ``extra_body={"ebnf": node.ll_grammar()}`` (llguidance's Lark dialect, run by
constrained/llguidance_backend.py). ``sampling_params={"top_k": 1}`` (sent as ``extra_body.top_k``) makes every
request greedy: guidance 0.3.1 never sends ``temperature=0`` (it drops falsy temperatures).
"""

from __future__ import annotations

import json
import re

import pytest

guidance = pytest.importorskip("guidance")
pytest.importorskip("llguidance")

from guidance import assistant, gen, select, user  # noqa: E402
from guidance import json as gjson  # noqa: E402
from guidance.models.experimental import SglangModel  # noqa: E402


@pytest.fixture
def lm(server):
    return SglangModel("default", sampling_params={"top_k": 1}, base_url=server.url + "/v1",
                       api_key=server.api_key)


def ask(lm, question: str, answer):
    with user():
        lm += question
    with assistant():
        lm += answer
    return lm


def test_gen_regex_select_json_and_grammar(lm, oai, monkeypatch):
    from guidance.models.experimental._sglang import SglangInterpreter

    sent = []  # which request field each constraint went out as (the real methods still run)
    for kind in ("regex", "json", "grammar"):
        real = getattr(SglangInterpreter, kind)
        monkeypatch.setattr(SglangInterpreter, kind,
                            lambda self, node, _real=real, _kind=kind, **kw: (sent.append(_kind), _real(self, node, **kw))[1])
    # regex: extra_body.regex; the same request straight through the OpenAI API gives the same greedy text.
    out = ask(lm, "What is 12 + 30? Answer with a number.", gen("n", regex=r"[0-9]{1,3}", max_tokens=5))
    assert re.fullmatch(r"[0-9]{1,3}", out["n"]), out["n"]
    direct = oai.chat.completions.create(model="default", temperature=0, max_tokens=5,
                                         messages=[{"role": "user", "content": "What is 12 + 30? Answer with a number."}],
                                         extra_body={"regex": r"[0-9]{1,3}"})
    assert direct.choices[0].message.content == out["n"]

    # select: an ebnf (Lark) grammar with the options as alternatives.
    out = ask(lm, "Is the sky blue on a clear day? Answer yes or no.", select(["yes", "no"], name="yn"))
    assert out["yn"] in ("yes", "no")
    print("guidance captures:", {"n": direct.choices[0].message.content, "yn": out["yn"]})

    # json: response_format json_schema.
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"]}
    out = ask(lm, "Alice is 30 years old. Give her name and age as JSON.", gjson("person", schema=schema))
    person = json.loads(out["person"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 20
    print("guidance json:", out["person"])

    # A grammar built from guidance combinators (literal text + nested select + regex gen): one ebnf request.
    program = ("The capital of France is " + select(["Paris", "Rome", "Berlin"], name="city") + ". It has "
               + gen("count", regex=r"[1-9][0-9]?", max_tokens=3) + " bridges.")
    out = ask(lm, "Write one sentence about the capital of France and its bridges.", program)
    assert out["city"] in ("Paris", "Rome", "Berlin") and re.fullmatch(r"[1-9][0-9]?", out["count"])
    assert str(out).rstrip().endswith(f"The capital of France is {out['city']}. It has {out['count']} bridges.")
    assert sent == ["regex", "grammar", "json", "grammar"], sent  # select and the program went out as ebnf


def test_ebnf_over_the_openai_api(oai, server):
    grammar = 'root ::= "Answer: " ("yes" | "no") "."'
    msgs = [{"role": "user", "content": "Is water wet? Answer yes or no."}]
    r = oai.chat.completions.create(model="default", temperature=0, max_tokens=10, messages=msgs,
                                    extra_body={"ebnf": grammar})
    assert re.fullmatch(r"Answer: (yes|no)\.", r.choices[0].message.content), r.choices[0].message.content
    # Streamed with logprobs, as SglangModel asks: the pieces add up to the same text.
    stream = oai.chat.completions.create(model="default", temperature=0, max_tokens=10, messages=msgs, stream=True,
                                         logprobs=True, top_logprobs=5, extra_body={"ebnf": grammar})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    with server.client() as http:
        bad = http.post("/v1/chat/completions", json={"model": "default", "messages": msgs, "max_tokens": 4,
                                                      "ebnf": "root ::= undefined_rule"})
    assert bad.status_code == 400 and "ebnf" in bad.json()["error"]["message"], bad.text
