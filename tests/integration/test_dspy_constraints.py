"""sglang_dspy.constraints against the prompts real dspy 3.4 adapters render (no model: a recording engine)."""
import json
import os
import re
import sys
import pytest

dspy = pytest.importorskip("dspy")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "adapters", "dspy"))
from sglang_dspy.constraints import constraint_for, output_fields, tool_variants  # noqa: E402

from sglang_backend.runtime.constrained.json_schema import build_regex_from_schema  # noqa: E402


class _Recorder:
    """A canonical engine that records the Request and stops the call."""

    supports_response_schema = True
    supported_params = frozenset({"response_format", "max_tokens", "temperature"})

    def __init__(self):
        self.requests = []

    def complete(self, request):
        self.requests.append(request)
        raise RuntimeError("recorded")

    def close(self):
        pass


def _requests(program, adapter, **inputs):
    rec = _Recorder()
    lm = dspy.LM("sglang/recorder", engine=rec, cache=False, num_retries=0)
    with dspy.context(lm=lm, adapter=adapter):
        with pytest.raises(Exception):
            program(**inputs)
    return rec.requests


Typed = dspy.Signature("number: int -> doubled: int, is_even: bool, size: Literal['small', 'large'], digits: list[int]")


def _full(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


def test_chat_adapter_sections_become_a_regex():
    req = _requests(dspy.Predict(Typed), dspy.ChatAdapter(), number=12)[0]
    fields = output_fields(req.system)
    assert fields == [("doubled", "int"), ("is_even", "bool"), ("size", "Literal['small', 'large']"),
                      ("digits", "list[int]")]
    c = constraint_for(req.system, req.messages[-1].text, req.config.response_format, 40, 3)
    good = "[[ ## doubled ## ]]\n24\n\n[[ ## is_even ## ]]\nTrue\n\n[[ ## size ## ]]\nlarge\n\n" \
           "[[ ## digits ## ]]\n[1, 2]\n\n[[ ## completed ## ]]"
    assert _full(c["regex"], good)
    assert not _full(c["regex"], good.replace("large", "huge"))
    assert not _full(c["regex"], good.replace("[1, 2]", "[1, 2, 3, 4]"))  # max_items
    # What the regex admits, DSPy's ChatAdapter parses into the declared types.
    parsed = dspy.ChatAdapter().parse(Typed, good)
    assert parsed == {"doubled": 24, "is_even": True, "size": "large", "digits": [1, 2]}


def test_chat_adapter_text_fields_cannot_be_the_prompts_placeholder():
    """DSPy's ChatAdapter prompt shows ``{answer}`` where the value goes; SmolLM2-135M copied it as the answer
    (``Prediction(answer='{answer}')``), and variants such as ``{answer, completed}`` once that one alone was ruled
    out. A free-text value may not start with "{" (nor "[" or a space); typed fields keep their own forms."""
    req = _requests(dspy.Predict("question -> answer, next_thought"), dspy.ChatAdapter(), question="hi")[0]
    regex = constraint_for(req.system, req.messages[-1].text, req.config.response_format, 40, 3)["regex"]

    def reply(answer: str, thought: str = "ok") -> str:
        return f"[[ ## answer ## ]]\n{answer}\n\n[[ ## next_thought ## ]]\n{thought}\n\n[[ ## completed ## ]]"

    for bad in ("{answer}", "{answer, completed}", "{ answer }"):
        assert not _full(regex, reply(bad)), bad
    assert not _full(regex, reply("Paris", "{next_thought}"))
    for fine in ("Paris", "Paris {the capital}", "a" * 40):
        assert _full(regex, reply(fine)), fine
    assert not _full(regex, reply("a" * 41))  # max_string_length still holds
    typed = constraint_for(_requests(dspy.Predict("q -> d: dict[str, int]"), dspy.ChatAdapter(), q="hi")[0].system,
                           None, None, 40, 3)["regex"]
    assert _full(typed, '[[ ## d ## ]]\n{"a": 1}\n\n[[ ## completed ## ]]')  # a dict still opens with "{"


def test_json_object_fallback_gets_the_signature_schema_and_react_tool_args():
    def word_length(word: str) -> str:
        """Returns the number of letters in a word."""
        return str(len(word))

    req = _requests(dspy.ReAct("question -> answer", tools=[word_length], max_iters=1), dspy.JSONAdapter(),
                    question="q")[0]
    assert req.config.response_format == {"type": "json_object"}  # what DSPy itself can say (dict[str, Any])
    fields = output_fields(req.system)
    assert [f for f, _ in fields] == ["next_thought", "next_tool_name", "next_tool_args"]
    assert len(tool_variants(req.system, fields)) == 2  # word_length and finish
    c = constraint_for(req.system, None, req.config.response_format, 40, 3)
    regex = build_regex_from_schema(json.loads(c["json_schema"]))
    ok_call = '{"next_thought": "count", "next_tool_name": "word_length", "next_tool_args": {"word": "banana"}}'
    ok_finish = '{"next_thought": "done", "next_tool_name": "finish", "next_tool_args": {}}'
    assert _full(regex, ok_call) and _full(regex, ok_finish)
    assert not _full(regex, ok_call.replace('"word"', '"letters"'))  # args of the chosen tool only
    assert not _full(regex, ok_finish.replace("{}", '{"word": "x"}'))


def test_plain_prompts_are_not_constrained():
    assert constraint_for(None, "hi", None, None, None) == {}


def test_native_tool_calls_constraint_and_parse():
    from dspy.lm15 import FunctionTool

    from sglang_dspy.constraints import parse_tool_calls, with_tool_calls

    tool = FunctionTool(name="word_length", description="Letters in a word.",
                        parameters={"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]})
    call = '{"tool_calls": [{"name": "word_length", "arguments": {"word": "banana"}}]}'
    free = with_tool_calls({}, [tool], False, 40, 3)["regex"]
    assert _full(free, call) and _full(free, "Six letters.")
    assert not _full(free, call.replace("word_length", "other"))
    required = with_tool_calls({"json_schema": '{"type": "object", "properties": {"answer": {"type": "string"}}, '
                                               '"required": ["answer"]}'}, [tool], True, 40, 3)["regex"]
    assert _full(required, call) and not _full(required, '{"answer": "six"}')
    assert parse_tool_calls(call, {"word_length"}) == [("word_length", {"word": "banana"})]
    assert parse_tool_calls('{"answer": "six"}', {"word_length"}) is None
