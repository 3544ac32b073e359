"""Request checks shared by the offline Engine and the server's TokenizerManager: a bad request gets a
ValueError naming the problem before it reaches the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling_params import SamplingParams


@dataclass
class ModelLimits:
    context_len: int
    max_total_num_tokens: int
    vocab_size: int


def parse_sampling_params(params: dict | None, limits: ModelLimits, tokenizer) -> SamplingParams:
    sp = SamplingParams.from_dict(params)
    sp.verify(limits.vocab_size)
    sp.normalize(tokenizer)
    return sp


def check_total_length(input_len: int, params: dict | None, sp: SamplingParams, limits: ModelLimits) -> None:
    """An explicit max_new_tokens that cannot fit after the prompt is an error (as upstream and OpenAI);
    the default is silently bounded by the context instead."""
    if params and params.get("max_new_tokens") is not None and input_len + sp.max_new_tokens > limits.context_len:
        raise ValueError(f"the prompt ({input_len} tokens) plus max_new_tokens ({sp.max_new_tokens}) exceeds the "
                         f"model's context length ({limits.context_len})")


def check_input_ids(input_ids: list[int], limits: ModelLimits) -> None:
    if not input_ids:
        raise ValueError("the prompt is empty (0 tokens)")
    n = len(input_ids)
    if n >= limits.context_len:
        raise ValueError(f"the prompt has {n} tokens, but the model's context length is {limits.context_len}; "
                         f"shorten it to at most {limits.context_len - 1} tokens")
    if n + 1 > limits.max_total_num_tokens:
        raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds ({limits.max_total_num_tokens})")
    bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"input_ids contain token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")


def check_logprob_args(input_len: int, logprob_start_len: int | None, top_logprobs_num: int | None) -> None:
    if top_logprobs_num is not None and top_logprobs_num < 0:
        raise ValueError("top_logprobs_num must be >= 0")
    if top_logprobs_num is not None and top_logprobs_num > 100:
        raise ValueError("top_logprobs_num must be <= 100")
    if logprob_start_len is not None and logprob_start_len > input_len:
        raise ValueError(f"logprob_start_len {logprob_start_len} is beyond the prompt ({input_len} tokens)")


def check_grammar(sp: SamplingParams, grammar_cache) -> None:
    """Compiles the request's regex / JSON schema now (cached), so an invalid, unsatisfiable or
    unrealisable one is a clear error before any decoding."""
    for kind in ("regex", "json_schema", "ebnf"):
        spec = getattr(sp, kind)
        if spec is None:
            continue
        if kind == "ebnf":
            raise ValueError("EBNF grammars are not supported (use regex or json_schema)")
        grammar_cache.compile(kind, spec)
