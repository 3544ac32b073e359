"""Session ids over HTTP: /generate's ``session_id`` and the OpenAI routes' extra-body ``session_id`` pin a finished
request's KV for the session's next call; /end_session releases it (the pool is whole after each test)."""

from __future__ import annotations


def stats(http) -> dict:
    r = http.get("/get_stats")
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_session_pins_and_end_session_releases(http):
    before = stats(http)
    greedy = {"max_new_tokens": 6, "temperature": 0}
    first = http.post("/generate", json={"text": "Session turn one: tell me about", "sampling_params": greedy,
                                         "session_id": "http-s1"})
    assert first.status_code == 200, first.text
    # Counters, not the pins held: other tests' pins on this server may expire meanwhile.
    mid = stats(http)
    assert mid["session_pins_taken"] == before["session_pins_taken"] + 1 and mid["session_pinned_tokens"] > 0
    turn2 = "Session turn one: tell me about" + first.json()["text"] + " And then?"
    second = http.post("/generate", json={"text": turn2, "sampling_params": greedy, "session_id": "http-s1"})
    assert second.status_code == 200, second.text
    assert second.json()["meta_info"]["cached_tokens"] > 0
    after = stats(http)
    assert after["session_pins_taken"] == before["session_pins_taken"] + 2
    assert after["session_reused_tokens"] > before["session_reused_tokens"]
    metrics = http.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("sglang_backend_session_reused_tokens "))
    assert float(line.split()[1]) == after["session_reused_tokens"]
    assert any(x.startswith("sglang_backend_session_pinned_tokens ") for x in metrics.splitlines())
    r = http.post("/end_session", json={"session_id": "http-s1"})
    assert r.status_code == 200 and r.json() == {"success": True, "released": True}
    r = http.post("/end_session", json={"session_id": "http-s1"})  # already released
    assert r.status_code == 200 and r.json()["released"] is False


def test_openai_chat_session_id_in_extra_body(oai, http):
    before = stats(http)
    messages = [{"role": "user", "content": "Hi, who are you?"}]
    out = oai.chat.completions.create(model="default", messages=messages, max_tokens=5, temperature=0,
                                      extra_body={"session_id": "oai-s1"})
    messages += [{"role": "assistant", "content": out.choices[0].message.content}, {"role": "user", "content": "ok"}]
    oai.chat.completions.create(model="default", messages=messages, max_tokens=5, temperature=0,
                                extra_body={"session_id": "oai-s1"})
    after = stats(http)
    assert after["session_pins_taken"] == before["session_pins_taken"] + 2
    assert after["session_reused_tokens"] > before["session_reused_tokens"]
    assert http.post("/end_session", json={"session_id": "oai-s1"}).json()["released"] is True


def test_bad_session_ids_are_400(http):
    for body in ({}, {"session_id": 5}, {"session_id": ""}, {"session_id": "x" * 10_000}, [1]):
        r = http.post("/end_session", json=body)
        assert r.status_code == 400, (body, r.text)
        assert "session_id" in r.json()["error"]["message"]
    r = http.post("/generate", json={"text": "hi", "session_id": "\x00bad", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "session_id" in r.text
    r = http.post("/generate", json={"text": "hi", "session_id": ["a"], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400
