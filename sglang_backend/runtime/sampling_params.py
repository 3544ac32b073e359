"""Per-request sampling parameters (names and defaults follow upstream SGLang's ``SamplingParams``).

Life cycle of one request's params:

1. ``SamplingParams.from_dict(d)``: built from the JSON of ``/generate`` (``sampling_params``) or from the
   OpenAI layer. Unknown keys and wrong types are rejected here, with the field named.
2. ``verify(vocab_size)``: range checks, one clear ``ValueError`` per problem.
3. ``normalize(tokenizer)``: canonical forms used by the scheduler/detokenizer: ``stop`` is a list of
   strings, ``stop_token_ids`` a set, and ``stop_str_max_len`` bounds how many trailing tokens the
   detokenizer must re-decode to see a stop string that straddles token boundaries.

Greedy decoding is ``temperature == 0`` (anything below ``_GREEDY_EPS``) or ``top_k == 1``; see
``is_greedy``. The temperature itself is left as given so ``to_dict`` round-trips.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

_GREEDY_EPS = 1e-6
# Smallest accepted repetition_penalty: seen logits are divided by it, so it bounds their growth (x100) and keeps
# every penalised logit finite in float32.
MIN_REPETITION_PENALTY = 0.01
# Extra tokens added to the longest stop string's token count: a stop string inside generated text can
# tokenize into more pieces than it does on its own (merges with the neighbouring characters).
_STOP_STR_SLACK = 2
# Accepted spellings from upstream clients, mapped to our field names.
_ALIASES = {"sampling_seed": "seed"}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off (whole vocabulary)
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | set[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        # Filled by normalize(); not a constructor argument so from_dict/to_dict never see it.
        self.stop_str_max_len: int = 0

    # ------------------------------------------------------------------ construction

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a JSON-like dict. ``None`` values mean "use the default" (JSON clients send null)."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be a dict, got {type(d).__name__}")
        valid = cls.field_names()
        d = {_ALIASES.get(k, k): v for k, v in d.items()}
        unknown = sorted(str(k) for k in d if k not in valid)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; valid parameters are: {', '.join(valid)}"
            )
        kwargs = {}
        for name, value in d.items():
            if value is None:
                continue
            kwargs[name] = _coerce(name, value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(out["stop"], list):
            out["stop"] = list(out["stop"])
        if isinstance(out["stop_token_ids"], set):  # normalized form -> JSON-friendly list
            out["stop_token_ids"] = sorted(out["stop_token_ids"])
        elif out["stop_token_ids"] is not None:
            out["stop_token_ids"] = list(out["stop_token_ids"])
        if out["logit_bias"] is not None:
            out["logit_bias"] = dict(out["logit_bias"])
        return out

    # ------------------------------------------------------------------ checks

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        if self.max_new_tokens < 0:
            # 0 is allowed: a prefill-only request (e.g. a frontend hint that caches a shared prefix).
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:
            # vLLM asks for > 0; a value near 0 makes ``logit / penalty`` overflow float32 (inf, then NaN next to
            # the -inf of masked tokens), so anything below MIN_REPETITION_PENALTY is refused.
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], "
                             f"got {self.repetition_penalty}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if vocab_size is not None:
            for tid in self.stop_token_ids or ():
                if not 0 <= tid < vocab_size:
                    raise ValueError(f"stop_token_ids: token id {tid} is outside the vocabulary [0, {vocab_size})")
            for tid in self.logit_bias or {}:
                if not 0 <= tid < vocab_size:
                    raise ValueError(f"logit_bias: token id {tid} is outside the vocabulary [0, {vocab_size})")
        for tid, bias in (self.logit_bias or {}).items():
            # OpenAI's range; -inf is a legal "ban this token". Larger values overflow once divided by a
            # temperature below 1.
            if bias != -math.inf and not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: bias for token {tid} must be in [-100, 100] or -inf, got {bias}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        constraints = [name for name in ("regex", "json_schema", "ebnf") if getattr(self, name) is not None]
        if len(constraints) > 1:
            raise ValueError(f"only one of regex, json_schema, ebnf may be set; got {', '.join(constraints)}")

    def normalize(self, tokenizer: Any = None) -> None:
        """Canonicalise stop conditions. Idempotent. ``tokenizer`` may be None (then a byte-count bound)."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = set(self.stop_token_ids or ())

        max_len = 0
        for s in self.stop:
            if tokenizer is not None:
                n_tokens = len(tokenizer.encode(s, add_special_tokens=False))
            else:
                n_tokens = len(s.encode("utf-8"))  # every token covers at least one byte
            max_len = max(max_len, n_tokens)
        self.stop_str_max_len = max_len + _STOP_STR_SLACK if self.stop else 0


# ---------------------------------------------------------------------- type coercion for from_dict

_INT_FIELDS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "seed"}
_FLOAT_FIELDS = {
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_STR_FIELDS = {"regex", "ebnf"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _coerce(name: str, v: Any) -> Any:
    def bad(expected: str) -> ValueError:
        return ValueError(f"sampling parameter {name!r} must be {expected}, got {type(v).__name__} {v!r}")

    if name in _INT_FIELDS:
        if _is_int(v):
            return v
        if isinstance(v, float) and v.is_integer():  # JSON clients sometimes send 16.0
            return int(v)
        raise bad("an integer")
    if name in _FLOAT_FIELDS:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        raise bad("a number")
    if name in _BOOL_FIELDS:
        if isinstance(v, bool):
            return v
        raise bad("a boolean")
    if name in _STR_FIELDS:
        if isinstance(v, str):
            return v
        raise bad("a string")
    if name == "json_schema":
        if isinstance(v, str):
            return v
        if isinstance(v, dict):  # accept an already-parsed schema
            return json.dumps(v)
        raise bad("a JSON string or object")
    if name == "stop":
        if isinstance(v, str):
            return v
        if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
            return list(v)
        raise bad("a string or a list of strings")
    if name == "stop_token_ids":
        if isinstance(v, (list, tuple, set)) and all(_is_int(t) for t in v):
            return list(v)
        raise bad("a list of integers")
    if name == "logit_bias":
        if not isinstance(v, dict):
            raise bad("a dict of token id -> bias")
        out: dict[int, float] = {}
        for k, b in v.items():
            # JSON object keys are strings (OpenAI sends {"50256": -100}).
            if _is_int(k):
                tid = k
            elif isinstance(k, str) and k.strip().lstrip("-").isdigit():
                tid = int(k)
            else:
                raise ValueError(f"sampling parameter 'logit_bias': key {k!r} is not a token id")
            if isinstance(b, bool) or not isinstance(b, (int, float)):
                raise ValueError(f"sampling parameter 'logit_bias': bias for token {k!r} must be a number")
            out[tid] = float(b)
        return out
    raise AssertionError(f"no coercion rule for field {name}")  # pragma: no cover


def sample_count(params: dict | None) -> int:
    """The ``n`` of a prompt's sampling params (parallel sampling; 1 when absent). Raises ValueError for an ``n``
    that is not an integer >= 1 (an integral float such as 2.0 is one, as for the other integer parameters)."""
    n = (params or {}).get("n")
    n = 1 if n is None else _coerce("n", n)
    if n < 1:
        raise ValueError(f"sampling parameter 'n' must be >= 1, got {n}")
    return n


def parallel_samples(params: dict | None) -> list[dict]:
    """Parallel sampling (upstream's ``n``): the sampling params of each of a prompt's ``n`` samples, without ``n``.
    With a seed, sample i uses seed + i (mod 2**64): the samples differ, stay reproducible, and sample 0 is what
    ``n=1`` gives; unseeded (or greedy) samples share the params. Check ``sample_count`` against a bound first:
    this builds all ``n`` dicts."""
    n = sample_count(params)
    params = {k: v for k, v in (params or {}).items() if k != "n"}
    key = next((k for k in ("seed", *_ALIASES) if params.get(k) is not None), None)
    seed = params.get(key) if key else None
    if isinstance(seed, float) and seed.is_integer():
        seed = int(seed)
    if n == 1 or not _is_int(seed):
        return [dict(params) for _ in range(n)]  # a malformed seed is refused later, when the params are parsed
    return [{**params, key: seed if i == 0 else (seed + i) % 2**64} for i in range(n)]
