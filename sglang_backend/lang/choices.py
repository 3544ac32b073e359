"""How ``select`` picks among choices from the prompt logprobs of ``prefix + choice`` (same names as
upstream SGLang: ``token_length_normalized``, ``greedy_token_selection``,
``unconditional_likelihood_normalized``).

Each method receives, per choice, the (logprob, token_id, text) entries of the tokens that belong to the
choice — starting at the first token where ``prefix + choice`` tokenizes differently from ``prefix`` alone,
so a boundary token that fused the prefix's last characters with the choice's first is scored too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


class ChoicesSamplingMethod:
    requires_unconditional_logprobs = False

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        raise NotImplementedError


def normalized_logprob(entries: list) -> float:
    """Mean logprob over the choice's tokens (entries without a logprob are skipped)."""
    values = [e[0] for e in entries if e[0] is not None]
    return float(sum(values) / len(values)) if values else float("-inf")


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = int(np.argmax(normalized_prompt_logprobs))
        return ChoicesDecision(choices[best], {"normalized_prompt_logprobs": normalized_prompt_logprobs,
                                               "input_token_logprobs": input_token_logprobs,
                                               "output_token_logprobs": output_token_logprobs})


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the choices whose next token has the highest logprob, until one is left.
    Shorter choices are padded with their own mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(o) for o in input_token_logprobs)
        matrix = np.zeros((len(choices), width))
        for i, option in enumerate(input_token_logprobs):
            values = [e[0] for e in option]
            matrix[i, : len(values)] = values
            matrix[i, len(values):] = np.mean(values) if values else -np.inf
        remaining = np.arange(len(choices))
        for j in range(width):
            column = matrix[remaining, j]
            remaining = remaining[column == column.max()]
            if len(remaining) == 1:
                break
        best = int(remaining[0])
        return ChoicesDecision(choices[best], {"normalized_prompt_logprobs": normalized_prompt_logprobs,
                                               "input_token_logprobs": input_token_logprobs,
                                               "output_token_logprobs": output_token_logprobs,
                                               "greedy_logprob_matrix": matrix.tolist()})


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain most from the context: mean of logp(token | context) −
    logp(token | choice alone). A choice's first token has no unconditional logprob (nothing precedes
    it), so it counts with an unconditional logprob of 0."""

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional token logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            c = np.array([e[0] for e in cond], dtype=float)
            u = np.array([0.0 if e[0] is None else e[0] for e in uncond], dtype=float)
            scores.append(float(np.mean(c - u)) if len(c) else float("-inf"))
        best = int(np.argmax(scores))
        return ChoicesDecision(choices[best], {"normalized_prompt_logprobs": normalized_prompt_logprobs,
                                               "input_token_logprobs": input_token_logprobs,
                                               "output_token_logprobs": output_token_logprobs,
                                               "unconditional_token_logprobs": unconditional_token_logprobs,
                                               "normalized_unconditional_prompt_logprobs": scores})


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
