"""One compile budget for the whole grammar path (schema -> regex -> DFA -> token index), per-request cancellation,
and the time limit on chat templates (issue 21, items 2 and 3)."""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks.bench_hostile_latency import HOSTILE_TEMPLATE, nested_schema
from sglang_backend.runtime.constrained import GrammarCache, build_regex_from_schema
from sglang_backend.runtime.constrained.budget import CompileCancelled, GrammarTimeout, GrammarTooComplex
from sglang_backend.runtime.managers.chat_templates import TemplateTooSlow, render_chat
from sglang_backend.runtime.model_loader.loader import read_chat_template
from sglang_backend.utils import TimeLimitExceeded, time_limit

# Timing-sensitive: run in `make test`'s serial phase, not beside another xdist worker (pyproject markers).
pytestmark = pytest.mark.serial


def nested_defs_schema(levels: int) -> dict:
    return nested_schema(levels, fresh=False)  # property names "a" and "b": the regex sizes below depend on them


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


def make_cache(tokenizer, tmp_path, **kw) -> GrammarCache:
    return GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, backend="fsm", cache_dir=str(tmp_path), **kw)


# A regex that compiles in roughly 1-2 s on SmolLM2's vocabulary (8 levels of the nested schema: 29 KB of regex,
# ~7,400 DFA states): long enough to be stopped part-way, short enough to finish in the test.
SLOW_SCHEMA = nested_defs_schema(8)


def test_nested_defs_schema_is_refused_fast_by_size(tokenizer, tmp_path):
    cache = make_cache(tokenizer, tmp_path)
    schema = nested_defs_schema(15)  # 2.4 KB; expands to a regex of ~8 MB
    t0 = time.perf_counter()
    with pytest.raises(GrammarTooComplex, match="expands to a regex of more than 65536 characters"):
        cache.compile("json_schema", schema)
    assert time.perf_counter() - t0 < 1.0
    t0 = time.perf_counter()  # the verdict is cached: the same schema again fails at once
    with pytest.raises(ValueError, match="too complex"):
        cache.compile("json_schema", schema)
    assert time.perf_counter() - t0 < 0.05


def test_regex_size_bound_is_configurable():
    regex = build_regex_from_schema(nested_defs_schema(6))  # the default budget applies outside a cache too
    assert 5_000 < len(regex) < 65_536
    from sglang_backend.runtime.constrained import budget

    with budget.active(budget.GrammarBudget(max_regex_chars=1_000)):
        with pytest.raises(GrammarTooComplex):
            build_regex_from_schema(nested_defs_schema(6))


def test_deadline_covers_the_whole_path_and_is_not_cached(tokenizer, tmp_path):
    cache = make_cache(tokenizer, tmp_path, timeout_s=0.25)
    t0 = time.perf_counter()
    with pytest.raises(GrammarTimeout, match="longer than 0.25s"):
        cache.compile("json_schema", SLOW_SCHEMA)
    assert time.perf_counter() - t0 < 1.0
    # A timeout depends on the load, not only on the grammar: a later, roomier attempt compiles it.
    cache.timeout_s = 60
    assert cache.compile("json_schema", SLOW_SCHEMA).num_states > 1000


def test_cancel_stops_a_compilation_and_is_not_cached(tokenizer, tmp_path):
    cache = make_cache(tokenizer, tmp_path, timeout_s=60)
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.perf_counter()
    with pytest.raises(CompileCancelled):
        cache.compile("json_schema", SLOW_SCHEMA, cancel=cancel)
    assert time.perf_counter() - t0 < 0.8
    assert cache.compile("json_schema", SLOW_SCHEMA).num_states > 1000


def test_a_waiter_builds_the_grammar_itself_when_the_build_it_waited_for_is_cancelled(tokenizer, tmp_path):
    cache = make_cache(tokenizer, tmp_path, timeout_s=60)
    regex = build_regex_from_schema(SLOW_SCHEMA, max_string_length=None)  # as our engine compiles it
    cancel = threading.Event()
    results: dict[str, object] = {}

    def compile_(name, ev):
        try:
            results[name] = cache.compile("regex", regex, cancel=ev)
        except Exception as e:  # noqa: BLE001 - recorded for the asserts
            results[name] = e

    owner = threading.Thread(target=compile_, args=("owner", cancel))
    waiter = threading.Thread(target=compile_, args=("waiter", None))
    owner.start()
    time.sleep(0.05)
    waiter.start()  # finds the owner's build in flight and waits for it
    time.sleep(0.2)
    cancel.set()
    owner.join(30)
    waiter.join(30)
    assert isinstance(results["owner"], CompileCancelled)
    assert not isinstance(results["waiter"], Exception), results["waiter"]
    assert results["waiter"].num_states > 1000


def test_time_limit_interrupts_python_code_and_leaves_nothing_pending():
    t0 = time.perf_counter()
    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.2):
            while True:
                pass
    assert time.perf_counter() - t0 < 0.6
    with time_limit(0.1):
        total = sum(range(1000))
    time.sleep(0.3)  # a limit that passed after the block must not fire later
    assert total == 499500


def test_a_slow_chat_template_is_stopped_at_its_time_limit(smollm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    msgs = [{"role": "user", "content": "hi"}]
    assert "hi" in render_chat(tok, msgs, 2.0, add_generation_prompt=True)
    tok.chat_template = HOSTILE_TEMPLATE
    t0 = time.perf_counter()
    with pytest.raises(TemplateTooSlow, match="longer than 0.3s"):
        render_chat(tok, msgs, 0.3)
    assert time.perf_counter() - t0 < 1.0


def test_read_chat_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
