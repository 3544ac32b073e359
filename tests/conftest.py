"""Shared fixtures: tiny dummy models (saved once per session, loaded by both us and HF) and engines.

Every engine fixture checks after each test that the KV pool is whole: free + evictable == total, no locked
radix nodes, all request slots free.
"""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def _tiny_dir(tmp_path_factory, name: str, **overrides) -> str:
    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

    out = str(tmp_path_factory.mktemp(name))
    save_dummy_hf_model(dummy_config(**overrides), out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory) -> str:
    """Llama, 4 query heads over 2 KV heads (GQA), untied embeddings."""
    return _tiny_dir(tmp_path_factory, "tiny_gqa", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory) -> str:
    """Llama with tied input/output embeddings (as SmolLM2)."""
    return _tiny_dir(tmp_path_factory, "tiny_tied", tie_word_embeddings=True, num_key_value_heads=4)


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    from sglang_backend.runtime.model_loader.embedded import default_model_path

    return default_model_path()


def make_engine(model_path: str, **kwargs):
    from sglang_backend import Engine

    kwargs.setdefault("check_pool_on_idle", True)
    return Engine(model_path=model_path, **kwargs)


@pytest.fixture(scope="session")
def tiny_engine(tiny_gqa_dir):
    engine = make_engine(tiny_gqa_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def smollm_engine(smollm_dir):
    engine = make_engine(smollm_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def _pool_whole_after_test(request):
    """After every test that used an engine fixture, its KV pool must be whole."""
    yield
    for name in ("tiny_engine", "smollm_engine"):
        if name in request.fixturenames:
            request.getfixturevalue(name).check_pool_whole()


@pytest.fixture(scope="session")
def hf_model_cache():
    """HF reference models loaded once per directory."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def get(path: str):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get
