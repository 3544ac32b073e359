"""DSPy RAG pipeline (paper: the official DSPy example): retrieve passages, then a ``dspy.Predict`` with
shared instructions and few-shot demos answers through the ``sglang_dspy`` adapter (JSON adapter: the
answer is schema-constrained, so it always parses, also on a dummy model).

The adapter is imported lazily: when ``dspy``/``sglang_dspy`` is missing or broken the workload is skipped
with the reason in its result (``skipped``)."""

from __future__ import annotations

import inspect
import os
import sys
import threading

NAME = "dspy_rag"
DESCRIPTION = "DSPy RAG: shared instructions + demos, retrieved context (needs dspy + sglang_dspy)"
REUSE = True
HF = False  # the DSPy program talks to our adapter only
SIZES = {
    "smoke": dict(n=3, passages=6, passage_tokens=20, k=2, demos=2, question_tokens=8, max_tokens=48),
    "cpu": dict(n=6, passages=16, passage_tokens=50, k=2, demos=2, question_tokens=12, max_tokens=64),
    "gpu": dict(n=64, passages=200, passage_tokens=120, k=3, demos=4, question_tokens=24, max_tokens=96),
}
_LOCK = threading.Lock()
_STATE: dict = {}


def unavailable() -> str | None:
    """Why the workload cannot run here (None when it can)."""
    try:
        _modules()
    except Exception as e:  # noqa: BLE001 - any import failure means: skip, and say why
        return f"dspy / sglang_dspy unavailable: {type(e).__name__}: {e}"
    return None


def _modules():
    here = os.path.dirname(os.path.abspath(__file__))
    adapter_dir = os.path.normpath(os.path.join(here, "..", "..", "..", "adapters", "dspy"))
    if adapter_dir not in sys.path and os.path.isdir(adapter_dir):
        sys.path.append(adapter_dir)  # a source checkout without the package installed
    import dspy
    from sglang_dspy import SGLangLM

    return dspy, SGLangLM


def instances(tg, n, passages, passage_tokens, k, demos, question_tokens, max_tokens):
    corpus = [tg.text(passage_tokens) for _ in range(passages)]
    demo_rows = [dict(context=[tg.choice(corpus) for _ in range(k)], question=tg.text(question_tokens) + "?",
                      answer=tg.text(8)) for _ in range(demos)]
    out = []
    for _ in range(n):
        # Retrieval: the passages that share the most words with the question (a bag-of-words retriever).
        question = tg.text(question_tokens) + "?"
        words = set(question.lower().split())
        ranked = sorted(corpus, key=lambda p: -len(words & set(p.lower().split())))
        out.append(dict(question=question, context=ranked[:k], demos=demo_rows, max_tokens=max_tokens))
    return out


def _predictor(dspy, demos):
    key = ("predict", id(demos))
    with _LOCK:
        if key not in _STATE:
            predict = dspy.Predict("context: list[str], question: str -> answer: str")
            predict.demos = [dspy.Example(**d) for d in demos]
            _STATE[key] = predict
        return _STATE[key]


def _lm(SGLangLM, backend, max_tokens):
    key = ("lm", id(backend.engine), backend.fork_hints, max_tokens)
    with _LOCK:
        if key not in _STATE:
            # The adapter is being built alongside: pass the engine under whichever name it takes.
            params = inspect.signature(SGLangLM.__init__).parameters
            share = "runtime" if "runtime" in params else "engine"
            _STATE[key] = SGLangLM(**{share: backend.engine}, prefix_hints=backend.fork_hints, max_tokens=max_tokens,
                                   temperature=0.0, max_string_length=64, cache=False)
        return _STATE[key]


def reset() -> None:
    """Forgets the LMs built over an engine that is being shut down."""
    with _LOCK:
        _STATE.clear()


def run_one(kwargs: dict, backend) -> None:
    dspy, SGLangLM = _modules()
    predict = _predictor(dspy, kwargs["demos"])
    lm = _lm(SGLangLM, backend, kwargs["max_tokens"])
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        predict(context=kwargs["context"], question=kwargs["question"])
