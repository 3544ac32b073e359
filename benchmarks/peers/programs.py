"""The paper's LM programs written as a vLLM user writes them: plain request streams, each step's requests for
all instances in one batched ``generate`` call, greedy with ignore_eos. Token level (dummy weights, so the
content is random ids): what is measured is the request structure and its sizes, which follow the paper's.

Each program is ``run(client, vocab, scale, seed=0) -> dict`` timed from an empty prefix cache; every output
is checked to be well formed (length, id range; JSON decoding: the text matches its regex and the grammar ended
it) and the result says whether all were. JSON decoding needs a tokenizer (each side's engine takes the run's
``--tokenizer``). DSPy RAG is the request stream DSPy's ChatAdapter sends (its layout and sizes, measured with
real DSPy), not DSPy itself: the GPU machine has no DSPy, and dummy weights could not fill its output fields."""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable

from benchmarks.bench_json_decode import REGEX as JSON_REGEX
from benchmarks.peers.workloads import Client, logprobs_ok, outputs_ok, rand_ids, regex_outputs_ok

JSON_MAX_TOKENS = 256  # far above what the regex can take with any tokenizer: the grammar ends every output


@dataclasses.dataclass
class Tally:
    """A program's calls through ``client``: counts requests and tokens and checks every output."""

    client: Client
    vocab: int
    requests: int = 0
    calls: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    well_formed: bool = True

    def _count_call(self, prompts: list[list[int]]) -> None:
        self.calls += 1
        self.requests += len(prompts)
        self.prompt_tokens += sum(map(len, prompts))

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
        outs = self.client.generate(prompts, max_tokens)
        self._count_call(prompts)
        self.output_tokens += sum(map(len, outs))
        self.well_formed = self.well_formed and outputs_ok(outs, len(prompts), max_tokens, self.vocab)
        return outs

    def generate_regex(self, prompts: list[list[int]], regex: str, max_tokens: int) -> list[str]:
        outs = self.client.generate_regex(prompts, regex, max_tokens)
        self._count_call(prompts)
        self.output_tokens += sum(o.tokens for o in outs)
        self.well_formed = self.well_formed and regex_outputs_ok(outs, len(prompts), regex)
        return [o.text for o in outs]

    def prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        values = self.client.prompt_logprobs(prompts, starts)
        self._count_call(prompts)
        self.well_formed = self.well_formed and logprobs_ok(values, prompts, starts)
        return values


def scaled(n: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(n * scale))


def timed_program(body: Callable[[Tally, random.Random, int, float], int]) -> Callable:
    """``body(tally, rng, vocab, scale) -> number of program instances`` as a program: the cache emptied, the
    body timed."""

    def run(client: Client, vocab: int, scale: float, seed: int = 0) -> dict:
        tally = Tally(client, vocab)
        rng = random.Random(f"{body.__name__}:{seed}:{scale}")
        client.reset()
        t0 = time.perf_counter()
        instances = body(tally, rng, vocab, scale)
        seconds = time.perf_counter() - t0
        out = dict(programs=instances, requests=tally.requests, calls=tally.calls,
                   prompt_tokens=tally.prompt_tokens, output_tokens=tally.output_tokens, seconds=seconds,
                   programs_per_s=instances / seconds, well_formed=tally.well_formed)
        if getattr(client, "extra", None):  # what the client counted of its engine (ours: forwards, jumps)
            out["engine"] = dict(client.extra)
        return out

    run.__name__ = body.__name__
    run.__doc__ = body.__doc__
    return run


@timed_program
def mmlu(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """MMLU 5-shot: one ~600-token 5-shot header shared by N questions (60-100 tokens), 1 output token."""
    header = rand_ids(rng, scaled(600, scale, 8), vocab)
    n = scaled(128, scale, 2)
    prompts = [header + rand_ids(rng, scaled(rng.randint(60, 100), scale, 2), vocab) for _ in range(n)]
    tally.generate(prompts, 1)
    return n


@timed_program
def hellaswag(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """HellaSwag: a ~400-token few-shot header, per question a 48-token context and 4 endings (16-32 tokens),
    each ending scored by its tokens' logprobs after header + context; the best sum is the choice."""
    header = rand_ids(rng, scaled(400, scale, 8), vocab)
    n = scaled(32, scale, 2)
    prompts, starts = [], []
    for _ in range(n):
        context = header + rand_ids(rng, scaled(48, scale, 2), vocab)
        for _ in range(4):
            ending = rand_ids(rng, scaled(rng.randint(16, 32), scale, 2), vocab)
            prompts.append(context + ending)
            starts.append(len(context))
    scores = [sum(row) for row in tally.prompt_logprobs(prompts, starts)]
    choices = [max(range(4), key=lambda j, i=i: scores[4 * i + j]) for i in range(n)]
    assert len(choices) == n
    return n


@timed_program
def react(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """ReAct trace replay: N agents behind one ~800-token instruction + examples prefix, each with a 40-token
    question; K steps, a step's prompt = the previous prompt + its output + a new 40-token observation;
    30 output tokens per step; one call per step for all agents."""
    prefix = rand_ids(rng, scaled(800, scale, 8), vocab)
    n, steps, out_len = scaled(16, scale, 2), 5, scaled(30, scale, 2)
    prompts = [prefix + rand_ids(rng, scaled(40, scale, 2), vocab) for _ in range(n)]
    agent_steps(tally, rng, vocab, prompts, steps, out_len, scaled(40, scale, 2))
    return n


def agent_steps(tally: Tally, rng: random.Random, vocab: int, prompts: list[list[int]], steps: int, out_len: int,
                observation: int, between: Callable[[], object] | None = None) -> None:
    """Agent steps, one call each for all agents: a step's prompt = the previous prompt + its output + a fresh
    ``observation``-token tool observation; ``between()`` runs after each step's call."""
    for step in range(steps):
        if step:
            prompts = [p + o + rand_ids(rng, observation, vocab) for p, o in zip(prompts, outs)]
        outs = tally.generate(prompts, out_len)
        if between is not None:
            between()


@timed_program
def tree_of_thought(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """Tree of thought: Q questions (a shared 200-token instruction + a 100-token question); 3 levels of
    branching factor 3, a child's prompt = its parent's prompt + the parent's output + an 8-token branch tag
    (so siblings differ under greedy decoding); 32 output tokens per node; one call per level."""
    instruction = rand_ids(rng, scaled(200, scale, 8), vocab)
    q, out_len = scaled(8, scale, 2), scaled(32, scale, 2)
    frontier = [(instruction + rand_ids(rng, scaled(100, scale, 2), vocab), []) for _ in range(q)]
    for _level in range(3):
        prompts = [p + o + rand_ids(rng, 8, vocab) for p, o in frontier for _ in range(3)]
        outs = tally.generate(prompts, out_len)
        frontier = list(zip(prompts, outs))
    return q


@timed_program
def skeleton_of_thought(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """Skeleton of thought: Q questions (a shared 200-token instruction + 60-token question), one skeleton
    call (48 tokens out), then P=5 point expansions whose prompts = skeleton prompt + skeleton + a 12-token
    point request (64 tokens out), all in one call."""
    instruction = rand_ids(rng, scaled(200, scale, 8), vocab)
    q, points = scaled(16, scale, 2), 5
    skeleton_prompts = [instruction + rand_ids(rng, scaled(60, scale, 2), vocab) for _ in range(q)]
    skeletons = tally.generate(skeleton_prompts, scaled(48, scale, 2))
    expansions = [p + s + rand_ids(rng, scaled(12, scale, 2), vocab)
                  for p, s in zip(skeleton_prompts, skeletons) for _ in range(points)]
    tally.generate(expansions, scaled(64, scale, 2))
    return q


@timed_program
def multi_turn_chat(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """Multi-turn chat: N conversations behind one 200-token system prompt, 4 turns; a turn's prompt = the
    history + a new 60-token user message, 64 tokens out; one call per turn for all conversations."""
    system = rand_ids(rng, scaled(200, scale, 8), vocab)
    n, out_len = scaled(32, scale, 2), scaled(64, scale, 2)
    histories = [list(system) for _ in range(n)]
    for _turn in range(4):
        prompts = [h + rand_ids(rng, scaled(60, scale, 2), vocab) for h in histories]
        outs = tally.generate(prompts, out_len)
        histories = [p + o for p, o in zip(prompts, outs)]
    return n


@timed_program
def json_decoding(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """JSON decoding (the paper's): N documents behind one 300-token extraction instruction (with its examples),
    each a 400-token document; greedy output constrained by ``bench_json_decode.REGEX`` (constant keys; name,
    country and landmark as bounded strings of letters, capital a boolean) and ended by the grammar, not by a
    length. One call for all documents. Our engine jumps over the constant parts (compressed FSM); vLLM decodes
    each of their tokens under its structured outputs."""
    header = rand_ids(rng, scaled(300, scale, 8), vocab)
    n = scaled(64, scale, 2)
    prompts = [header + rand_ids(rng, scaled(400, scale, 8), vocab) for _ in range(n)]
    tally.generate_regex(prompts, JSON_REGEX, JSON_MAX_TOKENS)
    return n


@timed_program
def dspy_rag(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """DSPy RAG (the paper's DSPy example: retrieve, then ``dspy.ChainOfThought("context, question -> answer")``),
    as ``dspy.LM("openai/...")`` sends it through DSPy's ChatAdapter: a 150-token system message (the fields and
    their format), 4 demos as user/assistant turns (a user turn = 3 numbered passages of 120 tokens + a 24-token
    question + field markers, 220 tokens with SmolLM2's tokenizer in dspy 3.4.1; an assistant turn = reasoning and
    answer, 36-64 tokens), then per question its 3 retrieved passages, the question and the 45-token "Respond
    with the corresponding output fields..." tail; 96 tokens out (reasoning + answer). 64 questions over a
    200-passage corpus (so some share their first passage, as real retrieval does), one call for all."""
    def turn(n: int) -> list[int]:  # a chat-template role marker + content
        return role + rand_ids(rng, scaled(n, scale, 2), vocab)

    role = rand_ids(rng, 4, vocab)
    corpus = [rand_ids(rng, scaled(120, scale, 4), vocab) for _ in range(200)]
    markers = [rand_ids(rng, 3, vocab) for _ in range(3)]  # "[1] «", "[2] «", "[3] «"

    def user(passages: list[list[int]], tail: int) -> list[int]:
        body = [t for marker, passage in zip(markers, passages) for t in marker + passage]
        return turn(8) + body + rand_ids(rng, scaled(24 + tail, scale, 2), vocab)

    header = turn(150)
    for _ in range(4):
        header += user(rng.sample(corpus, 3), 16) + turn(rng.randint(36, 64))
    n = scaled(64, scale, 2)
    prompts = [header + user(rng.sample(corpus, 3), 45) + role for _ in range(n)]
    tally.generate(prompts, scaled(96, scale, 2))
    return n


def histories_under_pressure(tally: Tally, rng: random.Random, vocab: int, scale: float, shared: int, own: int,
                             out_len: int, added: int) -> int:
    """32 histories behind one ``shared``-token prompt, each opened with its own ``own`` tokens; 6 steps, a step's
    prompt = the previous prompt + its output (``out_len`` tokens) + ``added`` new tokens; between steps 8 other
    users' one-shot 1500-token prompts (1 output token). One call per step for all histories."""
    system = rand_ids(rng, scaled(shared, scale, 8), vocab)
    n = scaled(32, scale, 2)
    prompts = [system + rand_ids(rng, scaled(own, scale, 8), vocab) for _ in range(n)]

    def other_users():
        tally.generate([rand_ids(rng, scaled(1500, scale, 8), vocab) for _ in range(scaled(8, scale, 1))], 1)

    agent_steps(tally, rng, vocab, prompts, 6, scaled(out_len, scale, 2), scaled(added, scale, 2), other_users)
    return n


@timed_program
def agents_under_pressure(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """Agents whose histories outgrow the KV pool (issue 26): N agents behind one 1000-token system + tools prompt,
    each with its own 2000-token task and retrieved documents; 6 steps, a step's prompt = the previous prompt +
    its output + a 60-token tool observation, 32 output tokens; between steps 8 other users' one-shot 1500-token
    prompts (1 output token). One call per step for all agents. Meant to run with a pool far smaller than the
    agents' ~85k tokens (``max_total_tokens`` / ``num_gpu_blocks_override``): an engine that keeps only a prefix
    cache computes most of every history again at every step."""
    return histories_under_pressure(tally, rng, vocab, scale, shared=1000, own=2000, out_len=32, added=60)


@timed_program
def chat_under_pressure(tally: Tally, rng: random.Random, vocab: int, scale: float) -> int:
    """Chat sessions whose histories outgrow the KV pool (issue 26): N conversations behind one 300-token system
    prompt, each opened with its own 1500-token pasted document; 6 turns, a turn's prompt = the previous prompt +
    its reply + an 80-token user message, 96 reply tokens; between turns 8 other users' one-shot 1500-token prompts
    (1 output token). One call per turn for all conversations; meant for a pool far smaller than the ~70k tokens of
    the histories, as ``agents_under_pressure``."""
    return histories_under_pressure(tally, rng, vocab, scale, shared=300, own=1500, out_len=96, added=80)


PROGRAMS: dict[str, Callable] = {
    "mmlu": mmlu,
    "hellaswag": hellaswag,
    "react": react,
    "tree_of_thought": tree_of_thought,
    "skeleton_of_thought": skeleton_of_thought,
    "multi_turn_chat": multi_turn_chat,
    "json_decoding": json_decoding,
    "dspy_rag": dspy_rag,
}
# Programs that need a small KV pool to mean anything: sections, but in no group (run them by name, with the pool
# sizes set on both sides).
PRESSURE_PROGRAMS: dict[str, Callable] = {"agents_under_pressure": agents_under_pressure,
                                           "chat_under_pressure": chat_under_pressure}
# Programs of the paper not run here, and why.
NOT_COVERED: dict[str, str] = {}
