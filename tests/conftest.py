"""Shared fixtures: tiny dummy models (saved once per session, loaded by both us and HF) and engines.

Every engine fixture checks after each test that the KV pool is whole: free + evictable == total, no locked
radix nodes, all request slots free.

Memory: an in-process engine holds its model and a 512 MiB KV pool, so none outlives its last user. The shared
engines (``tiny_engine``, ``smollm_engine``) live while consecutive modules use them and are shut down after the
last of the run (see ``SharedEngines``); a module's own engines are shut down by its fixtures. After each module
``_module_memory`` collects garbage, hands freed heap back to the OS and records the RSS: the closing lines list
it per module and name any Engine or Scheduler that outlived the module that made it (tests/memory_report.py).
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Callable

import pytest
import torch

from sglang_backend.runtime.model_executor import model_runner

# Under pytest-xdist (`make test` runs two workers on two cores) every worker computes on one thread, and so does
# every process it starts (servers, CLI runs): more threads than free cores makes each of them several times
# slower. A plain `pytest` keeps up to 4.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
else:
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# In-process test engines get a 512 MiB KV pool instead of the 2 GiB CPU default (the pool is zeroed, so every
# engine commits all of it): enough for a full SmolLM2 context (8k tokens) at 46 KiB per token. The servers
# the tests start pass --max-total-tokens themselves.
TEST_CPU_KV_BUDGET_BYTES = 512 << 20
model_runner.CPU_KV_BUDGET_BYTES = TEST_CPU_KV_BUDGET_BYTES
PEAK_RSS_WARN_GIB = 12


def _memory_summary() -> list[tuple[str, bool]]:
    """The closing lines about this process's memory, each with whether it is a warning."""
    from tests import memory_report

    lines = [(line, False) for line in memory_report.module_lines()]
    lines += [(f"warning: {warning}", True) for warning in memory_report.leak_warnings]
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30
    servers = memory_report.server_peaks_kib
    line = f"peak RSS: pytest {own:.2f} GiB"
    if servers:
        line += f"; largest of {len(servers)} test servers {max(servers) / 2**20:.2f} GiB (its processes summed)"
    lines.append((line, False))
    if own > PEAK_RSS_WARN_GIB:
        lines.append((f"warning: pytest's peak RSS is over {PEAK_RSS_WARN_GIB} GiB", True))
    return lines


_worker_memory: dict[str, list] = {}  # under xdist, on the controller: worker id -> its _memory_summary()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist (controller): a worker finished; keep the memory lines it sent (pytest_sessionfinish below)."""
    summary = getattr(node, "workeroutput", {}).get("memory_summary")
    if summary is not None:
        _worker_memory[node.gateway.id] = summary


def pytest_terminal_summary(terminalreporter):
    """The suite's memory: RSS after each module, engines that outlived their module, and the peak RSS of this
    pytest process and of the largest test server (all its processes); under xdist, those of each worker."""
    if _worker_memory:
        for worker in sorted(_worker_memory):
            terminalreporter.write_line(f"memory of xdist worker {worker}:")
            for line, warning in _worker_memory[worker]:
                terminalreporter.write_line(line, yellow=warning)
        return
    for line, warning in _memory_summary():
        terminalreporter.write_line(line, yellow=warning)


# The modules that take the longest (a minute or more on 2 CPU cores, from `make test`'s --durations), longest
# first. Under xdist (`make test` passes --no-loadscope-reorder) they are handed out first, so that the two
# workers end together instead of one finishing a long module alone; the other modules follow, those with the
# most tests first (xdist's own order). A plain `pytest` keeps pytest's order.
LONGEST_MODULES = [
    "tests/docs/test_readme.py",
    "tests/reliability/test_hostile.py",
    "tests/integration/test_langchain_adapter.py",
    "tests/integration/test_tool_calling.py",
    "tests/unit/test_gemma3_real.py",
    "tests/integration/test_structured_parse.py",
    "tests/unit/test_constrained_engine.py",
    "tests/unit/test_engine_equivalence.py",
    "tests/integration/test_process_hygiene.py",
    "tests/integration/test_router.py",
    "tests/integration/test_dspy_adapter.py",
    "tests/integration/test_server_abort.py",
    "tests/integration/test_langchain_openai.py",
    "tests/unit/test_peers.py",
]


def pytest_collection_modifyitems(config, items):
    if not XDIST_WORKER:
        return
    rank = {path: i for i, path in enumerate(LONGEST_MODULES)}
    counts: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        counts[module] = counts.get(module, 0) + 1

    def key(item):
        module = item.nodeid.split("::", 1)[0]
        return (rank.get(module, len(rank)), -counts[module], module)

    items.sort(key=key)  # stable: a module's tests keep their order


class SharedEngines:
    """Engines that test modules share (SmolLM2 takes seconds to load), one per fixture name.

    Built by the first module that uses it, kept while the next module uses it too, and shut down and dropped
    at the end of the last module of such a run: so besides a module's own engines only the shared engines the
    current module uses are alive, never one that waits through unrelated modules for a later user.
    """

    def __init__(self):
        self.engines: dict[str, object] = {}
        self.next_item = None  # the test after the one being torn down (set by pytest_runtest_teardown)
        self._module_fixtures: dict[str, set[str]] = {}  # item nodeid -> fixtures used anywhere in its module
        self._planned_for = None

    def _fixtures_of_module_of(self, item) -> set[str]:
        items = item.session.items
        if self._planned_for is not items:  # the final list (after -k/-m/--lf), computed once
            self._module_fixtures, self._planned_for = {}, items
            run: list = []
            for i, it in enumerate(items):
                run.append(it)
                if i + 1 == len(items) or items[i + 1].getparent(pytest.Module) is not it.getparent(pytest.Module):
                    names = set().union(*(r.fixturenames for r in run))
                    self._module_fixtures.update((r.nodeid, names) for r in run)
                    run = []
        return self._module_fixtures.get(item.nodeid, set(item.fixturenames))

    def use(self, name: str, build: Callable[[], object]):
        """Body of a module-scoped fixture: yields the shared engine ``name``, built with ``build()`` if needed."""
        if name not in self.engines:
            self.engines[name] = build()
        yield self.engines[name]
        nxt = self.next_item
        if nxt is None or name not in self._fixtures_of_module_of(nxt):
            self.release(name)

    def release(self, name: str) -> None:
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.shutdown()  # the memory goes with the last reference (pytest drops its own after this)

    def alive_ids(self) -> set[int]:
        return {id(e) for e in self.engines.values()}


SHARED_ENGINES = SharedEngines()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    SHARED_ENGINES.next_item = nextitem


_ended_modules: list[str] = []  # modules torn down, not yet measured


@pytest.fixture(scope="module", autouse=True)
def _module_memory(request):
    """After each module: its garbage collected, freed heap handed back, RSS and live engines recorded for the
    closing lines. Done once the protocol of the module's last test is over (pytest_runtest_protocol below):
    until then that test's arguments, an engine among them, are still referenced."""
    yield
    _ended_modules.append(request.node.nodeid)


def _measure_ended_modules() -> None:
    from tests import memory_report

    while _ended_modules:
        memory_report.end_module(_ended_modules.pop(0), SHARED_ENGINES.alive_ids())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    _measure_ended_modules()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """After pytest's own teardown of what is left (a run stopped early by -x or a failing fixture)."""
    for name in list(SHARED_ENGINES.engines):
        SHARED_ENGINES.release(name)
    _measure_ended_modules()
    workeroutput = getattr(session.config, "workeroutput", None)  # an xdist worker: sent to the controller
    if workeroutput is not None:
        workeroutput["memory_summary"] = _memory_summary()


def _tiny_dir(tmp_path_factory, name: str, **overrides) -> str:
    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

    out = str(tmp_path_factory.mktemp(name))
    save_dummy_hf_model(dummy_config(**overrides), out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory) -> str:
    """Llama, 4 query heads over 2 KV heads (GQA), untied embeddings."""
    return _tiny_dir(tmp_path_factory, "tiny_gqa", num_attention_heads=4, num_key_value_heads=2)


def block_types(table) -> Callable[[str], str | None]:
    """A ``block_type`` for _quantized_dir: the GGUF type of the first (part, type) of ``table`` whose part is in the
    weight's name; norms, and names no part matches, stay float32 (None)."""

    def block_type(name: str) -> str | None:
        if name.endswith("norm.weight"):
            return None
        return next((gguf_type for part, gguf_type in table if part in name), None)

    return block_type


# Which GGUF block type tiny_quantized_dir gives each weight. Layer 1's q and k differ, so its fused qkv cannot keep
# blocks and is dequantized at load: both paths in one model.
_tiny_block_type = block_types(((".layers.1.self_attn.k_proj", "Q8_0"),
                                ("q_proj", "Q4_1"), ("k_proj", "Q4_1"), ("v_proj", "Q4_1"), ("o_proj", "Q4_0"),
                                ("gate_proj", "Q8_0"), ("up_proj", "Q8_0"), ("down_proj", "Q4_1"),
                                ("embed_tokens", "Q8_0"), ("lm_head", "Q4_0")))


@pytest.fixture(scope="session")
def tiny_quantized_dir(tmp_path_factory, tiny_gqa_dir) -> str:
    """tiny_gqa's weights quantized in the test into GGUF blocks (Q4_0, Q4_1, Q8_0; see _tiny_block_type), stored
    as a converted GGUF stores them. The HF reference (load_hf_reference) dequantizes the same blocks."""
    return _quantized_dir(tmp_path_factory, "tiny_quantized", tiny_gqa_dir, _tiny_block_type)


# tiny_kquant_dir's block types: every K-quant, and the Q5 formats; its rows are multiples of 256 columns. Layer 1's
# q/k/v mix Q5_0 with Q8_0, as Gemma 3's Q4_K_M GGUF does: that fused layer keeps Q8_0 blocks.
_TINY_KQUANT_TYPES = ((".layers.1.self_attn.q_proj", "Q5_0"), (".layers.1.self_attn.k_proj", "Q5_0"),
                      (".layers.1.self_attn.v_proj", "Q8_0"),
                      ("q_proj", "Q4_K"), ("k_proj", "Q4_K"), ("v_proj", "Q4_K"), ("o_proj", "Q5_K"), ("gate_proj", "Q6_K"), ("up_proj", "Q6_K"), ("down_proj", "Q5_0"),
                      ("embed_tokens", "Q5_1"), ("lm_head", "Q6_K"))


_tiny_kquant_type = block_types(_TINY_KQUANT_TYPES)


@pytest.fixture(scope="session")
def tiny_kquant_dir(tmp_path_factory) -> str:
    """A tiny Llama (hidden 256, MLP 512: whole blocks of 256) quantized into K-quant and Q5 blocks
    (_TINY_KQUANT_TYPES), stored as a converted GGUF stores them."""
    source = _tiny_dir(tmp_path_factory, "tiny_kquant_fp32", hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2)
    return _quantized_dir(tmp_path_factory, "tiny_kquant", source, _tiny_kquant_type)


def _quantized_dir(tmp_path_factory, name: str, source: str, block_type) -> str:
    """``source`` with each weight quantized into the GGUF blocks ``block_type(name)`` says (None: kept float)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from sglang_backend.runtime.layers import gguf_quant
    from sglang_backend.runtime.model_loader.loader import iterate_weights

    out = str(tmp_path_factory.mktemp(name))
    for file in os.listdir(source):
        if not file.endswith(".safetensors"):
            shutil.copy(os.path.join(source, file), out)
    tensors, types = {}, {}
    for weight, tensor in iterate_weights(source):
        gguf_type = block_type(weight)
        tensors[weight] = tensor if gguf_type is None else gguf_quant.quantize(tensor, gguf_type)
        if gguf_type is not None:
            types[weight] = gguf_type
    save_file(tensors, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt", gguf_quant.GGUF_TYPES_METADATA: json.dumps(types)})
    return out


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory) -> str:
    """Llama with tied input/output embeddings (as SmolLM2)."""
    return _tiny_dir(tmp_path_factory, "tiny_tied", tie_word_embeddings=True, num_key_value_heads=4)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    """Qwen3: per-head q/k norms, GQA, a head size (32) that is not hidden / heads (16), tied embeddings."""
    return _tiny_dir(tmp_path_factory, "tiny_qwen3", model_type="qwen3", num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory) -> str:
    """Llama 3.x: rope_scaling type llama3 (scaled low frequencies), rope_theta 500k, GQA, tied embeddings."""
    return _tiny_dir(tmp_path_factory, "tiny_llama3", rope_theta=500000.0, tie_word_embeddings=True,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> str:
    """Qwen3-MoE: 4 experts, top 2, renormalised; the second of 3 layers dense (mlp_only_layers)."""
    return _tiny_dir(tmp_path_factory, "tiny_qwen3_moe", model_type="qwen3_moe", num_hidden_layers=3,
                     mlp_only_layers=[1], head_dim=32)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> str:
    """Gemma 3 text: 4 layers, local (window 8, shorter than most test prompts) and global ones interleaved, GQA,
    head size 32 (not hidden / heads), softmax scale from query_pre_attn_scalar 24 (not the head size), linear
    rope scaling on the global layers only, tied embeddings."""
    return _tiny_dir(tmp_path_factory, "tiny_gemma3", model_type="gemma3_text", num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                     sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                    "sliding_attention"],
                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


@pytest.fixture(scope="session")
def tiny_mistral_window_dir(tmp_path_factory) -> str:
    """Mistral with its sliding window (8, shorter than most test prompts) on every layer, GQA."""
    return _tiny_dir(tmp_path_factory, "tiny_mistral_window", model_type="mistral", sliding_window=8)


@pytest.fixture(scope="session")
def tiny_qwen3_window_dir(tmp_path_factory) -> str:
    """Qwen3 with use_sliding_window: window 8 on the layers from max_window_layers (1) on, global below."""
    return _tiny_dir(tmp_path_factory, "tiny_qwen3_window", model_type="qwen3", num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, use_sliding_window=True, sliding_window=8,
                     max_window_layers=1)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    """Mixtral: 4 experts, top 2, GQA."""
    return _tiny_dir(tmp_path_factory, "tiny_mixtral", model_type="mixtral")


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    from sglang_backend.runtime.model_loader.embedded import default_model_path

    return default_model_path()


def make_engine(model_path: str, **kwargs):
    from sglang_backend import Engine

    kwargs.setdefault("check_pool_on_idle", True)
    return Engine(model_path=model_path, **kwargs)


@pytest.fixture(scope="module")
def tiny_engine(tiny_gqa_dir):
    """Shared by consecutive modules (see SharedEngines)."""
    yield from SHARED_ENGINES.use("tiny_engine", lambda: make_engine(tiny_gqa_dir))


@pytest.fixture(scope="module")
def smollm_engine(smollm_dir):
    """Shared by consecutive modules (see SharedEngines)."""
    yield from SHARED_ENGINES.use("smollm_engine", lambda: make_engine(smollm_dir))


@pytest.fixture(autouse=True)
def _pool_whole_after_test(request):
    """After every test that used an engine fixture, its KV pool must be whole."""
    yield
    for name in ("tiny_engine", "smollm_engine"):
        if name in request.fixturenames:
            request.getfixturevalue(name).check_pool_whole()


@pytest.fixture(scope="module")
def hf_model_cache():
    """HF reference models loaded once per directory (and module: one module uses them)."""
    from sglang_backend.runtime.model_loader.loader import load_hf_reference

    cache: dict[str, object] = {}

    def get(path: str):
        if path not in cache:
            cache[path] = load_hf_reference(path)  # a converted GGUF's blocks dequantized
        return cache[path]

    yield get
    cache.clear()
