"""Multi-turn chat, shared by multi_turn_short and multi_turn_long: four turns, each a fresh user message;
every turn's prompt is the whole history, so the previous turns (and answers) are reusable."""

from sglang_backend.lang.api import assistant, function, gen, user

REUSE = True
HF = True


def instances(tg, n, turns, user_tokens, output_tokens):
    return [dict(messages=[tg.between(*user_tokens) for _ in range(turns)],
                 output_lens=[tg.randint(*output_tokens) for _ in range(turns)]) for _ in range(n)]


@function
def program(s, messages, output_lens):
    for i, (message, n) in enumerate(zip(messages, output_lens)):
        s += user(message)
        s += assistant(gen(f"answer_{i}", max_tokens=n))
