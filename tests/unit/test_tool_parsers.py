"""Tool-call parsers (one per format, whole text and streamed at every split point), the tool-call grammar
(checked with llguidance against the SmolLM2 tokenizer), tools validation, and the reasoning splitter."""

from __future__ import annotations

import json

import pytest

from sglang_backend.runtime.entrypoints.errors import APIError
from sglang_backend.runtime.entrypoints.reasoning import ReasoningStreamParser, split_reasoning
from sglang_backend.runtime.entrypoints.tool_calls import (ToolCallStreamParser, detect_format, parse_tool_calls,
                                                          prompt_messages, tool_constraint, validate_tools)

HERMES = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "d": [1, {"x": "}"}]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "P"}}; {"name": "add", "parameters": {}}'
MISTRAL = 'ok [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "x\\"y"}}, {"name": "add", "arguments": {}}]'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(text: str, fmt: str, step: int):
    """(content, [(name, arguments)]) as a client reassembles the stream split every ``step`` characters."""
    parser, events = ToolCallStreamParser(fmt), []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    content = "".join(e["content"] for e in events if "content" in e)
    calls: dict = {}
    for tc in (e["tool_call"] for e in events if "tool_call" in e):
        c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
        assert ("id" in tc) == (c["name"] == "")  # the id comes once, with the name
        c["name"] += tc["function"].get("name") or ""
        c["arguments"] += tc["function"]["arguments"]
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], parser.calls


@pytest.mark.parametrize("fmt,text,content", [("hermes", HERMES, "Sure."), ("llama3", LLAMA3, None),
                                              ("mistral", MISTRAL, "ok")])
def test_each_format_parses_whole_and_streamed(fmt, text, content):
    got_content, calls = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [n for n, _ in calls_of(calls)] == ["get_weather", "add"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    for step in range(1, 12):  # every split point, tags and JSON strings cut anywhere
        s_content, s_calls, final = streamed(text, fmt, step)
        assert s_calls == calls_of(calls) == calls_of(final), step
        assert s_content.strip() == (content or "")


def test_text_without_calls_stays_content():
    assert parse_tool_calls("just text <tool", "hermes") == ("just text <tool", [])
    assert parse_tool_calls('hello {"name": "f", "parameters": {}}', "llama3")[1] == []  # llama3: JSON first only
    assert parse_tool_calls(' {"name": "f", "parameters": {"a": 1}}', "llama3")[1][0]["function"]["name"] == "f"
    cut = 'x <tool_call>\n{"name": "f", "argu'  # cut off by max_tokens: no call, the text stays
    content, calls = parse_tool_calls(cut, "hermes")
    assert calls == [] and content.startswith("x <tool_call>")


def test_detect_format_from_template():
    assert detect_format("{{ messages }}") == "hermes"  # no tools in the template: the Hermes fallback prompt
    assert detect_format("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_format("{{ tools }} [TOOL_CALLS]") == "mistral"
    assert detect_format("{{ tools }} <|python_tag|> ipython") == "llama3"
    assert detect_format("{{ tools }}", "mistral") == "mistral"
    with pytest.raises(ValueError):
        detect_format("", "bogus")


@pytest.mark.parametrize("tools,choice,needle", [
    ("nope", None, "tools must be a list"),
    ([{"type": "function"}], None, "function must be an object"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], None, "object schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}], None,
     "invalid parameters schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "x" * 70000}}}],
     None, "larger than"),
    (TOOLS + TOOLS[:1], None, "two tools"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "not among the tools"),
    (None, "required", "needs tools"),
    (None, {"type": "function", "function": {"name": "f"}}, "no tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
])
def test_malformed_tools_are_400(tools, choice, needle):
    with pytest.raises(APIError) as e:
        validate_tools(tools, choice)
    assert e.value.status == 400 and needle in e.value.message


def test_history_calls_must_name_declared_tools():
    spec = validate_tools(TOOLS)
    call = {"id": "call_1", "type": "function", "function": {"name": "unknown", "arguments": "{}"}}
    with pytest.raises(APIError, match="not among the tools"):
        prompt_messages([{"role": "assistant", "content": "", "tool_calls": [call]}], spec, False)
    call["function"] = {"name": "add", "arguments": "{not json"}
    with pytest.raises(APIError, match="not JSON"):
        prompt_messages([{"role": "assistant", "content": "", "tool_calls": [call]}], spec, False)
    call["function"] = {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "call_1"}]
    out, extra = prompt_messages(msgs, spec, renders_tools=False)  # fallback: Hermes text in the messages
    assert extra == {} and "<tools>" in out[0]["content"] and out[0]["role"] == "system"
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    out, extra = prompt_messages(msgs, spec, renders_tools=True)  # the template renders tools and calls
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    with pytest.raises(APIError, match="no earlier assistant"):
        prompt_messages(msgs[:3] + [{"role": "tool", "content": "3", "tool_call_id": "call_9"}], spec, True)


@pytest.fixture(scope="module")
def ll_tokenizer():
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf  # noqa: F401  (the submodule: imported here, after the skip check)
    from sglang_backend.runtime.model_loader.embedded import default_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    return tok, llguidance.hf.from_tokenizer(tok)


H_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
H_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize("fmt,choice,parallel,text,accepted", [
    ("hermes", "auto", True, "plain text", True),
    ("hermes", "auto", True, "hi " + H_ADD, True),
    ("hermes", "auto", True, H_ADD + "\n" + H_WEATHER, True),
    ("hermes", "auto", False, H_ADD + "\n" + H_WEATHER, False),  # parallel_tool_calls=false: one call
    ("hermes", "auto", True, 'hi <tool_call>\n{"name": "nope"', False),  # a started call must be valid
    ("hermes", "required", True, "hi " + H_ADD, False),  # required: no text
    ("hermes", "required", True, H_ADD, True),
    ("hermes", NAMED_ADD, True, H_WEATHER, False),
    ("hermes", "required", True, H_ADD.replace('"b": 2', '"b": 2, "c": 3'), False),  # strict: no extra keys
    ("mistral", "auto", True, 'x [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', True),
    ("llama3", "auto", True, '{"name": "add", "parameters": {"a": 1, "b": 2}}', True),
    ("llama3", "auto", True, "text", True),
    ("llama3", "required", True, "text", False),
])
def test_tool_grammar(ll_tokenizer, fmt, choice, parallel, text, accepted):
    import llguidance  # imported by the fixture's skip check

    tok, llt = ll_tokenizer
    grammar = llguidance.grammar_from("ebnf", tool_constraint(validate_tools(TOOLS, choice, parallel), fmt)["ebnf"])
    matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
    assert (matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()) == accepted
    if accepted and "name" in text:
        assert parse_tool_calls(text, fmt)[1]


def test_tool_choice_none_has_no_constraint():
    assert tool_constraint(validate_tools(TOOLS, "none"), "hermes") == {}
    with pytest.raises(APIError, match="cannot be used"):
        tool_constraint(validate_tools([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"not": {"type": "string"}}}, "required": ["x"]}}}], "required"),
            "hermes")


# Reasoning ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parser,text,expected", [
    ("qwen3", "<think>\nhmm\n</think>\n\nAnswer.", ("hmm", "Answer.")),
    ("qwen3", "<think>\n a \n b \n</think>\n\nc \n", ("a \n b", "c \n")),  # layout around reasoning dropped
    ("qwen3", "Answer <think> x", (None, "Answer <think> x")),  # qwen3: only a leading <think> opens reasoning
    ("qwen3", "  <think>cut off", ("cut off", "")),
    ("qwen3", "<thi", (None, "<thi")),
    ("deepseek-r1", "why</think>\n\nok", ("why", "ok")),  # the template opened <think>
    ("deepseek-r1", "<think>why</think>ok", ("why", "ok")),
    ("deepseek-r1", "thinking only", ("thinking only", "")),
    ("none", "<think>a</think>b", (None, "<think>a</think>b")),
])
def test_reasoning_split_whole_and_streamed(parser, text, expected):
    assert split_reasoning(text, parser) == expected
    for step in range(1, 9):  # split points inside the tags
        p, reasoning, content = ReasoningStreamParser(parser), "", ""
        for i in range(0, len(text), step):
            r, c = p.feed(text[i:i + step])
            reasoning, content = reasoning + r, content + c
        r, c = p.finish()
        reasoning, content = reasoning + r, content + c
        assert ((reasoning or None) if p.had_reasoning else None, content) == expected, step


# A chat template in Qwen3's style (tools in the system turn, calls as <tool_call> JSON whose arguments may be a
# dict or a string, tool results as user turns, enable_thinking pre-filling an empty think block).
QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def test_qwen3_style_template_renders_tools_history_and_enable_thinking():
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # transformers renders templates in this sandbox

    from sglang_backend.runtime.entrypoints.tool_calls import template_renders_tools

    assert detect_format(QWEN3_STYLE) == "hermes" and template_renders_tools(QWEN3_STYLE)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "call_1"}]
    out, extra = prompt_messages(msgs, validate_tools(TOOLS), renders_tools=True)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.policies["json.dumps_kwargs"] = {"ensure_ascii": False}
    text = env.from_string(QWEN3_STYLE).render(messages=out, add_generation_prompt=True, enable_thinking=False,
                                               **extra)
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
