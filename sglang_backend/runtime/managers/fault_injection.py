"""Test-only fault injection for the scheduler, switched on by an environment variable (never by a request):

    SGLANG_BACKEND_FAULT_INJECTION='[{"mode": "nan", "token": 300, "after": 3}, {"mode": "raise", "token": 301}]'

(one rule or a list). A request whose prompt contains a rule's ``token`` is poisoned: once it has ``after``
output tokens, every forward pass that includes it raises (``"raise"``, as a failing kernel would) or its
logits row becomes NaN (``"nan"``, as a numerically broken model would). The reliability tests use it to check
that such a fault fails that one request while the rest of the batch finishes exactly as in a clean run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ... import environ

ENV_VAR = environ.FAULT_INJECTION.name
MODES = ("nan", "raise")


class InjectedFault(RuntimeError):
    pass


@dataclass
class FaultRule:
    mode: str
    token: int
    after: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"{ENV_VAR}: mode must be one of {MODES}, got {self.mode!r}")

    def poisoned(self, req) -> bool:
        return len(req.output_ids) >= self.after and self.token in req.origin_input_ids


class FaultInjector:
    def __init__(self, rules: list[FaultRule]):
        self.rules = rules

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        spec = environ.FAULT_INJECTION.get()
        if not spec:
            return None
        rules = json.loads(spec)
        return cls([FaultRule(**r) for r in (rules if isinstance(rules, list) else [rules])])

    def _poisoned(self, req, mode: str) -> bool:
        return any(r.mode == mode and r.poisoned(req) for r in self.rules)

    def before_forward(self, reqs) -> None:
        if any(self._poisoned(r, "raise") for r in reqs):
            raise InjectedFault("injected model fault")

    def corrupt_logits(self, reqs, logits: torch.Tensor) -> torch.Tensor:
        """``logits``: one row per request (the rows about to be sampled). Returns them, poisoned rows NaN."""
        rows = [i for i, req in enumerate(reqs) if self._poisoned(req, "nan")]
        if not rows:
            return logits
        logits = logits.clone()  # the forward's output may be an inference tensor
        logits[rows] = float("nan")
        return logits
