"""The DSL, written as upstream SGLang tests are (``import ... as sgl``), on the embedded SmolLM2."""

from __future__ import annotations

import pytest

import sglang_backend as sgl
from sglang_backend.lang.choices import ChoicesDecision
from sglang_backend.lang.interpreter import ProgramError


@pytest.fixture(scope="module")
def backend(smollm_engine):
    be = sgl.EngineBackend(smollm_engine)
    sgl.set_default_backend(be)
    yield be
    sgl.set_default_backend(None)


def test_few_shot_qa(backend):
    @sgl.function
    def few_shot_qa(s, question):
        s += "The following are questions with answers.\n\n"
        s += "Q: What is the capital of France?\nA: Paris\n"
        s += "Q: What is the capital of Germany?\nA: Berlin\n"
        s += "Q: What is the capital of Italy?\nA: Rome\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n", temperature=0)

    state = few_shot_qa.run(question="What is the capital of Spain?")
    assert "Madrid" in state["answer"]
    assert state.text().endswith(state["answer"])


def test_multi_turn_roles(backend):
    @sgl.function
    def multi_turn(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1", max_tokens=24))
        with s.user():
            s += question_2
        s += sgl.assistant(sgl.gen("answer_2", max_tokens=24))

    state = multi_turn.run(question_1="What is the capital of France?", question_2="And of Germany?", temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["answer_1"] and "Paris" in state["answer_1"]
    assert messages[4]["content"] == state["answer_2"] and "Berlin" in state["answer_2"]
    assert state.text().startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_select(backend):
    @sgl.function
    def pick(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.select("answer", choices=["Paris", "London", "Tokyo"]))

    state = pick.run(question="What is the capital of France? Answer with one word.")
    assert state["answer"] == "Paris"
    meta = state.get_meta_info("answer")
    assert len(meta["normalized_prompt_logprobs"]) == 3
    assert max(meta["normalized_prompt_logprobs"]) == meta["normalized_prompt_logprobs"][0]


def test_select_methods_agree_on_clear_case(backend):
    for method in (sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        @sgl.function
        def pick(s):
            s += "Q: Is fire hot or cold?\nA: It is"
            s += sgl.select("answer", choices=[" hot", " cold"], choices_method=method)

        assert pick.run()["answer"] == " hot"


def test_regex_ipv4(backend):
    import re

    ipv4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

    @sgl.function
    def regex_gen(s):
        s += "Q: What is the IP address of the Google DNS servers?\n"
        s += "A: " + sgl.gen("answer", temperature=0, regex=ipv4)

    answer = regex_gen.run()["answer"]
    assert re.fullmatch(ipv4, answer), answer


def test_dtype_gen(backend):
    @sgl.function
    def dtype_gen(s):
        s += "Q: What is the full name of DNS?\n"
        s += "A: The full name is " + sgl.gen("str_res", dtype=str, stop="\n") + "\n"
        s += "Q: Which year was DNS invented?\n"
        s += "A: " + sgl.gen("int_res", dtype=int) + "\n"
        s += "Q: What is the value of pi?\n"
        s += "A: " + sgl.gen("float_res", dtype=float) + "\n"
        s += "Q: Is the sky blue?\n"
        s += "A: " + sgl.gen("bool_res", dtype=bool) + "\n"

    state = dtype_gen.run(temperature=0, max_new_tokens=16)
    assert isinstance(state["int_res"], int)
    assert isinstance(state["float_res"], float)
    assert isinstance(state["bool_res"], bool)
    assert isinstance(state["str_res"], str)


def test_gen_int_and_json_schema(backend):
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"]}

    @sgl.function
    def extract(s):
        s += "The capital of France has about two million inhabitants.\nYear: " + sgl.gen_int("year", max_tokens=6)
        s += "\nJSON: " + sgl.gen("info", json_schema=schema, max_tokens=48, temperature=0)

    state = extract.run(temperature=0)
    assert isinstance(state["year"], int)
    info = json.loads(state["info"])
    assert set(info) == {"city", "population"} and isinstance(info["population"], int)


def test_parallel_decoding_fork_join(backend):
    @sgl.function
    def tips(s, topic):
        s += sgl.user("Give one short tip about " + topic + ".")
        forks = s.fork(5)
        for i, f in enumerate(forks):
            f += sgl.assistant(sgl.gen("tip", max_tokens=12, temperature=0.9, stop="\n"))
        forks.join()

    state = tips.run(topic="sleep")
    assert isinstance(state["tip"], list) and len(state["tip"]) == 5
    assert all(isinstance(t, str) and t for t in state["tip"])


def test_fork_concate_and_append(backend):
    @sgl.function
    def prog(s):
        s += "Numbers:"
        forks = s.fork(2)
        forks[0] += " one"
        forks[1] += " two"
        forks.join("concate_and_append")

    assert prog.run().text() == "Numbers: one two"


def test_stream_text_iter(backend):
    @sgl.function
    def chat(s, q):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))

    state = chat.run(q="Say hello.", stream=True)
    pieces = list(state.text_iter("answer"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["answer"]
    full = chat.run(q="Say hello.", stream=True)
    assert "".join(full.text_iter()) == full.text()


def test_min_tokens(backend):
    @sgl.function
    def short(s):
        s += sgl.user("Say OK.")
        s += sgl.assistant(sgl.gen("answer", min_tokens=20, max_tokens=30, temperature=0))

    meta = short.run().get_meta_info("answer")
    assert meta["completion_tokens"] >= 20


def test_nested_function_calls(backend):
    @sgl.function
    def greet(s, name):
        s += "Hello, " + name + "! "

    @sgl.function
    def outer(s):
        greet(s, "Ada")
        greet(s, name="Alan")
        s += "Bye."

    assert outer.run().text() == "Hello, Ada! Hello, Alan! Bye."


def test_run_batch_with_progress_bar(backend, capsys):
    @sgl.function
    def capital(s, country):
        s += "The capital of " + country + " is" + sgl.gen("city", max_tokens=3, temperature=0)

    countries = ["France", "Germany", "Italy", "Spain"]
    states = capital.run_batch([{"country": c} for c in countries], progress_bar=True)
    assert [s.text().startswith(f"The capital of {c} is") for s, c in zip(states, countries)] == [True] * 4
    singles = [capital.run(country=c)["city"] for c in countries]
    assert [s["city"] for s in states] == singles
    assert "run_batch capital" in capsys.readouterr().err


def test_trace_graph_and_fstring_error(backend):
    @sgl.function
    def qa(s, question):
        s += sgl.system("Be brief.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer"))
        forks = s.fork(2)
        for f in forks:
            f += "Why? " + sgl.gen("why")
        forks.join()

    graph = qa.trace()
    kinds = [n.kind for n in graph.nodes]
    assert kinds[:3] == ["role_begin", "text", "role_end"]
    assert "argument" in kinds and kinds.count("gen") == 3 and "fork" in kinds and "join" in kinds
    assert graph.arguments == ["question"]
    join = graph.nodes[kinds.index("join")]
    assert len(join.inputs) == 3  # the parent's last node and both branches

    @sgl.function
    def bad(s, question):
        s += f"Q: {question}"

    with pytest.raises(TypeError, match="f-string"):
        bad.trace()


def test_compile_runs_the_graph(backend):
    @sgl.function
    def capital(s, country):
        s += "The capital of " + country + " is" + sgl.gen("city", max_tokens=3, temperature=0)

    compiled = capital.compile()
    assert compiled.run(country="France")["city"] == capital.run(country="France")["city"]


def test_fork_hint_makes_branches_hit_cache(backend, smollm_engine):
    def shared(seed):
        return f"Run {seed}. " + "Here is a long shared context about gardening. " * 12 + "Give advice:"

    @sgl.function
    def branches(s, seed):
        s += shared(seed)
        forks = s.fork(3)
        for f in forks:
            f += sgl.gen("advice", max_tokens=4, temperature=0)
        forks.join()

    def min_cached(state):
        return min(m["cached_tokens"] for m in state.get_meta_info("advice"))

    # Every branch recomputes at most the prefix's last token (its logits are sampled).
    prefix_len = len(smollm_engine.tokenizer.encode(shared(1))) - 1
    with_hint = branches.run(seed=1)
    assert min_cached(with_hint) >= prefix_len
    backend.fork_hints = False
    try:
        without = branches.run(seed=2)
    finally:
        backend.fork_hints = True
    # Without the hint the branches race: the first one admitted finds nothing cached.
    assert min_cached(without) < prefix_len


# Bad input ---------------------------------------------------------------------------------------------------------
def test_invalid_regex_is_a_clear_error(backend):
    with pytest.raises(ValueError, match="invalid regex"):
        sgl.gen("x", regex="([a-z")


def test_select_without_choices(backend):
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", choices=[])


def test_unknown_variable_and_branch_errors_do_not_hang(backend):
    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("a", max_tokens=2)

    state = prog.run()
    with pytest.raises(KeyError, match="never generated"):
        state["nope"]

    @sgl.function
    def failing(s):
        s += "x"
        forks = s.fork(2)
        forks[0] += sgl.gen("ok", max_tokens=2)
        forks[1] += sgl.gen("bad", max_tokens=-5)
        forks.join()

    with pytest.raises(ProgramError, match="1 of 2 fork branches failed.*max_new_tokens"):
        failing.run()


def test_choice_method_fixtures():
    choices = ["A", "BB", "C"]
    # (logprob, token_id, text) per choice token.
    inputs = [[(-1.0, 1, "A")], [(-0.5, 2, "B"), (-3.0, 3, "B")], [(-0.9, 4, "C")]]
    normalized = [-1.0, -1.75, -0.9]
    kw = dict(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=inputs,
              output_token_logprobs=[[], [], []])
    assert sgl.token_length_normalized(**kw).decision == "C"
    # Greedy looks at the first token only when it decides: BB's first token is the most likely.
    assert sgl.greedy_token_selection(**kw).decision == "BB"
    uncond = [[(None, 1, "A")], [(None, 2, "B"), (-0.5, 3, "B")], [(None, 4, "C")]]
    decision = sgl.unconditional_likelihood_normalized(**kw, unconditional_token_logprobs=uncond)
    # Scores: A -1.0, BB mean(-0.5-0, -3.0+0.5) = -1.5, C -0.9.
    assert isinstance(decision, ChoicesDecision) and decision.decision == "C"
    uncond2 = [[(None, 1, "A")], [(None, 2, "B"), (-4.0, 3, "B")], [(None, 4, "C")]]
    # BB: mean(-0.5, -3.0 + 4.0) = 0.25 beats the rest once its second token is unlikely on its own.
    assert sgl.unconditional_likelihood_normalized(**kw, unconditional_token_logprobs=uncond2).decision == "BB"
