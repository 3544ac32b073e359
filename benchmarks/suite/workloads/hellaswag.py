"""20-shot HellaSwag-style: one shared 20-shot context, then ``select`` over four candidate endings."""

from sglang_backend.lang.api import function, select

NAME = "hellaswag"
DESCRIPTION = "20-shot context shared by all, select() among 4 endings"
REUSE = True
HF = True
SIZES = {
    "smoke": dict(n=6, shot_tokens=(8, 12), context_tokens=(10, 16), ending_tokens=(4, 8)),
    "cpu": dict(n=8, shot_tokens=(10, 16), context_tokens=(16, 24), ending_tokens=(6, 12)),
    "gpu": dict(n=96, shot_tokens=(30, 50), context_tokens=(30, 60), ending_tokens=(10, 25)),
}


def instances(tg, n, shot_tokens, context_tokens, ending_tokens):
    few_shot = "".join(f"{tg.between(*shot_tokens)} {tg.between(*ending_tokens)}\n\n" for _ in range(20))
    return [dict(few_shot=few_shot, context=tg.between(*context_tokens),
                 choices=[" " + tg.between(*ending_tokens) for _ in range(4)]) for _ in range(n)]


@function
def program(s, few_shot, context, choices):
    s += few_shot + context
    s += select("ending", choices=choices)
