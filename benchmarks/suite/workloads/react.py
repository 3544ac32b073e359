"""ReAct-style agent trace replay: a long shared instruction + few-shot prefix, then a trajectory that grows
by one generated thought and one replayed action/observation per step."""

from sglang_backend.lang.api import function, gen

NAME = "react"
DESCRIPTION = "agent trace replay: long shared prefix, growing thought/action/observation trajectory"
REUSE = True
HF = True
SIZES = {
    "smoke": dict(n=3, prefix_tokens=60, question_tokens=12, steps=2, thought_tokens=4, observation_tokens=10),
    "cpu": dict(n=6, prefix_tokens=400, question_tokens=24, steps=3, thought_tokens=12, observation_tokens=30),
    "gpu": dict(n=48, prefix_tokens=1500, question_tokens=40, steps=5, thought_tokens=32, observation_tokens=60),
}


def instances(tg, n, prefix_tokens, question_tokens, steps, thought_tokens, observation_tokens):
    prefix = ("Solve a question answering task with interleaving Thought, Action, Observation steps.\n"
              f"Here are some examples.\n{tg.text(prefix_tokens)}\n\n")
    return [dict(prefix=prefix, question=tg.text(question_tokens), thought_tokens=thought_tokens,
                 steps=[(tg.text(2), tg.text(observation_tokens)) for _ in range(steps)]) for _ in range(n)]


@function
def program(s, prefix, question, thought_tokens, steps):
    s += prefix + "Question: " + question + "\n"
    for i, (entity, observation) in enumerate(steps, 1):
        s += f"Thought {i}:" + gen(f"thought_{i}", max_tokens=thought_tokens)
        s += f"\nAction {i}: Search[{entity}]\nObservation {i}: {observation}\n"
