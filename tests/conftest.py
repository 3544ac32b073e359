"""Shared fixtures: tiny dummy models (saved once per session, loaded by both us and HF) and engines.

Every engine fixture checks after each test that the KV pool is whole: free + evictable == total, no locked
radix nodes, all request slots free.
"""

from __future__ import annotations

import os
import resource
import sys

import pytest
import torch

from sglang_backend.runtime.model_executor import model_runner

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# In-process test engines get a 512 MiB KV pool instead of the 2 GiB CPU default (the pool is zeroed, so every
# engine commits all of it): enough for a full SmolLM2 context (8k tokens) at 46 KiB per token. The servers
# the tests start pass --max-total-tokens themselves.
TEST_CPU_KV_BUDGET_BYTES = 512 << 20
model_runner.CPU_KV_BUDGET_BYTES = TEST_CPU_KV_BUDGET_BYTES
PEAK_RSS_WARN_GIB = 12


def pytest_terminal_summary(terminalreporter):
    """The suite's memory: peak RSS of this pytest process and of the largest test server (all its processes)."""
    from tests import memory_report

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30
    servers = memory_report.server_peaks_kib
    line = f"peak RSS: pytest {own:.2f} GiB"
    if servers:
        line += f"; largest of {len(servers)} test servers {max(servers) / 2**20:.2f} GiB (its processes summed)"
    terminalreporter.write_line(line)
    if own > PEAK_RSS_WARN_GIB:
        terminalreporter.write_line(f"warning: pytest's peak RSS is over {PEAK_RSS_WARN_GIB} GiB", yellow=True)


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
