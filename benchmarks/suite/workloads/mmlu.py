"""5-shot MMLU-style: per subject five worked examples shared by all its questions; one-token answers."""

from sglang_backend.lang.api import function, gen

NAME = "mmlu"
DESCRIPTION = "5-shot multiple choice: shared examples per subject, 1-token answer"
REUSE = True
HF = True
SIZES = {
    "smoke": dict(subjects=2, questions=3, question_tokens=(12, 20), choice_tokens=(3, 6)),
    "cpu": dict(subjects=3, questions=6, question_tokens=(30, 60), choice_tokens=(4, 10)),
    "gpu": dict(subjects=8, questions=24, question_tokens=(60, 120), choice_tokens=(8, 20)),
}
LETTERS = "ABCD"


def _question(tg, question_tokens, choice_tokens) -> str:
    lines = [tg.between(*question_tokens)]
    lines += [f"{c}. {tg.between(*choice_tokens)}" for c in LETTERS]
    return "\n".join(lines) + "\nAnswer:"


def instances(tg, subjects, questions, question_tokens, choice_tokens):
    out = []
    for _ in range(subjects):
        subject = tg.text(2, capitalize=False)
        shots = "".join(f"{_question(tg, question_tokens, choice_tokens)} {tg.choice(LETTERS)}\n\n" for _ in range(5))
        examples = f"The following are multiple choice questions (with answers) about {subject}.\n\n{shots}"
        out += [dict(examples=examples, question=_question(tg, question_tokens, choice_tokens))
                for _ in range(questions)]
    tg.rng.shuffle(out)  # arrival order interleaves subjects: the scheduler has to find the sharing
    return out


@function
def program(s, examples, question):
    s += examples + question
    s += gen("answer", max_tokens=1)
