"""Tree-of-thought: four levels, every state forks into two thoughts (2 + 4 + 8 + 16 generation calls)."""

from sglang_backend.lang.api import function, gen

NAME = "tree_of_thought"
DESCRIPTION = "4 levels x fork(2): 30 thoughts per problem"
REUSE = True
HF = True
SIZES = {
    "smoke": dict(n=2, question_tokens=16, thought_tokens=3, levels=4),
    "cpu": dict(n=2, question_tokens=60, thought_tokens=8, levels=4),
    "gpu": dict(n=16, question_tokens=120, thought_tokens=32, levels=4),
}


def instances(tg, n, question_tokens, thought_tokens, levels):
    return [dict(question=tg.text(question_tokens), thought_tokens=thought_tokens, levels=levels) for _ in range(n)]


@function
def program(s, question, thought_tokens, levels):
    s += "Solve the math problem step by step, exploring alternatives.\nQuestion: " + question + "\n"
    states, groups = [s], []
    for level in range(1, levels + 1):
        nxt = []
        for state in states:
            group = state.fork(2)
            groups.append(group)
            for branch in group:
                branch += f"Step {level}:" + gen(f"step_{level}", max_tokens=thought_tokens) + "\n"
                nxt.append(branch)
        states = nxt
    for group in reversed(groups):  # leaves first; join ends every branch's executor
        group.join()
