"""Upstream SGLang frontend features that programs written for ``import sglang as sgl`` use (issue 28), each
exercised the way upstream's programs use it, on the in-process backend (the server and OpenAI-route cases are
in tests/integration/test_lang_upstream_compat.py)."""

from __future__ import annotations

import copy
import importlib
import io
import re

import pytest

import sglang_backend as sgl
from sglang_backend.lang.backends.base import BaseBackend
from sglang_backend.lang.backends.runtime_endpoint import Runtime
from tests.unit.test_lang import backend  # noqa: F401 - the same in-process backend fixture (the default backend)
from tests.upstream_programs import (
    check_cache_prefills_the_prefix,
    check_cot_step_0,
    check_pin_keeps_the_prefix,
    check_parallel_encoding,
    check_think_then_color,
    few_shot_qa,
    gen_character_spec,
)


# gen(max_tokens=0, top_logprobs_num=k): the next token's top-k (upstream's cot_decoding) -----------------------
def test_prefill_only_gen_returns_next_token_top_logprobs(backend):
    check_cot_step_0()


def test_prefill_only_top_logprobs_is_the_greedy_next_token(backend):
    prompt = "The capital of France is"

    @sgl.function
    def peek(s):
        s += prompt
        s += sgl.gen("peek", max_tokens=0, return_logprob=True, top_logprobs_num=2)

    meta = peek.run().get_meta_info("peek")
    assert meta["output_token_logprobs"] == []  # nothing was generated...
    greedy = backend.engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})
    assert meta["output_top_logprobs"][0][0][1] == greedy["output_ids"][0]  # ...but the next token is ranked


# forks += lambda i: ... (upstream's parallel_encoding) ------------------------------------------------------------
def test_fork_group_iadd_with_a_function_of_the_branch_index(backend):
    check_parallel_encoding()

    @sgl.function
    def traced(s):
        forks = s.fork(2)
        forks += lambda i: f"branch {i}" + sgl.gen("x")
        forks.join()

    texts = [n.value for n in traced.trace().nodes if n.kind == "text"]
    assert texts == ["branch 0", "branch 1"]


# sgl.global_config, get_model_name, Runtime.endpoint ---------------------------------------------------------------
def test_global_config_holds_the_default_backend_and_model_name(backend, smollm_engine):
    assert sgl.global_config.default_backend is backend  # set_default_backend writes it
    model_path = sgl.global_config.default_backend.endpoint.get_model_name()  # upstream's gen_min_new_tokens
    assert model_path == str(smollm_engine.model_dir)
    from sglang_backend.srt.hf_transformers_utils import get_tokenizer  # noqa: E402 - what that program does next

    assert get_tokenizer(model_path).encode("Paris") == smollm_engine.tokenizer.encode("Paris")


def test_global_config_verbosity_prints_the_text(backend, capsys):
    @sgl.function
    def hello(s):
        s += "Hello" + sgl.gen("x", max_tokens=2, temperature=0)

    sgl.global_config.verbosity = 2
    try:
        state = hello.run()
    finally:
        sgl.global_config.verbosity = 0
    assert state.text() in capsys.readouterr().out


def test_runtime_endpoint_is_an_attribute_and_still_callable():
    runtime = Runtime.__new__(Runtime)  # no server: only the attribute's shape is under test
    runtime.process = None
    assert runtime.endpoint is runtime
    runtime.endpoint.chat_template = sgl_chat_template("vicuna_v1.1")  # upstream's llava examples
    assert runtime.get_chat_template().name == "vicuna_v1.1"
    assert runtime.endpoint() is runtime  # the method form it used to have


def sgl_chat_template(name):
    from sglang_backend.lang.chat_template import get_chat_template  # noqa: E402 - upstream's import path

    return get_chat_template(name)


# SglFunction.cache(backend) and trace().last_node.print_graph_dfs() (upstream's test_bind_cache) ---------------------
def test_bind_trace_prints_the_graph():
    few_shot_qa_2 = few_shot_qa.bind(prompt="The following are questions with answers.\n\n")
    printed = few_shot_qa_2.trace().last_node.print_graph_dfs()
    lines = printed.splitlines()
    assert lines[0].startswith("%0 = text('The following are questions") and "argument('question')" in printed
    assert lines[-1].startswith("%") and "gen('answer')" in lines[-1]
    assert [int(re.match(r"%(\d+)", line).group(1)) for line in lines] == list(range(len(lines)))


def test_cache_prefills_the_bound_constant_prefix(backend):
    check_cache_prefills_the_prefix(backend, "issue 28, in-process")


def test_pin_keeps_the_bound_prefix_until_unpin(backend):
    check_pin_keeps_the_prefix(backend, lambda: backend.engine.get_stats()["session_pinned_tokens"],
                               "issue 28, in-process")


def test_pin_on_a_backend_without_kv_control_is_a_no_op():
    be = CannedBackend()
    few_shot_qa.bind(prompt="The following are questions with answers, long enough to be a prefix hint.\n\n").pin(be)
    few_shot_qa.unpin(be)  # nothing was pinned: nothing to release


# sgl.separate_reasoning ----------------------------------------------------------------------------------------------
class CannedBackend(BaseBackend):
    """Answers every gen with the next canned text (a reasoning model without the model)."""

    def __init__(self, *outputs):
        self.outputs = list(outputs)

    def generate(self, s, sampling_params):
        return self.outputs.pop(0), {"finish_reason": "stop"}


def test_separate_reasoning_splits_the_gen_variable_and_the_text():
    @sgl.function
    def ask(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer"), model_type="deepseek-r1"))
        s += sgl.user("And in one word?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("short"), model_type="qwen3"))

    be = CannedBackend("The user asks about France.</think>\n\nParis is the capital.", "<think>Short.</think>Paris")
    state = ask.run(question="What is the capital of France?", backend=be)
    assert state["answer"] == "Paris is the capital."
    assert state["answer_reasoning_content"] == "The user asks about France."
    assert state["short"] == "Paris" and state["short_reasoning_content"] == "Short."
    assert "</think>" not in state.text() and "France.</think>" not in state.text()
    assert [m["content"] for m in state.messages() if m["role"] == "assistant"] == ["Paris is the capital.", "Paris"]


def test_separate_reasoning_ir_and_errors():
    gen = sgl.gen("answer")
    expr = sgl.separate_reasoning(gen, model_type="deepseek-r1")
    from sglang_backend.lang.ir import SglSeparateReasoning  # noqa: E402 - upstream's import path of the node

    assert expr.expr_list[0] is gen  # upstream's attribute names and repr
    node = expr.expr_list[-1]
    assert isinstance(node, SglSeparateReasoning) and node.name == "answer_reasoning_content"
    assert node.process_name_for_reasoning("other") == "other_reasoning_content"
    assert repr(node) == "SeparateReasoning(model_type=deepseek-r1, name=answer_reasoning_content)"
    with pytest.raises(ValueError, match="named gen"):
        sgl.separate_reasoning(sgl.gen(), model_type="deepseek-r1").exprs[-1].name
    with pytest.raises(Exception, match="unknown model_type"):
        split_one("x", "nope")["a_reasoning_content"]
    # qwen3: no <think> at the start -> no reasoning, the whole output is the answer
    state = split_one("just an answer", "qwen3")
    assert state["a"] == "just an answer" and state["a_reasoning_content"] == ""


def split_one(output: str, model_type: str):
    """A one-gen program whose gen answers ``output``, split as ``model_type``."""
    program = sgl.function(lambda s: s.__iadd__(sgl.separate_reasoning(sgl.gen("a"), model_type=model_type)))
    return program.run(backend=CannedBackend(output))


def test_separate_reasoning_on_the_engine(backend):
    check_think_then_color()


def test_separate_reasoning_uses_the_reasoning_parser_module():
    """The interpreter builds ``srt.reasoning_parser.ReasoningParser(model_type)`` at each split, as upstream's
    does, so a test that patches that name (upstream's test_separate_reasoning_execution) changes the split; the
    parser itself has upstream's ``parse_non_stream`` / ``parse_stream_chunk`` and refuses unknown types."""
    from unittest import mock

    from sglang_backend.lang.interpreter import StreamExecutor
    from sglang_backend.lang.ir import SglGen, SglSeparateReasoning
    from sglang_backend.srt.reasoning_parser import ReasoningParser

    assert ReasoningParser("deepseek-r1").parse_non_stream("why</think>Paris") == ("why", "Paris")
    streamed = ReasoningParser("qwen3")
    pieces = [streamed.parse_stream_chunk(c) for c in ("<think>a", "b</think>", "Paris")]
    assert "".join(r for r, _ in pieces) == "ab" and "".join(t for _, t in pieces) == "Paris"
    with pytest.raises(ValueError, match="unknown model_type"):
        ReasoningParser("no-such-model")

    class Upper:
        def __init__(self, model_type):
            self.model_type = model_type

        def parse_non_stream(self, text):
            return f"R:{self.model_type}", text.upper()

    ex = StreamExecutor(CannedBackend(), {}, sgl.lang.ir.SglSamplingParams(), chat_template=None, use_thread=False)
    ex._set_var("v", "content")
    ex.text_ = "content"
    with mock.patch("sglang_backend.srt.reasoning_parser.ReasoningParser", Upper):
        ex._execute_separate_reasoning(SglSeparateReasoning("deepseek-r1", expr=SglGen("v")))
    assert ex.variables["v"] == "CONTENT" and ex.variables["v_reasoning_content"] == "R:deepseek-r1"
    assert ex.text_ == "CONTENT"


# Upstream module paths ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module, name, target", [
    ("sglang_backend.lang.backend.runtime_endpoint", "RuntimeEndpoint", "sglang_backend.lang.backends.runtime_endpoint"),
    ("sglang_backend.lang.backend.runtime_endpoint", "Runtime", "sglang_backend.lang.backends.runtime_endpoint"),
    ("sglang_backend.lang.backend.openai", "OpenAI", "sglang_backend.lang.backends.openai"),
    ("sglang_backend.lang.backend.base_backend", "BaseBackend", "sglang_backend.lang.backends.base"),
    # older upstream's package path (test/lang/test_bind_pin.py imports it)
    ("sglang_backend.backend.runtime_endpoint", "RuntimeEndpoint", "sglang_backend.lang.backends.runtime_endpoint"),
    ("sglang_backend.backend.openai", "OpenAI", "sglang_backend.lang.backends.openai"),
    ("sglang_backend.backend.base_backend", "BaseBackend", "sglang_backend.lang.backends.base"),
    ("sglang_backend.srt.reasoning_parser", "ReasoningParser", "sglang_backend.lang.reasoning"),
    ("sglang_backend.lang.chat_template", "get_chat_template", "sglang_backend.lang.chat_template"),
    # newer upstream keeps hf_transformers_utils under srt/utils/ (test_programs' gen_min_new_tokens imports it there)
    ("sglang_backend.srt.utils.hf_transformers_utils", "get_tokenizer", "sglang_backend.srt.hf_transformers_utils"),
])
def test_upstream_module_paths_are_aliases(module, name, target):
    assert getattr(importlib.import_module(module), name) is getattr(importlib.import_module(target), name)


def test_function_takes_the_older_spec_tokens_name():
    """``@function(api_num_spec_tokens=N)`` (upstream's test_openai_spec still uses the older name) is
    ``num_api_spec_tokens``."""
    assert sgl.function(api_num_spec_tokens=64)(lambda s: None).num_api_spec_tokens == 64
    assert sgl.function(num_api_spec_tokens=32)(lambda s: None).num_api_spec_tokens == 32


def test_is_hip_is_false():
    from sglang_backend.srt.utils import is_hip  # noqa: E402 - path under test (upstream's test_programs imports it)

    assert is_hip() is False


def test_build_regex_from_object_takes_a_pydantic_model():
    from pydantic import BaseModel

    from sglang_backend.srt.constrained.outlines_backend import build_regex_from_object  # noqa: E402 - path under test

    class Character(BaseModel):
        name: str
        age: int

    regex = build_regex_from_object(Character)
    assert re.fullmatch(regex, '{"name": "Harry", "age": 11}')
    assert build_regex_from_object({"type": "integer"}) == build_regex_from_object('{"type": "integer"}')


def test_load_image_returns_upstreams_pair(tmp_path):
    from PIL import Image

    from sglang_backend.srt.utils import load_image  # noqa: E402 - path under test

    path = tmp_path / "red.png"
    Image.new("RGB", (3, 2), "red").save(path)
    buf = io.BytesIO()
    Image.new("RGB", (5, 4)).save(buf, "PNG")
    for source in (str(path), buf.getvalue()):
        image, size = load_image(source)
        assert image.mode == "RGB" and size is None
    assert load_image(str(path))[0].size == (3, 2)


def test_upstream_chat_template_names():
    for name in ("chatml", "chatml-llava", "qwen", "vicuna_v1.1", "llama-2-chat", "llama-3-instruct", "default"):
        template = sgl_chat_template(name)
        assert template.name == name and set(template.role_prefix_and_suffix) >= {"system", "user", "assistant"}
    assert sgl_chat_template("chatml-llava").image_token == "<image>\n"


# OpenAI backend: chat-model speculative execution and images (a recording client stands in for the API) ----------
class RecordingChatAPI:
    def __init__(self, *replies):
        self.replies, self.calls = list(replies), []

    def create(self, **kwargs):
        from types import SimpleNamespace as NS  # noqa: E402 - the response shape of openai's client

        self.calls.append(copy.deepcopy(kwargs))  # the messages list grows after the call
        message = NS(content=self.replies.pop(0))
        return NS(choices=[NS(message=message, finish_reason="stop")], usage=NS(prompt_tokens=10, completion_tokens=5))


def openai_chat_backend(*replies):
    from types import SimpleNamespace as NS  # noqa: E402 - a stand-in for openai.OpenAI's client

    be = sgl.OpenAI("gpt-4o", base_url="http://127.0.0.1:9/v1", api_key="unused")
    be.client = NS(chat=NS(completions=RecordingChatAPI(*replies)))
    return be, be.client.chat.completions


def test_chat_model_speculative_execution_is_one_call_per_turn():
    be, api = openai_chat_backend("Name: Ada Lovelace\nBirthday: December 10, 1815\nJob: Mathematician")
    state = gen_character_spec.run(backend=be)
    assert (state["name"], state["birthday"], state["job"]) == (" Ada Lovelace", " December 10, 1815", " Mathematician")
    assert len(api.calls) == 1 and api.calls[0]["max_tokens"] == 64 and "stop" not in api.calls[0]
    assert [m["role"] for m in api.calls[0]["messages"]] == ["system", "user", "assistant", "user"]
    assert state.messages()[-1]["content"] == "Name: Ada Lovelace\nBirthday: December 10, 1815\nJob: Mathematician"


def test_chat_model_speculation_that_strays_leaves_well_formed_empty_fields():
    be, api = openai_chat_backend("Name: Bob\nSomething else entirely")
    state = gen_character_spec.run(backend=be, temperature=0)
    assert state.error() is None
    assert (state["name"], state["birthday"], state["job"]) == (" Bob", "", "")
    assert len(api.calls) == 1  # greedy: a retry would return the same


def test_images_go_to_the_openai_backend_as_message_parts(tmp_path):
    from PIL import Image

    path = tmp_path / "dot.png"
    Image.new("RGB", (2, 2), "blue").save(path)

    @sgl.function
    def image_qa(s, image_file, question):
        s += sgl.user(sgl.image(image_file) + question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8))

    be, api = openai_chat_backend("A blue square.")
    state = image_qa.run(image_file=str(path), question="What is this?", backend=be)
    assert state["answer"] == "A blue square."
    content = api.calls[0]["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "What is this?"}
    assert content[1]["type"] == "image_url" and content[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert state.messages()[-1] == {"role": "assistant", "content": "A blue square."}


# Logprobs of jump-forward (forced) tokens (upstream's json_logprobs) -------------------------------------------------
def test_every_completion_token_of_a_regex_gen_has_a_logprob(backend):
    @sgl.function
    def character(s):
        s += "The character:\n"
        s += sgl.gen("json", regex=r'\{"name": "[A-Za-z]{1,8}", "house": "(Gryffindor|Slytherin)"\}',
                     max_tokens=40, temperature=0, return_logprob=True)

    jumps = backend.engine.scheduler.stats.num_jump_forward
    meta = character.run().get_meta_info("json")
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert backend.engine.scheduler.stats.num_jump_forward > jumps  # forced tokens were there to score


# text_async_iter(var, return_meta_data=True) (upstream's test_stream_logprobs) ---------------------------------------
def test_streamed_pieces_carry_their_new_logprob_entries(backend):
    import asyncio

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", return_logprob=True))

    async def collect():
        state = qa(question="Write a short poem about the sea.", stream=True, temperature=0, max_new_tokens=24)
        return [chunk async for chunk in state.text_async_iter("answer", return_meta_data=True)]

    chunks = asyncio.run(collect())
    assert len(chunks) > 1
    seen = 0
    for text, meta in chunks:
        assert text and meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] - seen
        seen = meta["output_token_logprobs_length"]
    state = qa(question="Hi.", stream=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="variable"):
        next(state.text_iter(return_meta_data=True))
    state.text()  # waits for the program to end


# A function called inside a compiled program (upstream's test_tracing multi-function) --------------------------------
def test_compiled_program_runs_the_functions_it_calls(backend):
    @sgl.function
    def expand(s, tip):
        s += "Expand this tip into one sentence: " + tip + "\n"
        s += sgl.gen("detailed", max_tokens=12, temperature=0)

    @sgl.function
    def tips(s, topic):
        s += "A tip for " + topic + ":" + sgl.gen("tip", max_tokens=8, stop="\n", temperature=0) + "\n"
        sub = expand(tip=s["tip"])
        s += "In detail: " + sub["detailed"] + "\n"

    compiled = tips.compile()
    assert [n.kind for n in compiled.graph.nodes].count("program") == 1
    state = compiled.run(topic="sleeping well")
    assert state.text().split("In detail: ")[1].strip()  # the nested program's gen reached the caller
    direct = tips.run(topic="sleeping well")
    assert state.text() == direct.text()  # greedy: the compiled replay equals running the program



def test_compiled_program_run_batch_with_sampling_defaults(backend):
    """Upstream's test_tracing: ``compiled.run_batch([...], temperature=0)``; the sampling keywords are the
    defaults of the replay's gens (``max_new_tokens`` bounds a gen that names none), as ``SglFunction.run``."""
    @sgl.function
    def tip(s, topic):
        s += "A tip for " + topic + ":" + sgl.gen("tip", stop="\n")

    compiled = tip.compile()
    topics = ["sleeping well", "eating well", "staying calm"]
    states = compiled.run_batch([{"topic": t} for t in topics], temperature=0, max_new_tokens=6)
    direct = tip.run_batch([{"topic": t} for t in topics], temperature=0, max_new_tokens=6)
    assert [s.text() for s in states] == [d.text() for d in direct]  # greedy: in order, equal to the program's
    assert all(s.get_meta_info("tip")["completion_tokens"] <= 6 for s in states)
    with pytest.raises(TypeError, match="list"):
        compiled.run_batch({"topic": "x"})


def test_every_backend_counts_its_token_usage(backend):
    """``backend.token_usage`` (upstream's speculative-execution examples reset and print it) counts the prompt and
    completion tokens of each call on the runtime backends too, streamed calls included."""
    say_hi = sgl.function(lambda s: s.__iadd__("Say hi:" + sgl.gen("x", max_tokens=3, ignore_eos=True, temperature=0)))
    usage = backend.token_usage
    usage.reset()
    say_hi.run(backend=backend)
    prompt = len(backend.tokenize("Say hi:"))
    assert (usage.api_calls, usage.prompt_tokens, usage.completion_tokens) == (1, prompt, 3)
    "".join(say_hi.run(backend=backend, stream=True).text_iter())
    assert (usage.api_calls, usage.prompt_tokens, usage.completion_tokens) == (2, 2 * prompt, 6)
    usage.reset()
    assert (usage.prompt_tokens, usage.completion_tokens, usage.api_calls) == (0, 0, 0)
