"""The peer benchmark's workloads as token ids: sizes (full, or shrunk by ``scale`` for a CPU smoke run), the
seeded prompt builders (``random.Random(seed)``, ids in [3, min(vocab, 32000)), the same on both sides and the
same as the vLLM reference run's), and the check that outputs are well formed.

Nothing here imports torch or an engine: the vLLM child imports it too."""

from __future__ import annotations

import dataclasses
import random
import re
from typing import NamedTuple, Protocol

ID_CEILING = 32000  # ids stay below this whatever the vocabulary (as in the reference run)


class TextOutput(NamedTuple):
    """One constrained output: its text, how many tokens it took, why it ended ("stop" when the grammar did)."""

    text: str
    tokens: int
    finish: str


class Client(Protocol):
    """What a workload needs of an engine; ours and vLLM's implement it."""

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
        """Greedy, ignore_eos: the output ids of each prompt, in order (one batched call)."""

    def generate_regex(self, prompts: list[list[int]], regex: str, max_tokens: int) -> list[TextOutput]:
        """Greedy, each output constrained by ``regex`` and ended by it (EOS once the regex is complete), at most
        ``max_tokens`` tokens (one batched call)."""

    def prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        """The logprob of each token of prompt i from position starts[i] (>= 1) on, given the tokens before it.
        An engine that can start there may reuse the cached KV of what comes before (our ``select`` does); one
        that cannot computes the whole prompt and drops the head (vLLM's ``prompt_logprobs``)."""

    def reset(self) -> None:
        """Empty the prefix cache."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big the run is: ``scale`` 1 is the GPU run; smaller shrinks every length and count (never below a
    floor that keeps the formulas meaningful)."""

    scale: float = 1.0
    repeats: int = 3  # timed repeats of the decode sections (median)
    prefill_repeats: int = 5  # timed calls of cold_prefill (median)
    program_repeats: int = 3  # timed passes of shared_prefix and of each LM program (median: one pass is noisy)

    def n(self, full: int, minimum: int = 1) -> int:
        return max(minimum, round(full * self.scale))


FULL = Sizes()
SMOKE = Sizes(scale=1 / 32, repeats=1, prefill_repeats=2, program_repeats=1)


def id_range(vocab: int) -> tuple[int, int]:
    return 3, min(vocab, ID_CEILING)


def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo, hi = id_range(vocab)
    return [rng.randrange(lo, hi) for _ in range(n)]


def random_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rand_ids(rng, length, vocab) for _ in range(count)]


def shared_prefix_prompts(seed: int, count: int, prefix: int, unique: int, vocab: int) -> list[list[int]]:
    """``count`` prompts = one ``prefix``-token prefix + ``unique`` tokens each (the reference's order of draws)."""
    rng = random.Random(seed)
    shared = rand_ids(rng, prefix, vocab)
    return [shared + rand_ids(rng, unique, vocab) for _ in range(count)]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One section's shape: ``count`` prompts of ``prompt_len`` tokens (``unique`` more behind a shared prefix
    of ``prompt_len`` when set), ``output_len`` tokens out; seeds of the timed and the warm-up prompts."""

    count: int
    prompt_len: int
    output_len: int
    seed: int
    warm_seed: int
    unique: int = 0

    def prompts(self, vocab: int, warm: bool = False) -> list[list[int]]:
        seed = self.warm_seed if warm else self.seed
        if self.unique:
            return shared_prefix_prompts(seed, self.count, self.prompt_len, self.unique, vocab)
        return random_prompts(seed, self.count, self.prompt_len, vocab)


def specs(sz: Sizes) -> dict[str, Spec]:
    """The timed sections' shapes at size ``sz``."""
    return {
        "offline": Spec(sz.n(56), sz.n(1024, 8), sz.n(1024, 2), seed=0, warm_seed=1000),
        "shared_prefix": Spec(sz.n(128, 2), sz.n(1024, 8), sz.n(32, 2), seed=1, warm_seed=2000, unique=sz.n(64, 2)),
        "decode_bs1": Spec(1, sz.n(1024, 8), sz.n(256, 3), seed=3, warm_seed=503),
        "decode_bs64": Spec(sz.n(64, 2), sz.n(1024, 8), sz.n(256, 3), seed=4, warm_seed=504),
        "cold_prefill": Spec(sz.n(8), sz.n(1024, 8), 1, seed=5, warm_seed=505),
    }


def offline_warmup_tokens(sz: Sizes) -> int:
    """Output tokens of the offline section's warm-up (same prompt shape, fewer tokens, as in the reference)."""
    return min(specs(sz)["offline"].output_len, sz.n(64, 2))


def outputs_ok(outputs: list[list[int]], count: int, max_tokens: int | list[int], vocab: int) -> bool:
    """``count`` outputs, each exactly its ``max_tokens`` long (ignore_eos), every id in [0, vocab)."""
    wanted = max_tokens if isinstance(max_tokens, list) else [max_tokens] * count
    if len(outputs) != count or len(wanted) != count:
        return False
    return all(len(o) == w and all(isinstance(t, int) and 0 <= t < vocab for t in o)
               for o, w in zip(outputs, wanted))


def regex_outputs_ok(outputs: list[TextOutput], count: int, regex: str) -> bool:
    """``count`` outputs, each a full match of ``regex`` that the grammar ended (not the length limit)."""
    pattern = re.compile(regex)
    return len(outputs) == count and all(o.finish == "stop" and o.tokens > 0 and pattern.fullmatch(o.text)
                                         for o in outputs)


def logprobs_ok(values: list[list[float]], prompts: list[list[int]], starts: list[int]) -> bool:
    """One entry per prompt token from its start on, each finite and <= 0 (log-probabilities)."""
    if len(values) != len(prompts):
        return False
    for row, prompt, start in zip(values, prompts, starts):
        if len(row) != len(prompt) - start:
            return False
        if not all(isinstance(v, float) and -1e30 < v <= 1e-3 for v in row):
            return False
    return True
