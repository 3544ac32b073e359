"""The RAG example (examples/rag_pipeline/run.py) retrieves with the server's /v1/embeddings, and falls back to BM25
when the server has none."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.integration.conftest import free_port

pytest.importorskip("dspy")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("rag_example", os.path.join(REPO, "examples", "rag_pipeline", "run.py"))
rag_example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rag_example)

# The passage (corpus id) that answers each of the example's questions, in order.
GOLD = ["radix", "lru", "fsm", "lpm", "fork", "paris", "chunked", "retract", "bm25", "eiffel", "seine", "openai"]


def corpus_ids() -> dict[str, str]:
    with open(os.path.join(REPO, "examples", "rag_pipeline", "corpus", "docs.jsonl")) as f:
        return {d["text"]: d["id"] for d in map(json.loads, filter(str.strip, f))}


def test_retrieves_with_the_servers_embeddings(server):
    retriever, kind = rag_example.make_retriever(rag_example.load_corpus(),
                                                 rag_example.server_embedder(server.url, server.api_key))
    assert kind == "embeddings" and isinstance(retriever, rag_example.EmbeddingRetriever)
    ids = corpus_ids()
    top = [ids[retriever(q, k=1)[0]] for q in rag_example.QUESTIONS]
    hits = sum(t == g for t, g in zip(top, GOLD))
    assert hits >= 10, list(zip(rag_example.QUESTIONS, top))
    assert len(retriever(rag_example.QUESTIONS[0], k=3)) == 3


def test_falls_back_to_bm25_without_embeddings(server):
    nowhere = rag_example.server_embedder(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    retriever, kind = rag_example.make_retriever(rag_example.load_corpus(), nowhere)
    assert kind == "bm25" and isinstance(retriever, rag_example.BM25)
    unauthorized = rag_example.server_embedder(server.url, "sk-wrong")  # a 401 from a live server
    assert rag_example.make_retriever(rag_example.load_corpus(), unauthorized)[1] == "bm25"
    with pytest.raises(Exception):
        rag_example.make_retriever(rag_example.load_corpus(), nowhere, "embeddings")
