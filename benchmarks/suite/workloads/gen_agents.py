"""Generative-agents-style calls: each agent has a persona and a memory stream that grows with every event;
each call asks a different question over persona + memory (the question is not kept in the memory)."""

from sglang_backend.lang.api import function, gen

NAME = "gen_agents"
DESCRIPTION = "agent persona + growing memory stream, one side call per event"
REUSE = True
HF = True
SIZES = {
    "smoke": dict(agents=3, persona_tokens=40, events=3, event_tokens=10, query_tokens=8, reaction_tokens=4),
    "cpu": dict(agents=4, persona_tokens=200, events=4, event_tokens=20, query_tokens=16, reaction_tokens=8),
    "gpu": dict(agents=32, persona_tokens=600, events=6, event_tokens=40, query_tokens=30, reaction_tokens=24),
}


def instances(tg, agents, persona_tokens, events, event_tokens, query_tokens, reaction_tokens):
    out = []
    for a in range(agents):
        persona = f"Name: Agent {a}\nInnate traits: {tg.text(8)}\nBackground: {tg.text(persona_tokens)}\nMemory:\n"
        out.append(dict(persona=persona, reaction_tokens=reaction_tokens,
                        events=[(tg.text(event_tokens), tg.text(query_tokens) + "?") for _ in range(events)]))
    return out


@function
def program(s, persona, events, reaction_tokens):
    s += persona
    for i, (event, query) in enumerate(events):
        s += f"[{i}] {event}\n"
        group = s.fork(1)
        group[0] += f"Question: {query}\nAnswer:" + gen(f"reaction_{i}", max_tokens=reaction_tokens)
        reaction = group[0][f"reaction_{i}"].strip()
        group.join()
        s += f"Reaction: {reaction}\n"
