"""OpenAI conformance against the real server (embedded SmolLM2) with the real ``openai`` client: any model name is
served; the stop token (EOS ``<|im_end|>`` or a ``stop_token_ids`` entry) is neither listed in the logprobs nor
counted in ``completion_tokens``, streamed or not, while the native /generate keeps both; /v1/embeddings returns
HF transformers' pooled final hidden states (fp32, atol 1e-5) in OpenAI's shape, and refuses bad input with a 4xx.
The KV pool is whole after every test (conftest)."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from sglang_backend.runtime.model_loader.embedded import default_model_path
from sglang_backend.runtime.model_loader.loader import load_hf_reference

# A prompt SmolLM2 answers briefly at temperature 0, ending on <|im_end|> well before MAX_TOKENS.
SHORT_ANSWER = [{"role": "user", "content": "Reply with one word: hello"}]
MAX_TOKENS = 48
ATOL = 1e-5
EMBED_TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors."]


def chat_greedy(oai, **kw):
    return oai.chat.completions.create(model="any-model-name", messages=SHORT_ANSWER, max_tokens=MAX_TOKENS,
                                       temperature=0, **kw)


def native_greedy(http: httpx.Client, prompt: str | list[int]) -> dict:
    source = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
    r = http.post("/generate", json={**source, "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()


def chat_prompt_ids() -> list[int]:
    """The chat route's prompt for SHORT_ANSWER: the template rendered, tokenized without special tokens."""
    tok = AutoTokenizer.from_pretrained(default_model_path())
    text = tok.apply_chat_template(SHORT_ANSWER, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


# Model names ---------------------------------------------------------------------------------------------------------
def test_any_model_name_is_served_and_echoed(oai, http):
    for name in ("gpt-4o", "text-embedding-3-small", "whatever/else"):
        r = oai.chat.completions.create(model=name, messages=SHORT_ANSWER, max_tokens=2, temperature=0)
        assert r.model == name and r.choices[0].message.content is not None
    c = oai.completions.create(model="gpt-3.5-turbo-instruct", prompt="Hi", max_tokens=2, temperature=0)
    assert c.model == "gpt-3.5-turbo-instruct"
    models = [m.id for m in oai.models.list()]
    assert len(models) >= 1
    r = http.post("/generate", json={"text": "Hi", "model": "other", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text


# The stop token: neither listed nor counted ------------------------------------------------------------------------
def test_eos_not_listed_in_chat_logprobs_nor_counted(oai, http):
    r = chat_greedy(oai, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", "the test prompt must end on EOS"
    tokens = [t.token for t in choice.logprobs.content]
    assert "<|im_end|>" not in tokens
    assert len(tokens) == r.usage.completion_tokens
    assert "".join(tokens) == choice.message.content
    native = native_greedy(http, chat_prompt_ids())
    meta = native["meta_info"]
    # The native API keeps the EOS (as upstream SGLang): one more token, listed and counted.
    assert meta["finish_reason"]["type"] == "stop" and meta["completion_tokens"] == r.usage.completion_tokens + 1
    assert len(meta["output_token_logprobs"]) == len(tokens) + 1


def test_eos_not_listed_nor_counted_when_streamed(oai):
    full = chat_greedy(oai, logprobs=True)
    chunks = list(chat_greedy(oai, logprobs=True, stream=True, stream_options={"include_usage": True}))
    streamed = [t.token for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert "<|im_end|>" not in streamed
    assert streamed == [t.token for t in full.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == len(streamed)


def test_stop_token_ids_not_listed_nor_counted_in_completions(oai, http):
    prompt = "Count: one, two, three, four, five,"
    free = native_greedy(http, prompt)["output_ids"]
    stop_id = free[3]
    k = free.index(stop_id)  # tokens before the first occurrence of the stop token
    for stream in (False, True):
        kw = dict(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                  extra_body={"stop_token_ids": [stop_id]})
        if stream:
            chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
            count = chunks[-1].usage.completion_tokens
        else:
            r = oai.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            tokens, count = r.choices[0].logprobs.tokens, r.usage.completion_tokens
        assert count == k == len(tokens), (stream, count, k, tokens)


# echo + logprobs: prompt scoring ----------------------------------------------------------------------------------------
SCORED = "The capital of France is Paris, and the capital of Italy is"


def test_echo_with_logprobs_scores_the_prompt_as_openai_does(oai, http):
    """``echo`` + ``logprobs`` (+ ``max_tokens`` 0): the prompt's tokens with their logprobs, the first with none
    (OpenAI's API, vLLM; lm-evaluation-harness computes loglikelihoods this way). The values equal /generate's
    prompt logprobs; with max_tokens > 0 the output tokens follow, as without echo; streamed, the same entries."""
    native = http.post("/generate", json={"text": SCORED, "return_logprob": True, "logprob_start_len": 0,
                                          "sampling_params": {"max_new_tokens": 0}})
    assert native.status_code == 200, native.text
    expected = [lp for lp, *_ in native.json()["meta_info"]["input_token_logprobs"]]
    r = oai.completions.create(model="m", prompt=SCORED, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = r.choices[0]
    assert choice.text == SCORED and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.prompt_tokens == len(expected)
    assert "".join(lp.tokens) == SCORED
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected[1:], abs=ATOL)
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])  # 2 asked; a tie may merge two tokens' texts
    plain = oai.completions.create(model="m", prompt=SCORED, max_tokens=3, logprobs=1, temperature=0).choices[0]
    both = oai.completions.create(model="m", prompt=SCORED, max_tokens=3, echo=True, logprobs=1, temperature=0)
    both = both.choices[0]
    assert both.text == SCORED + plain.text
    assert both.logprobs.tokens == lp.tokens + plain.logprobs.tokens
    assert both.logprobs.token_logprobs[len(lp.tokens):] == pytest.approx(plain.logprobs.token_logprobs, abs=ATOL)
    chunks = list(oai.completions.create(model="m", prompt=SCORED, max_tokens=3, echo=True, logprobs=1,
                                         temperature=0, stream=True))
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert streamed == both.logprobs.tokens


def test_max_tokens_zero_without_echo_returns_nothing(oai):
    r = oai.completions.create(model="m", prompt=SCORED, max_tokens=0, temperature=0)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 0


# /v1/embeddings -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_smollm():
    path = default_model_path()
    return load_hf_reference(path), AutoTokenizer.from_pretrained(path)


def hf_last_token_embedding(hf_smollm, ids: list[int]) -> torch.Tensor:
    model, _ = hf_smollm
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0)


def test_openai_client_embeddings_equal_hf(oai, hf_smollm):
    _, tok = hf_smollm
    r = oai.embeddings.create(model="text-embedding-3-small", input=EMBED_TEXTS)  # the client asks for base64
    assert r.model == "text-embedding-3-small" and [d.index for d in r.data] == [0, 1]
    ids = [tok.encode(t) for t in EMBED_TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, one in zip(r.data, ids):
        got = torch.tensor(d.embedding)
        assert got.shape == (model_hidden(hf_smollm),)
        assert torch.allclose(got, hf_last_token_embedding(hf_smollm, one), atol=ATOL, rtol=0)
    by_ids = oai.embeddings.create(model="m", input=ids[0], encoding_format="float")
    assert torch.allclose(torch.tensor(by_ids.data[0].embedding), torch.tensor(r.data[0].embedding), atol=ATOL, rtol=0)
    batch_ids = oai.embeddings.create(model="m", input=ids, encoding_format="float")
    assert len(batch_ids.data) == 2 and batch_ids.usage.prompt_tokens == r.usage.prompt_tokens


def model_hidden(hf_smollm) -> int:
    return hf_smollm[0].config.hidden_size


def test_embeddings_raw_http_float_and_base64(http, hf_smollm):
    hidden = model_hidden(hf_smollm)
    f = http.post("/v1/embeddings", json={"input": "hi", "encoding_format": "float", "dimensions": hidden}).json()
    b = http.post("/v1/embeddings", json={"input": "hi", "encoding_format": "base64"}).json()
    assert f["object"] == "list" and f["data"][0]["object"] == "embedding"
    decoded = struct.unpack(f"<{hidden}f", base64.b64decode(b["data"][0]["embedding"]))
    assert torch.allclose(torch.tensor(decoded), torch.tensor(f["data"][0]["embedding"]), atol=1e-7, rtol=0)


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, None), ({"input": []}, "input"), ({"input": [[]]}, None), ({"input": [1, 10**9]}, None),
    ({"input": [-1]}, None), ({"input": {"text": "hi"}}, "input"), ({"input": ["a", 5]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"), ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({}, "input"), ({"input": [28] * 9000}, None),
])
def test_embeddings_bad_input_is_a_4xx(http, body, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert (err["param"] or "").startswith(param), err


def test_dimensions_other_than_hidden_size_refused_by_client(oai):
    with pytest.raises(openai.BadRequestError, match="hidden size"):
        oai.embeddings.create(model="m", input="hi", dimensions=3)
