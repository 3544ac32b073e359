"""/generate honours ``sampling_params.n`` as upstream SGLang does (issue 21, item 6: n=10**6 was silently ignored):
n samples of each prompt, grouped per prompt (a single prompt with n > 1 answers a list), bounded by the
per-request cap on prompts x n; with a seed, sample i uses seed + i; n < 1 or a non-integer is a 400. A stream
with n > 1 interleaves the samples' chunks, each carrying its sample's ``index``."""

from __future__ import annotations

import json

import httpx

from sglang_backend.runtime.managers.validation import MAX_PROMPTS_PER_REQUEST


def _gen(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=60)


def _texts(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text[:300]
    out = r.json()
    assert isinstance(out, list), out
    return [o["text"] for o in out]


def test_greedy_copies_are_identical(rel_server):
    single = _gen(rel_server, {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert single.status_code == 200 and isinstance(single.json(), dict), single.text[:300]
    texts = _texts(_gen(rel_server, {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 3}}))
    assert len(texts) == 3 and texts == [single.json()["text"]] * 3


def test_seeded_samples_are_distinct_and_reproducible(rel_server):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 1, "seed": 7, "n": 2}}
    first = _texts(_gen(rel_server, body))
    assert len(first) == 2
    assert first[0] != first[1], "samples of one seeded request use distinct seeds"
    assert _texts(_gen(rel_server, body)) == first
    # Sample 0 is what n=1 with the same seed gives.
    one = _gen(rel_server, {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 1, "seed": 7}})
    assert one.status_code == 200 and one.json()["text"] == first[0]


def test_batch_times_n_is_grouped_per_prompt(rel_server):
    prompts = ["Hello", "The quick brown fox"]
    sp = {"max_new_tokens": 4, "temperature": 0}
    singles = [_gen(rel_server, {"text": p, "sampling_params": sp}).json()["text"] for p in prompts]
    r = _gen(rel_server, {"text": prompts, "sampling_params": {**sp, "n": 2}})
    texts = _texts(r)
    assert texts == [singles[0], singles[0], singles[1], singles[1]]
    prompt_tokens = [o["meta_info"]["prompt_tokens"] for o in r.json()]
    assert prompt_tokens[0] == prompt_tokens[1] and prompt_tokens[2] == prompt_tokens[3] != prompt_tokens[0]


def test_stream_with_n_carries_an_index(rel_server):
    body = {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2}}
    finals: dict[int, dict] = {}
    with httpx.stream("POST", rel_server.url + "/generate", json=body, headers=rel_server.headers, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for chunk in map(json.loads, lines[:-1]):
        assert "error" not in chunk, chunk
        assert chunk["index"] in (0, 1), chunk
        if chunk["meta_info"].get("finish_reason") is not None:
            finals[chunk["index"]] = chunk
    assert sorted(finals) == [0, 1]


def _refused(server, body: dict, *words: str) -> None:
    r = _gen(server, body)
    assert r.status_code == 400, f"{json.dumps(body)[:200]}: {r.status_code} {r.text[:300]}"
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, message


def test_bad_n_is_refused(rel_server):
    for n in (10**6, 10**12, MAX_PROMPTS_PER_REQUEST + 1):  # refused before any copy is made (10**12 would fill RAM)
        _refused(rel_server, {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": n}}, "n", str(MAX_PROMPTS_PER_REQUEST))
    _refused(rel_server, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "n": MAX_PROMPTS_PER_REQUEST // 2 + 1}},
             "n", "prompts x n")
    for n in (0, -1):
        _refused(rel_server, {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": n}}, "n", ">= 1")
    for n in (1.5, "2", True, [2], {}):
        _refused(rel_server, {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": n}}, "n", "integer")
    _refused(rel_server, {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 2}]},
             "n", "same")


def test_n_one_and_integral_float_still_work(rel_server):
    r = _gen(rel_server, {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": 1}})
    assert r.status_code == 200 and isinstance(r.json(), dict), r.text[:300]
    assert len(_texts(_gen(rel_server, {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": 2.0}}))) == 2
