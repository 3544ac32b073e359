"""OpenAI-shape helpers without a server: the stop token left out of counts and logprobs, /v1/models with
--served-model-name aliases, and /v1/embeddings' input shapes, dimensions and base64 encoding."""

from __future__ import annotations

import asyncio
import base64
import struct
from types import SimpleNamespace as NS

import pytest

from sglang_backend.runtime.entrypoints import execution, openai_embeddings, operations
from sglang_backend.runtime.entrypoints.app_context import AppContext
from sglang_backend.runtime.entrypoints.errors import APIError
from sglang_backend.runtime.entrypoints.openai_common import usage, without_stop_token
from sglang_backend.runtime.entrypoints.openai_protocol import EmbeddingRequest
from sglang_backend.runtime.server_args import ServerArgs

EOS = 2


def finished(ids, matched, with_tops=True) -> dict:
    pairs = [(-0.5, t) for t in ids]
    meta = {"finish_reason": {"type": "stop", "matched": matched}, "completion_tokens": len(ids),
            "prompt_tokens": 3, "output_token_logprobs": pairs}
    if with_tops:
        meta["output_top_logprobs"] = [[(-0.5, t)] for t in ids]
    return {"text": "x", "output_ids": list(ids), "meta_info": meta}


def test_stop_token_dropped_from_count_and_logprobs():
    out = finished([5, 6, EOS], EOS)
    seen = without_stop_token(out)
    assert seen["meta_info"]["completion_tokens"] == 2 and seen["output_ids"] == [5, 6]
    assert [t for _, t in seen["meta_info"]["output_token_logprobs"]] == [5, 6]
    assert len(seen["meta_info"]["output_top_logprobs"]) == 2
    assert out["meta_info"]["completion_tokens"] == 3 and len(out["meta_info"]["output_token_logprobs"]) == 3  # a copy
    assert usage([seen])["completion_tokens"] == 2 and usage([out])["completion_tokens"] == 3


def test_other_finishes_keep_every_token():
    for out in (finished([5, 6], "stop-string"), finished([5, 6], None),
                {"text": "", "output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                                                 "completion_tokens": 2}}):
        assert without_stop_token(out) is out
    assert without_stop_token(finished([5, EOS], EOS), keep_stop_token=True)["meta_info"]["completion_tokens"] == 2
    assert without_stop_token(finished([5, EOS], True))["meta_info"]["completion_tokens"] == 2  # a bool is no token id
    # A stream's chunk before the finish has no finish reason: untouched.
    chunk = {"text": "a", "output_ids": [5], "meta_info": {"finish_reason": None, "completion_tokens": 1}}
    assert without_stop_token(chunk) is chunk


def test_models_lists_every_alias():
    names = ServerArgs(served_model_name="main,alias").served_model_name
    ctx = AppContext(tm=NS(info={"context_len": 64}), server_args=NS(served_model_name=names, model_path=None),
                     metrics=None, prep=None, model_name="main", model_aliases=("alias",))
    request = NS(app=NS(state=NS(ctx=ctx)))
    listed = asyncio.run(operations.models(request))
    assert [m["id"] for m in listed["data"]] == ["main", "alias"]
    assert all(m["max_model_len"] == 64 for m in listed["data"])


def embedding_request(**kw) -> EmbeddingRequest:
    return EmbeddingRequest.model_validate(kw)


def test_embedding_input_shapes():
    assert openai_embeddings.embedding_inputs(embedding_request(input="a")) == ["a"]
    assert openai_embeddings.embedding_inputs(embedding_request(input=["a", "b"])) == ["a", "b"]
    assert openai_embeddings.embedding_inputs(embedding_request(input=[1, 2])) == [[1, 2]]
    assert openai_embeddings.embedding_inputs(embedding_request(input=[[1], [2, 3]])) == [[1], [2, 3]]
    with pytest.raises(APIError, match="empty"):
        openai_embeddings.embedding_inputs(embedding_request(input=[]))


def test_dimensions_must_be_the_hidden_size():
    ctx = NS(tm=NS(info={"hidden_size": 64}))
    execution.check_dimensions(ctx, None)
    execution.check_dimensions(ctx, 64)
    with pytest.raises(APIError, match="hidden size \\(64\\)") as e:
        execution.check_dimensions(ctx, 32)
    assert e.value.status == 400 and e.value.param == "dimensions"


def test_base64_is_little_endian_float32():
    vec = [0.5, -1.25, 3.0]
    assert openai_embeddings.encode_vector(vec, "float") is vec
    raw = base64.b64decode(openai_embeddings.encode_vector(vec, "base64"))
    assert list(struct.unpack("<3f", raw)) == vec


def test_server_args_embedding_pooling_is_checked():
    assert ServerArgs().embedding_pooling == "last"
    with pytest.raises(ValueError, match="embedding_pooling"):
        ServerArgs(embedding_pooling="max")


def test_logprob_entries_carry_each_tokens_own_bytes(smollm_dir):
    """A character split over byte tokens decodes to U+FFFD token by token; the entries' bytes are the tokens' own,
    so they join into the text's bytes (OpenAI's ``bytes`` field; the LangChain adapter reports the same)."""
    from transformers import AutoTokenizer

    from sglang_backend.runtime.entrypoints.openai_common import token_entry

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    text = "Taro's color: 黒 #E"
    entries = [token_entry(tok, tid, -0.5) for tid in tok.encode(text)]
    assert any(e["token"] == "\ufffd" for e in entries)  # the split character is there
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == text
    assert all(e["logprob"] == -0.5 for e in entries)
