"""Programs written the way upstream SGLang's frontend programs are (issue 28), with the checks of their output's
shape, shared by the in-process tests (tests/unit/test_upstream_compat.py) and the server ones
(tests/integration/test_lang_upstream_compat.py). Each check is about well-formed output, not a tiny model's
knowledge."""

from __future__ import annotations

import re

import sglang_backend as sgl


@sgl.function
def cot_step_0(s, question, get_top_k):
    """Upstream's cot_decoding, step 0: the next token's top-k from a max_tokens=0 gen, one greedy branch each."""
    s += "Question: " + question + "\nAnswer:"
    step_0 = s.fork(1)[0]
    step_0 += sgl.gen("get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=get_top_k,
                      return_text_in_logprobs=True)
    logprobs = step_0.get_meta_info("get_top_k")["output_top_logprobs"][0]
    forks = s.fork(get_top_k)
    for f, (logprob, token_id, text) in zip(forks, logprobs):
        f += text + sgl.gen("answer", max_tokens=3, temperature=0)
    forks.join()
    s["first_tokens"] = logprobs


def check_cot_step_0(backend=None, k: int = 3) -> None:
    state = cot_step_0.run(question="What is the capital of France?", get_top_k=k, temperature=0, backend=backend)
    top = state["first_tokens"]
    assert len(top) == k
    assert all(isinstance(lp, float) and lp <= 0 and isinstance(tid, int) and isinstance(text, str)
               for lp, tid, text in top)
    assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
    assert len(state["answer"]) == k  # one greedy continuation per top-k first token


@sgl.function
def parallel_encoding(s, question, contexts):
    """Upstream's parallel_encoding: ``forks += lambda i: ...``, joined by appending the branches' text."""
    s += "USER: Please memorize these statements.\n"
    forks = s.fork(len(contexts))
    forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
    forks.join(mode="concate_and_append")
    s += "Question: " + question + "\nASSISTANT:" + sgl.gen("answer", max_tokens=4, temperature=0)


def check_parallel_encoding(backend=None) -> None:
    contexts = ["Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Carlos."]
    state = parallel_encoding.run(question="Who is the father of Julian?", contexts=contexts, backend=backend)
    assert ("Statement 0: Ethan is the father of Liam.\nStatement 1: Noah is the father of Julian.\n"
            "Statement 2: Oliver is the father of Carlos.\nQuestion:") in state.text()
    assert isinstance(state["answer"], str)


@sgl.function
def few_shot_qa(s, prompt, question):
    """Upstream's test_bind_cache program."""
    s += prompt
    s += "Q: What is the capital of France?\n"
    s += "A: Paris\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=4, temperature=0)


def check_cache_prefills_the_prefix(backend, label: str) -> None:
    """``bind(prompt=...).cache(backend)``, then a run finds the constant prefix cached (``label`` makes the
    prompt new to the cache)."""
    prompt = f"Answer the following questions as if you were a 5-year-old kid ({label}).\n\n"
    bound = few_shot_qa.bind(prompt=prompt)
    bound.cache(backend)
    state = bound.run(question="What is the capital of Spain?", backend=backend)
    # The prefix ends with "Q: ", whose space joins the question's first word: at most that token is recomputed.
    prefix_tokens = len(backend.tokenize(prompt + "Q: What is the capital of France?\nA: Paris\nQ: "))
    assert state.get_meta_info("answer")["cached_tokens"] >= prefix_tokens - 2


def check_pin_keeps_the_prefix(backend, pinned_tokens, label: str) -> None:
    """``bind(prompt=...).pin(backend)`` (older upstream's) keeps the constant prefix's KV pinned until
    ``unpin(backend)``: ``pinned_tokens()`` (the runtime's ``session_pinned_tokens``) grows by the prefix, a run in
    between hits it, and unpin gives it back."""
    prompt = f"Answer the following questions as if you were a 5-year-old kid ({label}, pinned).\n\n"
    bound = few_shot_qa.bind(prompt=prompt)
    prefix_tokens = len(backend.tokenize(prompt + "Q: What is the capital of France?\nA: Paris\nQ: "))
    before = pinned_tokens()
    bound.pin(backend)
    assert pinned_tokens() - before >= prefix_tokens - 2
    state = bound.run(question="What is the capital of Spain?", backend=backend)
    assert state.get_meta_info("answer")["cached_tokens"] >= prefix_tokens - 2
    bound.unpin(backend)
    assert pinned_tokens() == before


@sgl.function
def think_then_color(s):
    """A reasoning model's output shape, forced by a regex, split by ``separate_reasoning``."""
    s += "Think, then name a color.\n"
    s += sgl.separate_reasoning(
        sgl.gen("answer", regex=r"<think>[a-z]{1,10}</think>(Red|Blue)", max_tokens=24, temperature=0),
        model_type="qwen3")
    s += "\nDone."


def check_think_then_color(backend=None) -> None:
    state = think_then_color.run(backend=backend)
    assert state["answer"] in ("Red", "Blue")
    assert re.fullmatch("[a-z]{1,10}", state["answer_reasoning_content"])
    assert state.text().endswith("Think, then name a color.\n" + state["answer"] + "\nDone.")


@sgl.function(num_api_spec_tokens=64)
def gen_character_spec(s):
    """Upstream's test_chat_completion_speculative program."""
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user("Construct a character within the following format:")
    s += sgl.assistant("Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n")
    s += sgl.user("Please generate new Name, Birthday and Job.\n")
    s += sgl.assistant("Name:" + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")
                       + "\nJob:" + sgl.gen("job", stop="\n"))
