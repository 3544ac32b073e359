"""Hostile input: a hand-written corpus of >= 200 malicious or malformed requests, then a hypothesis fuzz run over
the server's own OpenAPI schema: >= 1,000 requests from a fixed seed, bodies drawn from each route's JSON schema (and
typed /generate sampling params, which the schema leaves free-form), plus type-confused mutations.

Every answer is < 500; a 4xx carries an OpenAI-style error body and no stack trace; the server stays alive
and healthy, and the KV pool is whole afterwards (checked by the autouse fixture in conftest)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_backend.runtime.managers.validation import MAX_PROMPTS_PER_REQUEST

KEY_A, KEY_B = "sk-reliability-a", "sk-reliability-b"  # the keys conftest starts the server with

NO_AUTH = {"Authorization": None}
USER = [{"role": "user", "content": "Hi"}]
CTX = 512  # the tiny model's context length
JSON_CT = {"Content-Type": "application/json"}


def chat(**kw):
    return {"model": "default", "messages": USER, "max_tokens": 4, **kw}


def comp(**kw):
    return {"model": "default", "prompt": "Hi", "max_tokens": 4, **kw}


def gen(sp=None, **kw):
    return {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **(sp or {})}, **kw}


def raw(obj) -> bytes:
    """JSON with the literals (NaN, Infinity) and escapes (lone surrogates) a careful client would never send."""
    return json.dumps(obj, allow_nan=True).encode()


# (id, method, path, body, extra headers). body: dict/list/str -> JSON; bytes -> raw; None -> none.
CORPUS: list[tuple] = []


def case(name, method, path, body=None, headers=None):
    CORPUS.append((name, method, path, body, headers or {}))


# --- body encoding and framing (the JSON parser and size limits)
for i, body in enumerate([b"", b" ", b"null", b"true", b"1", b"[]", b'"s"', b"{", b'{"text": "a",}', b"{'text': 'a'}",
                          b'{"text": NaN}', b'{"text": Infinity}', b"\xff\xfe{}", b"\xef\xbb\xbf{}", b'{"text": "\\ud800"}',
                          b'{"text": "a\\u0000b", "sampling_params": {"max_new_tokens": 2}}', b"[" * 100_000,
                          b'{"a":' * 5000 + b"1" + b"}" * 5000, b'{"text": "' + b"\\" * 1001 + b'"}',
                          b'{"text": "a", "text": 5}', b"<xml/>", b"text=hi&max=3", b"1e99999",
                          b'{"input_ids": [' + b"1," * 200_000 + b"1]}", b"\x00" * 100]):
    for path in ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/chat",
                 "/api/generate", "/api/embed", "/api/embeddings", "/api/show"):
        case(f"body-{i}-{path.strip('/').replace('/', '-')}", "POST", path, body, JSON_CT)
case("body-over-limit", "POST", "/generate", b'{"text": "' + b"a" * (9 << 20) + b'"}', JSON_CT)
case("body-over-limit-chat", "POST", "/v1/chat/completions", b" " * (9 << 20), JSON_CT)

# --- lone surrogates and odd Unicode in every string-typed place
SURR = "\ud83d"
for name, body in [("chat-content", chat(messages=[{"role": "user", "content": SURR}])),
                   ("chat-model", chat(model=SURR)), ("chat-stop", chat(stop=[SURR])), ("chat-rid", chat(rid=SURR)),
                   ("chat-regex", chat(regex=SURR)), ("chat-part-text", chat(messages=[{"role": "user", "content": [
                       {"type": "text", "text": SURR}]}])), ("chat-key", {**chat(), SURR: 1}),
                   ("comp-prompt", comp(prompt=SURR)), ("comp-prompt-list", comp(prompt=["a", SURR])),
                   ("gen-text", gen(text=SURR)), ("gen-stop", gen({"stop": SURR})), ("gen-json-schema", gen({"json_schema": SURR})),
                   ("tokenize", {"prompt": SURR}), ("abort", {"rid": SURR})]:
    path = {"chat": "/v1/chat/completions", "comp": "/v1/completions", "gen": "/generate"}.get(name.split("-")[0], "/" + name)
    case(f"surrogate-{name}", "POST", "/abort_request" if name == "abort" else path, raw(body), JSON_CT)
for i, text in enumerate(["\u202e\u2066evil", "\U0001f600" * 50, "\x00\x01\x02", "\ufffd" * 10, "a\u0301" * 30, "\r\n" * 40]):
    case(f"odd-unicode-{i}", "POST", "/generate", gen(text=text))

# --- size bounds: prompts, n, max tokens, logprobs, stops, biases, batch sizes, rids
BOUNDS = [
    ("gen-text-huge", "/generate", gen(text="a" * (CTX * 64 + 1))),
    ("gen-text-too-many-tokens", "/generate", gen(text="hello " * 2000)),
    ("gen-ids-too-long", "/generate", {"input_ids": [5] * CTX}),
    ("gen-ids-plus-max-over-ctx", "/generate", {"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 20}}),
    ("gen-max-new-1e9", "/generate", gen({"max_new_tokens": 10**9})),
    ("gen-max-new-1e30", "/generate", gen({"max_new_tokens": 10**30})),
    ("gen-min-new-over-max", "/generate", gen({"min_new_tokens": 9})),
    ("gen-top-logprobs-101", "/generate", gen(return_logprob=True, top_logprobs_num=101)),
    ("gen-top-logprobs-huge", "/generate", gen(return_logprob=True, top_logprobs_num=10**12)),
    ("gen-logprob-start-negative-huge", "/generate", gen(return_logprob=True, logprob_start_len=-(10**12))),
    ("gen-stop-17", "/generate", gen({"stop": [f"s{i}" for i in range(17)]})),
    ("gen-stop-long", "/generate", gen({"stop": ["x" * 513]})),
    ("gen-stop-ids-1025", "/generate", gen({"stop_token_ids": list(range(5, 5 + 1025))})),
    ("gen-logit-bias-1025", "/generate", gen({"logit_bias": {str(i): 1 for i in range(1025)}})),
    ("gen-logit-bias-huge", "/generate", gen({"logit_bias": {"5": 1e308}, "temperature": 0.5})),
    ("gen-batch-1025", "/generate", {"input_ids": [[5]] * 1025, "sampling_params": {"max_new_tokens": 1}}),
    ("gen-rid-257", "/generate", gen(rid="r" * 257)),
    ("gen-rid-newline", "/generate", gen(rid="a\nb")),
    ("gen-rid-empty", "/generate", gen(rid="")),
    ("gen-rid-int", "/generate", gen(rid=5)),
    ("gen-seed-2**64", "/generate", gen({"seed": 2**64, "temperature": 1})),
    ("gen-seed-float", "/generate", gen({"seed": 1e300, "temperature": 1})),
    ("gen-temperature-nan", "/generate", raw(gen({"temperature": float("nan")}))),
    ("gen-temperature-inf", "/generate", raw(gen({"temperature": float("inf")}))),
    ("gen-top-p-nan", "/generate", raw(gen({"top_p": float("nan")}))),
    ("gen-bias-nan", "/generate", raw(gen({"logit_bias": {"5": float("nan")}}))),
    ("chat-n-65", "/v1/chat/completions", chat(n=65)),
    ("chat-max-tokens-1e9", "/v1/chat/completions", chat(max_tokens=10**9)),
    ("chat-top-logprobs-21", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21)),
    ("chat-stop-17", "/v1/chat/completions", chat(stop=["s"] * 17)),
    ("chat-messages-10000", "/v1/chat/completions", chat(messages=USER * 10000)),
    ("chat-content-huge", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "b" * (CTX * 64 + 1)}])),
    ("comp-prompts-x-n-over", "/v1/completions", comp(prompt=["a"] * 17, n=64)),
    ("comp-logprobs-21", "/v1/completions", comp(logprobs=21)),
    ("comp-ids-too-long", "/v1/completions", comp(prompt=[5] * CTX)),
    ("comp-max-tokens-huge", "/v1/completions", comp(max_tokens=10**20)),
    ("tokenize-huge", "/tokenize", {"prompt": "z" * (CTX * 64 + 1)}),
]
for name, path, body in BOUNDS:
    case(f"bound-{name}", "POST", path, body, JSON_CT if isinstance(body, bytes) else None)

# --- grammars: size, complexity (compile-time budget), remote/file references
GRAMMARS = [
    ("regex-huge", {"regex": "a" * 100_001}),
    ("regex-blowup-states", {"regex": "(a|b)*a(a|b){20}"}),
    ("regex-nested-repeat", {"regex": "(a{1,1000}){1,1000}"}),
    ("regex-nested-star", {"regex": "(a*)*b"}),
    ("regex-evil", {"regex": "(x+x+)+y"}),
    ("regex-backref", {"regex": "(a)\\1"}),
    ("regex-lookbehind", {"regex": "(?<=a)b"}),
    ("regex-unbalanced", {"regex": "((((a"}),
    ("regex-empty-class", {"regex": "[]"}),
    ("regex-huge-repeat", {"regex": "a{99999999}"}),
    ("schema-minlength-1e9", {"json_schema": json.dumps({"type": "string", "minLength": 10**9})}),
    ("schema-minitems-1e6", {"json_schema": json.dumps({"type": "array", "minItems": 10**6})}),
    ("schema-deep-arrays", {"json_schema": json.dumps({"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}}}})}),
    ("schema-nested-200", {"json_schema": json.dumps(json.loads('{"type":"array","items":' * 200 + '{"type":"integer"}' + "}" * 200))}),
    ("schema-recursive-ref", {"json_schema": json.dumps({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
                                                         "$ref": "#/$defs/n"})}),
    ("schema-remote-ref", {"json_schema": json.dumps({"$ref": "http://127.0.0.1:1/evil.json"})}),
    ("schema-file-ref", {"json_schema": json.dumps({"$ref": "file:///etc/passwd"})}),
    ("schema-not-json", {"json_schema": "{not json"}),
    ("schema-array-not-object", {"json_schema": "[1, 2]"}),
    ("schema-bad-type", {"json_schema": json.dumps({"type": 5})}),
    ("schema-int-range-huge", {"json_schema": json.dumps({"type": "integer", "minimum": -(10**300), "maximum": 10**300})}),
    ("schema-enum-10000", {"json_schema": json.dumps({"enum": [f"v{i}" for i in range(10000)]})}),
    ("schema-pattern-blowup", {"json_schema": json.dumps({"type": "string", "pattern": "(a|b)*a(a|b){20}"})}),
    ("ebnf", {"ebnf": 'root ::= "a"*'}),
    ("two-grammars", {"regex": "a", "json_schema": "{}"}),
]
for name, sp in GRAMMARS:
    case(f"grammar-gen-{name}", "POST", "/generate", gen(sp))
    case(f"grammar-chat-{name}", "POST", "/v1/chat/completions", chat(**sp))

# --- type confusion, field by field
CONFUSION = [None, -1, 0, 1.5, 10**40, "x", "", [], [None], {}, {"a": 1}, True]
for field in ("max_tokens", "temperature", "top_p", "n", "stop", "seed", "logit_bias", "stream", "response_format",
              "stream_options", "messages", "logprobs", "top_logprobs", "tools", "chat_template_kwargs"):
    for j, value in enumerate(CONFUSION[:6] if field not in ("messages", "response_format") else CONFUSION):
        body = chat(**{field: value})
        if field == "stream" and value is True:
            continue
        case(f"confuse-chat-{field}-{j}", "POST", "/v1/chat/completions", body)
for field in ("text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid",
              "image_data", "stream"):
    for j, value in enumerate([-1, 1.5, "x", [], {}, [[]], [[1], 2], 10**40]):
        case(f"confuse-gen-{field}-{j}", "POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, field: value}
             if field != "text" else {field: value, "sampling_params": {"max_new_tokens": 2}})
for field in ("prompt", "echo", "suffix", "best_of", "logprobs"):
    for j, value in enumerate([-1, 1.5, [[1], "a"], {}, 10**40, [[]]]):
        case(f"confuse-comp-{field}-{j}", "POST", "/v1/completions", comp(**{field: value}))

# --- authentication and authorization
for i, auth in enumerate([None, "", "Bearer", "Bearer ", "bearer " + KEY_A, "Bearer " + KEY_A + " ", "Basic " + KEY_A,
                          f"Bearer {KEY_A},{KEY_B}", "Bearer " + KEY_A[:-1], "Bearer " + KEY_A + "x", "Bearer " + "k" * 10000]):
    case(f"auth-{i}", "POST", "/generate", gen(), {"Authorization": auth})
case("auth-key-b-works-models", "GET", "/v1/models", None, {"Authorization": f"Bearer {KEY_B}"})

# --- local files, paths, methods, routes
for i, src in enumerate(["/etc/passwd", "file:///etc/passwd", "../../../../etc/passwd", "file://localhost/etc/shadow",
                         "http://127.0.0.1:1/x.png", "data:text/plain;base64,aGk="]):
    case(f"media-gen-{i}", "POST", "/generate", gen(image_data=src))
    case(f"media-chat-{i}", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": src}}]}]))
for i, (method, path) in enumerate([("GET", "/../../etc/passwd"), ("GET", "/%2e%2e/%2e%2e/etc/passwd"), ("GET", "/static/../../x"),
                                    ("GET", "/docs/../../../etc/passwd"), ("GET", "/" + "a" * 8000), ("TRACE", "/generate"),
                                    ("PATCH", "/generate"), ("DELETE", "/flush_cache"), ("PUT", "/abort_request"),
                                    ("GET", "/generate?text=hi"), ("POST", "/get_model_info"), ("GET", "/v1/models/../../x")]):
    case(f"route-{i}", method, path, None)
case("model-path-traversal", "POST", "/v1/chat/completions", chat(model="../../../../etc/passwd"))
case("chat-template-kwargs-override", "POST", "/v1/chat/completions", chat(chat_template_kwargs={"messages": []}))
case("chat-template-kwargs-jinja", "POST", "/v1/chat/completions", chat(chat_template_kwargs={"x": "{{ ''.__class__ }}"}))
case("chat-template-injection", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "{% for x in ().__class__.__base__.__subclasses__() %}{{x}}{% endfor %}"}]))
case("tokenize-not-string", "POST", "/tokenize", {"prompt": ["a"]})
case("abort-huge-rid", "POST", "/abort_request", {"rid": "z" * 100_000})


# --- the embedding and Ollama routes (issue 25): every family's bad input is a 4xx
def ollama_chat(**kw):
    return {"model": "default", "messages": USER, "stream": False, "options": {"num_predict": 4}, **kw}


def ollama_gen(**kw):
    return {"model": "default", "prompt": "Hi", "stream": False, "options": {"num_predict": 4}, **kw}


NEW_ROUTES = [
    ("emb-input-huge", "/v1/embeddings", {"input": "a" * (CTX * 64 + 1)}),
    ("emb-ids-too-long", "/v1/embeddings", {"input": [5] * CTX}),
    ("emb-batch-1025", "/v1/embeddings", {"input": ["a"] * 1025}),
    ("emb-ids-out-of-vocab", "/v1/embeddings", {"input": [[5], [10**9]]}),
    ("emb-surrogate", "/v1/embeddings", raw({"input": SURR})),
    ("emb-dimensions-negative", "/v1/embeddings", {"input": "a", "dimensions": -1}),
    ("emb-format", "/v1/embeddings", {"input": "a", "encoding_format": "binary"}),
    ("ollama-num-predict-1e30", "/api/generate", ollama_gen(options={"num_predict": 10**30})),
    ("ollama-top-k-huge", "/api/chat", ollama_chat(options={"top_k": 2**64})),
    ("ollama-temperature-nan", "/api/chat", raw(ollama_chat(options={"temperature": float("nan")}))),
    ("ollama-seed-float", "/api/chat", ollama_chat(options={"seed": 1e300})),
    ("ollama-stop-17", "/api/chat", ollama_chat(options={"stop": ["s"] * 17})),
    ("ollama-stop-surrogate", "/api/chat", raw(ollama_chat(options={"stop": [SURR]}))),
    ("ollama-options-list", "/api/chat", ollama_chat(options=[1, 2])),
    ("ollama-messages-10000", "/api/chat", ollama_chat(messages=USER * 10000)),
    ("ollama-content-huge", "/api/chat", ollama_chat(messages=[{"role": "user", "content": "b" * (CTX * 64 + 1)}])),
    ("ollama-content-surrogate", "/api/chat", raw(ollama_chat(messages=[{"role": "user", "content": SURR}]))),
    ("ollama-template-injection", "/api/chat", ollama_chat(messages=[{"role": "user", "content":
                                                                       "{% for x in range(10**9) %}{% endfor %}"}])),
    ("ollama-format-nested-200", "/api/chat", ollama_chat(format=json.loads('{"type":"array","items":' * 200
                                                                             + '{"type":"integer"}' + "}" * 200))),
    ("ollama-format-remote-ref", "/api/generate", ollama_gen(format={"$ref": "http://127.0.0.1:1/evil.json"})),
    ("ollama-format-minlength", "/api/generate", ollama_gen(format={"type": "string", "minLength": 10**9})),
    ("ollama-format-list", "/api/generate", ollama_gen(format=["json"])),
    ("ollama-context-huge", "/api/generate", ollama_gen(context=[5] * CTX)),
    ("ollama-context-negative", "/api/generate", ollama_gen(context=[-1])),
    ("ollama-prompt-huge", "/api/generate", ollama_gen(prompt="a" * (CTX * 64 + 1))),
    ("ollama-template", "/api/generate", ollama_gen(template="{{ .System }}")),
    ("ollama-raw-string", "/api/generate", ollama_gen(raw="yes")),
    ("ollama-embed-batch-1025", "/api/embed", {"model": "m", "input": ["a"] * 1025}),
    ("ollama-embed-no-truncate-long", "/api/embed", {"model": "m", "input": "hello " * 2000, "truncate": False}),
    ("ollama-embed-dimensions", "/api/embed", {"model": "m", "input": "a", "dimensions": 10**12}),
    ("ollama-embeddings-list", "/api/embeddings", {"model": "m", "prompt": ["a"]}),
    ("ollama-show-model-list", "/api/show", {"model": ["m"]}),
]
for name, path, body in NEW_ROUTES:
    case(f"new-{name}", "POST", path, body, JSON_CT if isinstance(body, bytes) else None)
for field in ("model", "messages", "stream", "format", "options", "keep_alive", "think", "tools"):
    for j, value in enumerate(CONFUSION):
        case(f"confuse-ollama-chat-{field}-{j}", "POST", "/api/chat", ollama_chat(**{field: value}))
for field in ("prompt", "system", "context", "raw", "images", "suffix"):
    for j, value in enumerate(CONFUSION[:6]):
        case(f"confuse-ollama-gen-{field}-{j}", "POST", "/api/generate", ollama_gen(**{field: value}))
for field in ("input", "truncate", "dimensions"):
    for j, value in enumerate(CONFUSION[:6]):
        case(f"confuse-ollama-embed-{field}-{j}", "POST", "/api/embed", {"model": "m", "input": "a", field: value})
        case(f"confuse-embeddings-{field}-{j}", "POST", "/v1/embeddings", {"input": "a", field: value})


def send(server, method: str, path: str, body, extra_headers: dict, timeout: float = 60.0) -> httpx.Response:
    """``extra_headers`` values of None remove that header (e.g. no Authorization at all)."""
    headers = {k: v for k, v in {**server.headers, **extra_headers}.items() if v is not None}
    payload = {"content": body} if isinstance(body, bytes) else {} if body is None else {"json": body}
    return httpx.request(method, server.url + path, headers=headers, timeout=timeout, **payload)


def check_answer(r: httpx.Response, where: str) -> None:
    assert r.status_code < 500, f"{where}: {r.status_code} {r.text[:300]}"
    assert "Traceback" not in r.text and 'File "' not in r.text, f"{where}: stack trace leaked: {r.text[:300]}"
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        # A stream's failure is an error event: the same rule, no server-side (5xx) error.
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{where}: stream not ended by [DONE]: {r.text[-300:]}"
        for event in events[:-1]:
            err = json.loads(event).get("error")
            assert err is None or err.get("code", 500) < 500, f"{where}: stream error {event[:300]}"
    if r.status_code >= 400 and r.request.method != "HEAD":
        err = r.json().get("error")
        if r.request.url.path.startswith("/api/") and isinstance(err, str):  # Ollama's error body: {"error": "..."}
            assert err, f"{where}: {r.text[:300]}"
            return
        assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], f"{where}: {r.text[:300]}"
        assert isinstance(err.get("type"), str), f"{where}: {r.text[:300]}"


def test_corpus_is_large_and_distinct():
    assert len(CORPUS) >= 200
    assert len({c[0] for c in CORPUS}) == len(CORPUS)


def test_hostile_corpus(rel_server):
    statuses: dict[int, int] = {}
    for name, method, path, body, headers in CORPUS:
        try:
            r = send(rel_server, method, path, body, headers)
        except httpx.HTTPError as e:
            # A client-side or protocol refusal (e.g. h11 rejecting an oversized header) is fine; a dead server is not.
            assert rel_server.is_alive(), f"{name}: the server died ({e}):\n{rel_server.log_tail()}"
            statuses[-1] = statuses.get(-1, 0) + 1
            continue
        check_answer(r, name)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert rel_server.is_alive(), f"{name} killed the server:\n{rel_server.log_tail()}"
    print(f"\nhostile corpus: {len(CORPUS)} requests, statuses {dict(sorted(statuses.items()))}")
    assert not any(s >= 500 for s in statuses)


# --- schema-driven fuzzing -----------------------------------------------------------------------------------------
def _route_schemas(server) -> list[tuple[str, dict]]:
    spec = httpx.get(server.url + "/openapi.json", headers=server.headers, timeout=30).json()
    out = []
    for path, ops in spec["paths"].items():
        body = ops.get("post", {}).get("requestBody")
        if body:
            out.append((path, body["content"]["application/json"]["schema"]))
    return out


def _mutate(draw, value):
    """Type confusion on top of schema-valid bodies: a field replaced by an arbitrary JSON value."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        junk = draw(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                                 max_leaves=8))
        return {**value, key: junk}
    return value


def _cap_tokens(body):
    """Keeps accepted fuzz requests cheap: generation lengths bounded, n small (a large n past the per-request cap
    stays: a quick 400), no streams left open."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 8:
                body[key] = 8
        if body.get("max_tokens", 0) is None or ("messages" in body or "prompt" in body) and "max_tokens" not in body:
            body["max_tokens"] = 4
        sp = body.get("sampling_params")
        for one in sp if isinstance(sp, list) else [sp]:
            if isinstance(one, dict):
                if not isinstance(one.get("max_new_tokens"), int) or one["max_new_tokens"] > 8:
                    one["max_new_tokens"] = 4
                if isinstance(one.get("n"), int) and 4 < one["n"] <= MAX_PROMPTS_PER_REQUEST:
                    one["n"] = 4
        if ("text" in body or "input_ids" in body) and not isinstance(sp, (dict, list)):
            body["sampling_params"] = {"max_new_tokens": 4}
        body.pop("n", None) if isinstance(body.get("n"), int) and body["n"] > 4 else None
        options = body.get("options")  # Ollama's generation length
        if isinstance(options, dict) and not (isinstance(options.get("num_predict"), int) and 0 <= options["num_predict"] <= 8):
            options["num_predict"] = 4
        elif options is None and ("messages" in body or "prompt" in body):
            body["options"] = {"num_predict": 4}
    return body


def _generate_bodies():
    """/generate bodies with typed sampling params: the OpenAPI schema leaves ``sampling_params`` a free-form object,
    so the schema-driven draws almost never name a real parameter. Edge values (tiny penalties, -inf biases, stop
    ids under min_new_tokens, grammars, n, seeds) in every combination, as the crash requests of issue 21 had."""
    edge = st.sampled_from([0, 1, -1, 0.5, 1e-300, 5e-324, 1e-2, 2, 100, 1e308, -1e308, float("inf"), float("-inf")])
    num = edge | st.floats(-3, 3, allow_nan=False)
    big = st.sampled_from([10**6, 2**63, 2**64, -(2**63) - 1, 10**30])
    tid = st.integers(-1, 520)  # the tiny model's vocabulary is 512
    params = {
        "max_new_tokens": st.integers(-1, 8), "min_new_tokens": st.integers(-1, 8), "temperature": num, "top_p": num,
        "top_k": st.integers(-2, 600) | big, "min_p": num, "frequency_penalty": num, "presence_penalty": num,
        "repetition_penalty": num, "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
        "stop_token_ids": st.lists(tid, max_size=4), "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(), "no_stop_trim": st.booleans(), "seed": st.integers(-3, 3) | big,
        "sampling_seed": st.integers(0, 3), "n": st.integers(-1, 4) | big | st.floats(0, 3, allow_nan=False),
        "regex": st.sampled_from(["x", "[0-9]+", "a|b", "(ab)*c?", "", "\\d{2}"]),
        "json_schema": st.sampled_from([{}, {"type": "integer"}, '{"type": "string", "maxLength": 3}', "{}"]),
        "ebnf": st.sampled_from(['root ::= "a"', "root ::= [0-9]+"]),
        "logit_bias": st.dictionaries(tid.map(str), num, max_size=3),
    }
    sp = st.fixed_dictionaries({}, optional=params)
    prompt = st.sampled_from(["Hi", "x", "12", "{", ""])
    inputs = (st.fixed_dictionaries({"text": prompt | st.lists(prompt, min_size=1, max_size=3)})
              | st.fixed_dictionaries({"input_ids": st.lists(tid, min_size=1, max_size=4)
                                       | st.lists(st.lists(tid, min_size=1, max_size=3), max_size=3)}))
    rest = st.fixed_dictionaries(
        {"sampling_params": sp | st.lists(sp, min_size=1, max_size=3)},
        optional={"return_logprob": st.booleans(), "top_logprobs_num": st.integers(-1, 3), "logprob_start_len": st.integers(-2, 3),
                  "stream": st.booleans(), "rid": st.sampled_from(["r", "r-0"])})
    return st.tuples(inputs, rest).map(lambda parts: {**parts[0], **parts[1]})


@pytest.fixture(scope="module")
def fuzz_routes(rel_server):
    return _route_schemas(rel_server)


def test_openapi_schema_documents_request_bodies(fuzz_routes):
    paths = {p for p, _ in fuzz_routes}
    assert {"/generate", "/v1/chat/completions", "/v1/completions", "/tokenize", "/abort_request", "/v1/embeddings",
            "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show"} <= paths


# >= 1,000 requests from a fixed seed (derandomize): FUZZ_EXAMPLES hypothesis examples of FUZZ_BATCH bodies each,
# every batch sent concurrently (the server batches the accepted ones; drawing the bodies costs about as much).
FUZZ_EXAMPLES = 130
FUZZ_BATCH = 8
FUZZ_MIN_REQUESTS = 1000
FUZZ_REQUEST_TIMEOUT_S = 30  # an answer later than this is a hang


def test_openapi_fuzz(rel_server, fuzz_routes):
    from hypothesis_jsonschema import from_schema

    strategies = [st.tuples(st.just(path), from_schema(schema)) for path, schema in fuzz_routes]
    strategies.append(st.tuples(st.just("/generate"), _generate_bodies()))
    seen: dict[int, int] = {}
    client = httpx.Client(base_url=rel_server.url, headers={**rel_server.headers, **JSON_CT}, timeout=FUZZ_REQUEST_TIMEOUT_S,
                          limits=httpx.Limits(max_connections=FUZZ_BATCH, max_keepalive_connections=FUZZ_BATCH))

    def post(path: str, content: bytes) -> httpx.Response:
        try:
            return client.post(path, content=content)
        except httpx.TimeoutException:
            raise AssertionError(f"fuzz {path} {content[:300]!r}: no answer in {FUZZ_REQUEST_TIMEOUT_S} s "
                                 f"(alive: {rel_server.is_alive()})") from None

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        batch = []
        for _ in range(FUZZ_BATCH):
            path, body = data.draw(st.one_of(strategies))
            batch.append((path, json.dumps(_cap_tokens(_mutate(data.draw, body))).encode()))
        answers = list(pool.map(lambda item: post(*item), batch))
        for r in answers:
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
        for (path, content), r in zip(batch, answers):
            check_answer(r, f"fuzz {path} {content[:300]!r}")
        assert rel_server.is_alive(), (f"a fuzz batch killed the server: {[(p, c[:200]) for p, c in batch]}\n"
                                       f"{rel_server.log_tail()}")

    start = time.monotonic()
    with client, ThreadPoolExecutor(FUZZ_BATCH) as pool:
        run()
    sent = sum(seen.values())
    print(f"\nopenapi fuzz: {sent} requests in {time.monotonic() - start:.1f} s, statuses {dict(sorted(seen.items()))}")
    assert sent >= FUZZ_MIN_REQUESTS
