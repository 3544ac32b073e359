"""Request checks shared by the offline Engine and the server's TokenizerManager: a bad request gets a
ValueError naming the problem before it reaches the scheduler."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..sampling_params import SamplingParams


@dataclass
class ModelLimits:
    context_len: int
    max_total_num_tokens: int
    vocab_size: int


# Size bounds on what one request may carry: each keeps a hostile request's cost (tokenizing, compiling,
# per-step sampling work) small before any of it is done.
MAX_PROMPT_CHARS_PER_TOKEN = 64  # a text prompt longer than context_len * this cannot fit: refused untokenized
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_GRAMMAR_CHARS = 100_000  # regex or JSON schema text; compilation itself has a state and time budget
MAX_RID_CHARS = 256
MAX_PROMPTS_PER_REQUEST = 1024  # prompts x n of one HTTP request


def check_sampling_limits(sp: SamplingParams) -> None:
    if not math.isfinite(sp.temperature):
        raise ValueError(f"temperature must be a finite number, got {sp.temperature}")
    stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long")
    if len(sp.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    if len(sp.logit_bias or {}) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    for kind in ("regex", "json_schema", "ebnf"):
        spec = getattr(sp, kind)
        if spec is not None and len(spec) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{kind} is {len(spec)} characters long; at most {MAX_GRAMMAR_CHARS} are accepted")
        if spec is not None:
            check_unicode(spec, kind)


def check_text(text: str, limits: ModelLimits) -> None:
    """Before tokenizing: text that cannot fit the context is refused without the cost of tokenizing it, and
    text that is not valid Unicode (a lone surrogate from a JSON escape) is a client error, not a crash."""
    if len(text) > limits.context_len * MAX_PROMPT_CHARS_PER_TOKEN:
        raise ValueError(f"the prompt has {len(text)} characters, far more than the model's context length "
                         f"({limits.context_len} tokens) can hold")
    check_unicode(text, "the prompt")


def check_unicode(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e.reason} at position {e.start}") from None


def check_rid(rid) -> None:
    if rid is None:
        return
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_CHARS or not rid.isprintable():
        raise ValueError(f"rid must be a printable string of 1 to {MAX_RID_CHARS} characters")


def check_session_id(session_id) -> None:
    if session_id is None:
        return
    if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_RID_CHARS \
            or not session_id.isprintable():
        raise ValueError(f"session_id must be a printable string of 1 to {MAX_RID_CHARS} characters")


def scoped_session_id(owner: str, session_id: str | None) -> str | None:
    """The scheduler's key of a client's session: in its owner's namespace (as request ids are), so another
    credential can neither move nor end it, nor learn that it exists. No owner (in-process, no API key): as is.
    NUL cannot occur in a client's id (check_session_id), so a scoped key never equals an unscoped one."""
    return session_id if not owner or session_id is None else f"{owner}\x00{session_id}"


def parse_sampling_params(params: dict | None, limits: ModelLimits, tokenizer) -> SamplingParams:
    sp = SamplingParams.from_dict(params)
    sp.verify(limits.vocab_size)
    check_sampling_limits(sp)
    for s in [sp.stop] if isinstance(sp.stop, str) else (sp.stop or []):
        check_unicode(s, "a stop string")
    sp.normalize(tokenizer)
    return sp


def check_total_length(input_len: int, params: dict | None, sp: SamplingParams, limits: ModelLimits) -> None:
    """An explicit max_new_tokens that cannot fit after the prompt is an error (as upstream and OpenAI);
    the default is silently bounded by the context instead."""
    if params and params.get("max_new_tokens") is not None and input_len + sp.max_new_tokens > limits.context_len:
        raise ValueError(f"the prompt ({input_len} tokens) plus max_new_tokens ({sp.max_new_tokens}) exceeds the "
                         f"model's context length ({limits.context_len})")


_INT_TYPES = frozenset((int, bool))


def all_ints(ids: list) -> bool:
    """True if every item is a Python int (bool included, as ``isinstance`` has it), checked in C."""
    return set(map(type, ids)) <= _INT_TYPES


def check_input_ids(input_ids: list[int], limits: ModelLimits) -> None:
    if not input_ids:
        raise ValueError("the prompt is empty (0 tokens)")
    n = len(input_ids)
    if n >= limits.context_len:
        raise ValueError(f"the prompt has {n} tokens, but the model's context length is {limits.context_len}; "
                         f"shorten it to at most {limits.context_len - 1} tokens")
    if n + 1 > limits.max_total_num_tokens:
        raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds ({limits.max_total_num_tokens})")
    # C-speed passes for the usual all-valid prompt; the slow passes below only name the bad ids.
    if not all_ints(input_ids):
        bad = next(t for t in input_ids if not isinstance(t, int))
        raise ValueError(f"input_ids must be a list of ints (token ids), not {type(bad).__name__} {bad!r:.40}")
    if min(input_ids) < 0 or max(input_ids) >= limits.vocab_size:
        bad = [t for t in input_ids if not 0 <= t < limits.vocab_size]
        raise ValueError(f"input_ids contain token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")


def check_logprob_args(input_len: int, logprob_start_len: int | None, top_logprobs_num: int | None) -> None:
    if top_logprobs_num is not None and top_logprobs_num < 0:
        raise ValueError("top_logprobs_num must be >= 0")
    if top_logprobs_num is not None and top_logprobs_num > 100:
        raise ValueError("top_logprobs_num must be <= 100")
    if logprob_start_len is not None and logprob_start_len > input_len:
        raise ValueError(f"logprob_start_len {logprob_start_len} is beyond the prompt ({input_len} tokens)")


def check_grammar(sp: SamplingParams, grammar_cache, cancel=None) -> None:
    """Compiles the request's regex / JSON schema / ebnf grammar now (cached; ebnf needs llguidance), so an
    invalid, unsatisfiable, unrealisable or too complex one (past the cache's compile budget) is a clear error
    before any decoding. Setting the ``cancel`` event stops the compilation."""
    for kind in ("regex", "json_schema", "ebnf"):
        spec = getattr(sp, kind)
        if spec is None:
            continue
        try:
            compiled = grammar_cache.compile(kind, spec, cancel=cancel)
        except RecursionError:  # e.g. a schema nested hundreds of levels deep (jsonschema validates recursively)
            raise ValueError(f"{kind} is nested too deeply") from None
        check_grammar_not_banned(sp, kind, compiled, getattr(grammar_cache, "eos_token_ids", ()))


def check_grammar_not_banned(sp: SamplingParams, kind: str, compiled, eos_token_ids) -> None:
    """The first token must be one the grammar allows and the request does not ban: a ``-inf`` logit_bias, or,
    while ``min_new_tokens`` is not reached, ``stop_token_ids`` and EOS (unless ``ignore_eos``). If none is left,
    the request could only be decoded outside its grammar: refuse it now. (Later steps are checked as they are
    sampled: the scheduler ends a request whose grammar-allowed set becomes empty.)"""
    banned = {tid for tid, bias in (sp.logit_bias or {}).items() if bias == -math.inf}
    if sp.min_new_tokens > 0:
        banned |= set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            banned |= set(eos_token_ids)
    matcher_of = getattr(compiled, "matcher", None)
    if not banned or matcher_of is None:
        return
    allowed = matcher_of().allowed_token_ids()
    if not allowed or len(allowed) > len(banned) or not set(allowed) <= banned:
        return
    raise ValueError(f"no token allowed by the grammar ({kind}) is left to generate first: all of "
                     f"{sorted(allowed)[:8]} are banned by logit_bias -inf"
                     f"{' or by stop_token_ids/EOS under min_new_tokens' if sp.min_new_tokens > 0 else ''}")
