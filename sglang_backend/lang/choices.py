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


def choice_entries(entries: list, prefix_tokens: list, start: int, key) -> list:
    """One choice's scored entries after the prefix, for ``select``: ``entries[k]`` scores the token at position
    ``start + k`` of prefix + choice (scoring starts a little before the prefix's end: its last token may fuse with
    the choice's first characters, and then it belongs to the choice). The entries whose token (``key(entry)``: an
    id, or a text where the API sends texts) still equals the prefix's are skipped, unscored ones dropped."""
    k = 0
    while k < len(entries) and start + k < len(prefix_tokens) and key(entries[k]) == prefix_tokens[start + k]:
        k += 1
    return [e for e in entries[k:] if e[0] is not None]


def decide(choices_method: ChoicesSamplingMethod, choices: list[str], input_token_logprobs: list,
           output_token_logprobs: list, unconditional_token_logprobs: list | None) -> ChoicesDecision:
    """``choices_method``'s decision over each choice's scored entries (their token-length normalized logprob
    computed here)."""
    normalized = [normalized_logprob(e) for e in input_token_logprobs]
    return choices_method(choices=choices, normalized_prompt_logprobs=normalized,
                          input_token_logprobs=input_token_logprobs, output_token_logprobs=output_token_logprobs,
                          unconditional_token_logprobs=unconditional_token_logprobs)


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
