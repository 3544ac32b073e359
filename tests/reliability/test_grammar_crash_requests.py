"""Issue 21, item 1 over HTTP: the requests that killed the scheduler (a grammar whose allowed set is entirely
banned, or NaN-ed by a tiny repetition_penalty) get a 4xx or a 200 with an error finish, and the server stays
up (the autouse fixture then checks /health and that the KV pool is whole)."""

from __future__ import annotations

import json

import httpx

def _x_id(model_dir: str) -> int:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode("x", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def _post(server, path: str, body: dict) -> httpx.Response:
    # allow_nan: the issue's -Infinity bias is sent as the JSON literal a client would write.
    return httpx.post(server.url + path, content=json.dumps(body, allow_nan=True).encode(),
                      headers={**server.headers, "Content-Type": "application/json"}, timeout=60)


def test_grammar_crash_requests_keep_the_server_up(rel_server, tiny_gqa_dir):
    x = _x_id(tiny_gqa_dir)
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ("/v1/chat/completions", {**chat, "regex": "x", "stop_token_ids": [x], "min_tokens": 1}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "regex": "x", "stop_token_ids": [x],
                                                          "min_new_tokens": 1}}),
        ("/v1/chat/completions", {**chat, "regex": "[0-9]+", "repetition_penalty": 1e-300}),
        ("/v1/chat/completions", {**chat, "regex": "x", "logit_bias": {str(x): float("-inf")}}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+",
                                                          "repetition_penalty": 1e-300}}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "regex": "x",
                                                          "logit_bias": {str(x): float("-inf")}}}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": {},
                                                          "repetition_penalty": 5e-324}}),
        ("/v1/chat/completions", {**chat, "json_schema": {}, "repetition_penalty": 5e-324}),
    ]
    for path, body in cases:
        r = _post(rel_server, path, body)
        where = f"{path} {json.dumps(body, allow_nan=True)[:200]}"
        assert rel_server.is_alive(), f"{where} killed the server:\n{rel_server.log_tail()}"
        assert r.status_code < 500, f"{where}: {r.status_code} {r.text[:300]}"
        if r.status_code == 200:
            out = r.json()
            reason = out["choices"][0]["finish_reason"] if "choices" in out else out["meta_info"]["finish_reason"]
            assert reason not in ("stop", "length") and not (isinstance(reason, dict)
                                                            and reason.get("type") in ("stop", "length")), where
        else:
            assert 400 <= r.status_code < 500, where
            assert r.json()["error"]["message"], where
    # Still serving, grammar requests included.
    r = _post(rel_server, "/v1/chat/completions", {**chat, "regex": "[0-9]+", "temperature": 0})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["content"].isdigit(), r.text[:300]
