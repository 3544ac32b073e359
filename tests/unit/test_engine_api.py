"""Engine-level behaviour: sampling parameters end to end, streaming, aborts, and bad input."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.conftest import make_engine

GREEDY = {"temperature": 0}


def prompt_ids(n=12, seed=1):
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def test_max_new_tokens_and_ignore_eos(tiny_engine):
    out = tiny_engine.generate(input_ids=prompt_ids(), sampling_params={**GREEDY, "max_new_tokens": 7, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 7 == len(out["output_ids"])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


def test_eos_stops_unless_ignored(tiny_engine):
    eos = tiny_engine.tokenizer.eos_token_id
    forced = {**GREEDY, "max_new_tokens": 6, "logit_bias": {eos: 100.0}}
    out = tiny_engine.generate(input_ids=prompt_ids(), sampling_params=forced)
    assert out["output_ids"] == [eos] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    out = tiny_engine.generate(input_ids=prompt_ids(), sampling_params={**forced, "ignore_eos": True})
    assert out["output_ids"] == [eos] * 6


def test_min_new_tokens_holds_back_eos(tiny_engine):
    eos = tiny_engine.tokenizer.eos_token_id
    params = {**GREEDY, "max_new_tokens": 10, "min_new_tokens": 4, "logit_bias": {eos: 100.0}}
    out = tiny_engine.generate(input_ids=prompt_ids(), sampling_params=params)
    assert len(out["output_ids"]) == 5 and eos not in out["output_ids"][:4] and out["output_ids"][4] == eos


def test_stop_token_ids(tiny_engine):
    base = tiny_engine.generate(input_ids=prompt_ids(), sampling_params={**GREEDY, "max_new_tokens": 16})["output_ids"]
    stop_tok = base[5]
    out = tiny_engine.generate(input_ids=prompt_ids(), sampling_params={**GREEDY, "max_new_tokens": 16,
                                                                        "stop_token_ids": [stop_tok]})
    first = base.index(stop_tok)
    assert out["output_ids"] == base[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}


def test_stop_string_is_trimmed(smollm_engine):
    prompt = smollm_engine.apply_chat_template([{"role": "user", "content": "Count from one to ten in words."}])
    base = smollm_engine.generate(prompt, {**GREEDY, "max_new_tokens": 40})["text"]
    stop = base[8:12]
    assert stop and stop in base
    out = smollm_engine.generate(prompt, {**GREEDY, "max_new_tokens": 40, "stop": [stop]})
    assert out["text"] == base[: base.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = smollm_engine.generate(prompt, {**GREEDY, "max_new_tokens": 40, "stop": stop, "no_stop_trim": True})
    assert kept["text"].startswith(base[: base.index(stop)]) and stop in kept["text"]


def test_seed_reproducible_whatever_the_batch(tiny_engine):
    params = {"temperature": 1.0, "max_new_tokens": 12, "seed": 1234, "ignore_eos": True}
    a = tiny_engine.generate(input_ids=prompt_ids(), sampling_params=params)["output_ids"]
    batch = tiny_engine.generate(input_ids=[prompt_ids(20, 7), prompt_ids(), prompt_ids(9, 3)],
                                 sampling_params=[{"temperature": 1.0, "max_new_tokens": 5}, params,
                                                  {"temperature": 0.7, "max_new_tokens": 12}])
    assert batch[1]["output_ids"] == a
    other = tiny_engine.generate(input_ids=prompt_ids(), sampling_params={**params, "seed": 99})["output_ids"]
    assert other != a


def test_streaming_reassembles_text(smollm_engine):
    prompt = smollm_engine.apply_chat_template([{"role": "user", "content": "Say hello in French and Chinese."}])
    params = {**GREEDY, "max_new_tokens": 24}
    full = smollm_engine.generate(prompt, params)
    pieces = list(smollm_engine.generate(prompt, params, stream=True))
    assert "".join(p["text"] for p in pieces) == full["text"]
    assert pieces[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all("\ufffd" not in p["text"] for p in pieces)


def test_async_generate(tiny_engine):
    import asyncio

    async def main():
        outs = await asyncio.gather(*[tiny_engine.async_generate(input_ids=prompt_ids(10, s),
                                                                 sampling_params={**GREEDY, "max_new_tokens": 4})
                                      for s in range(4)])
        return outs

    outs = asyncio.run(main())
    assert [len(o["output_ids"]) for o in outs] == [4] * 4


def test_abort_running_request_frees_kv(tiny_engine):
    it = tiny_engine.generate(input_ids=prompt_ids(), sampling_params={**GREEDY, "max_new_tokens": 400, "ignore_eos": True},
                              stream=True, rid="to-abort")
    first = next(it)
    assert first["meta_info"]["finish_reason"] is None
    tiny_engine.abort_request("to-abort")
    last = list(it)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 400


def test_concurrent_threads(tiny_engine):
    results = {}

    def worker(i):
        results[i] = tiny_engine.generate(input_ids=prompt_ids(8 + i, i), sampling_params={**GREEDY, "max_new_tokens": 6})

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    singles = [tiny_engine.generate(input_ids=prompt_ids(8 + i, i), sampling_params={**GREEDY, "max_new_tokens": 6})
               for i in range(8)]
    assert [results[i]["output_ids"] for i in range(8)] == [s["output_ids"] for s in singles]


# Bad input: a clear exception naming the problem, and the engine keeps working.

def test_unknown_model_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        make_engine("/no/such/model")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_ids": list(range(3, 600))}, "context length"),
        ({"input_ids": [1, 2, 100000]}, "outside the vocabulary"),
        ({"input_ids": [1, -2, 3]}, "outside the vocabulary"),
        ({"input_ids": [1, 2.0, 3]}, "list of ints"),
        ({"input_ids": [[1, 2], [3, "4"]]}, "list of ints"),
        ({"input_ids": [[1, 2], 3]}, "list of ints"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [5, 6], "sampling_params": {"max_tokens": 5}}, "max_tokens"),
        ({"input_ids": [5, 6], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [5, 6], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
        ({"prompt": "hi", "input_ids": [5]}, "exactly one"),
        ({"prompt": 42}, "prompt"),
    ],
)
def test_bad_requests_raise_clear_errors(tiny_engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.generate(**kwargs)
    ok = tiny_engine.generate(input_ids=prompt_ids(), sampling_params={**GREEDY, "max_new_tokens": 3})
    assert len(ok["output_ids"]) == 3


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="max_totl_tokens"):
        make_engine("unused", max_totl_tokens=5)


def test_prefill_only_request_caches_prompt(tiny_engine):
    ids = prompt_ids(40, 11)
    hint = tiny_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert hint["output_ids"] == [] and hint["meta_info"]["finish_reason"]["type"] == "length"
    out = tiny_engine.generate(input_ids=ids + [7, 8, 9], sampling_params={**GREEDY, "max_new_tokens": 2})
    assert out["meta_info"]["cached_tokens"] >= len(ids)


def test_engine_leaves_logging_to_the_application(tiny_gqa_dir):
    """A library must not configure logging: no handlers on the root logger (a basicConfig there would print
    every library's INFO lines in the application's process); ``log_level`` sets the package logger's level."""
    import logging

    root, package = logging.getLogger(), logging.getLogger("sglang_backend")
    saved = (root.handlers[:], root.level, package.level)
    root.handlers.clear()  # as in a fresh application (pytest adds its own capture handlers)
    try:
        engine = make_engine(tiny_gqa_dir, log_level="warning")
        try:
            assert root.handlers == [] and root.level == saved[1]
            assert package.level == logging.WARNING
        finally:
            engine.shutdown()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        package.setLevel(saved[2])


def test_parallel_sampling_n(tiny_engine):
    greedy = tiny_engine.generate("Hello", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    outs = tiny_engine.generate("Hello", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 3})
    assert isinstance(outs, list) and [o["text"] for o in outs] == [greedy["text"]] * 3
    sp = {"max_new_tokens": 8, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    seeded = tiny_engine.generate(["Hi", "Bye"], {**sp, "n": 2})
    assert len(seeded) == 4  # grouped per prompt: Hi#0, Hi#1, Bye#0, Bye#1
    assert seeded[0]["text"] == tiny_engine.generate("Hi", sp)["text"]  # sample 0 is the n=1 sample
    assert seeded[1]["text"] == tiny_engine.generate("Hi", {**sp, "seed": 12})["text"]  # sample i: seed + i
    assert seeded[2]["text"] == tiny_engine.generate("Bye", sp)["text"]
    for bad, match in (({"n": 0}, ">= 1"), ({"n": 1.5}, "integer"), ({"n": 10**12}, "prompts x n")):
        with pytest.raises(ValueError, match=match):
            tiny_engine.generate("Hi", {"max_new_tokens": 2, **bad})
    with pytest.raises(ValueError, match="single sample"):
        tiny_engine.generate("Hi", {"max_new_tokens": 2, "n": 2}, stream=True)


def test_closing_a_stream_early_aborts_its_request(tiny_engine):
    """A consumer that stops reading a stream (closes the iterator) stops the request: it does not decode on to
    max_new_tokens, and its KV goes back to the pool."""
    budget = tiny_engine.context_len - 8
    before = tiny_engine.get_stats()
    stream = tiny_engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": budget, "temperature": 0,
                                                                        "ignore_eos": True}, stream=True)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 60
    while tiny_engine.get_stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = tiny_engine.get_stats()
    assert after["num_aborted"] == before["num_aborted"] + 1
    assert after["num_generated_tokens"] - before["num_generated_tokens"] < budget
    tiny_engine.check_pool_whole()
