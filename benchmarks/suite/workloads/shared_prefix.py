"""Generated shared-prefix serving load: ``groups`` system prompts, each shared by ``prompts`` questions
(lengths are parameters: ``--size system_tokens=2048`` ...)."""

from sglang_backend.lang.api import function, gen

NAME = "shared_prefix"
DESCRIPTION = "groups x prompts sharing a system prompt (lengths are parameters)"
REUSE = True
HF = True
SIZES = {
    "smoke": dict(groups=2, prompts=4, system_tokens=40, question_tokens=10, output_tokens=4),
    "cpu": dict(groups=3, prompts=6, system_tokens=250, question_tokens=30, output_tokens=12),
    "gpu": dict(groups=8, prompts=32, system_tokens=1024, question_tokens=128, output_tokens=64),
}


def instances(tg, groups, prompts, system_tokens, question_tokens, output_tokens):
    out = []
    for _ in range(groups):
        system_prompt = tg.text(system_tokens)
        out += [dict(system_prompt=system_prompt, question=tg.text(question_tokens), output_tokens=output_tokens)
                for _ in range(prompts)]
    tg.rng.shuffle(out)
    return out


@function
def program(s, system_prompt, question, output_tokens):
    s += system_prompt + "\n\nQuestion: " + question + "\nAnswer:"
    s += gen("answer", max_tokens=output_tokens)
