"""Branch-solve-merge LLM judge: plan criteria, judge the answer under each criterion in parallel
(fork(3..6)), then merge the judgements into a verdict."""

from sglang_backend.lang.api import function, gen

NAME = "bsm_judge"
DESCRIPTION = "branch-solve-merge judge: fork(3..6) criteria, merge verdict"
REUSE = True
HF = True
SIZES = {
    "smoke": dict(n=3, question_tokens=10, answer_tokens=20, branches=(3, 6), judge_tokens=4, verdict_tokens=4),
    "cpu": dict(n=4, question_tokens=24, answer_tokens=120, branches=(3, 6), judge_tokens=12, verdict_tokens=8),
    "gpu": dict(n=32, question_tokens=60, answer_tokens=300, branches=(3, 6), judge_tokens=48, verdict_tokens=32),
}


def instances(tg, n, question_tokens, answer_tokens, branches, judge_tokens, verdict_tokens):
    return [dict(question=tg.text(question_tokens) + "?", answer=tg.text(answer_tokens),
                 criteria=[tg.text(3, capitalize=False) for _ in range(tg.randint(*branches))],
                 judge_tokens=judge_tokens, verdict_tokens=verdict_tokens) for _ in range(n)]


@function
def program(s, question, answer, criteria, judge_tokens, verdict_tokens):
    s += ("Please act as an impartial judge and evaluate the quality of the response to the user question.\n"
          "[Question]\n" + question + "\n[Response]\n" + answer + "\n")
    forks = s.fork(len(criteria))
    for f, c in zip(forks, criteria):
        f += f"Evaluate the response with respect to {c}:" + gen("judgement", max_tokens=judge_tokens)
    forks.join()
    for i, f in enumerate(forks):
        s += f"Judgement on {criteria[i]}: {f['judgement'].strip()}\n"
    s += "Final verdict:" + gen("verdict", max_tokens=verdict_tokens)
