"""benchmarks/programs/dspy_eval.py: the seeded task, the program, the Evaluate / optimizer workloads and the timing
callback, with DSPy's DummyLM (no server)."""

from __future__ import annotations

import argparse

import pytest

dspy = pytest.importorskip("dspy")

from benchmarks.programs import dspy_eval  # noqa: E402


def workload_args(**kw) -> argparse.Namespace:
    args = dict(workload="evaluate", devset=6, trainset=5, valset=4, demos=2, bootstrapped=1, candidates=1, threads=2,
                context_words=30, facts=3, max_errors=1000, seed=0)
    args.update(kw)
    return argparse.Namespace(**args)


def test_dataset_is_seeded_sized_and_answerable():
    a = dspy_eval.make_dataset(dspy, 12, seed=7, context_words=50, facts=3)
    b = dspy_eval.make_dataset(dspy, 12, seed=7, context_words=50, facts=3)
    assert len(a) == 12 and [x.toDict() for x in a] == [x.toDict() for x in b]
    assert [x.toDict() for x in dspy_eval.make_dataset(dspy, 12, seed=8, context_words=50, facts=3)] != \
        [x.toDict() for x in a]
    for x in a:
        assert set(x.inputs().keys()) == {"context", "question"}
        name = x.question.removeprefix("What is the code of ").removesuffix("?")
        assert f"The code of {name} is {x.answer}." in x.context  # the answer is in the context
        assert x.context.count("The code of ") == 3 and len(x.context.split()) == 50 + 3 * 6
    assert len({x.context for x in a}) == 12  # every example its own context
    with pytest.raises(ValueError):
        dspy_eval.make_dataset(dspy, 0, seed=0)


def test_metric_is_exact_match_of_the_answers_last_word():
    ex = dspy.Example(answer="tango")
    assert dspy_eval.exact_match(ex, dspy.Prediction(answer=" Tango."))
    assert dspy_eval.exact_match(ex, dspy.Prediction(answer="The code of Zoe is tango."))
    assert not dspy_eval.exact_match(ex, dspy.Prediction(answer="tango foxtrot"))
    assert not dspy_eval.exact_match(ex, dspy.Prediction(answer="tangos"))
    assert not dspy_eval.exact_match(ex, dspy.Prediction())


def test_evaluate_calls_the_lm_once_per_example_with_the_demos_as_a_shared_prefix():
    QA = dspy_eval.make_program_class(dspy)
    args = workload_args()
    devset = dspy_eval.make_dataset(dspy, args.devset, args.seed * 1000 + 2, context_words=30, facts=3)
    lm = dspy.utils.DummyLM([{"answer": x.answer} for x in devset] * 2)
    recorder = dspy_eval.make_recorder(dspy, QA)
    with dspy.context(lm=lm, callbacks=[recorder]):
        score, details = dspy_eval.build_workload(dspy, QA, workload_args(threads=1))()
    assert len(lm.history) == args.devset and recorder.lm_calls == args.devset
    assert len(recorder.times) == args.devset and not recorder.errors  # one timed program call per example
    assert details == dict(examples=args.devset, demos=args.demos) and score == 100.0
    # every call carries the same demos (the long shared prefix) before its own example
    firsts = {str(h["messages"][:-1]) for h in lm.history}
    assert len(firsts) == 1 and len(lm.history[0]["messages"]) == 2 + 2 * args.demos


def test_recorder_counts_a_failing_program_call():
    QA = dspy_eval.make_program_class(dspy)

    recorder = dspy_eval.make_recorder(dspy, QA)
    with dspy.context(lm=None, callbacks=[recorder]), pytest.raises(Exception, match="LM"):
        QA()(context="c", question="q")  # no LM configured: the program call raises
    assert len(recorder.times) == 1 and recorder.errors and "LM" in recorder.errors[0]


def test_optimizer_scores_every_candidate_program_on_the_valset():
    QA = dspy_eval.make_program_class(dspy)
    args = workload_args(workload="optimizer")
    lm = dspy.utils.DummyLM([{"answer": "x"}] * 500)
    recorder = dspy_eval.make_recorder(dspy, QA)
    with dspy.context(lm=lm, callbacks=[recorder]):
        score, details = dspy_eval.build_workload(dspy, QA, args)()
    seeds = [c["seed"] for c in details["candidates"]]
    assert seeds == list(range(-3, args.candidates)) and score == 0.0
    # each candidate scored on the whole valset; the bootstrap teacher ran on the trainset (no demo passed the metric)
    evaluated = (3 + args.candidates) * args.valset
    bootstrapped = (1 + args.candidates) * args.trainset
    assert len(recorder.times) == evaluated + bootstrapped == len(lm.history)


def test_percentile_and_arguments():
    assert dspy_eval.percentile([3.0, 1.0, 2.0], 50) == 2.0 and dspy_eval.percentile([1.0] * 99 + [9.0], 99) == 1.0
    assert dspy_eval.percentile([1.0] * 98 + [9.0, 9.0], 99) == 9.0
    args, routes = dspy_eval.parse_args(["--workload", "optimizer", "--routes", "openai,sglang"])
    assert args.workload == "optimizer" and routes == ["openai", "sglang"]
    for bad in (["--workload", "nope"], ["--routes", "nope"], ["--devset", "0"], ["--threads", "0"],
                ["--demos", "-1"], ["--facts", "100"]):
        with pytest.raises(SystemExit):
            dspy_eval.parse_args(bad)
