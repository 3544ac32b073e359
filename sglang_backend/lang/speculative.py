"""API speculative execution for chat models (upstream's ``num_api_spec_tokens`` on a chat model).

A chat API continues whole messages, so inside an assistant turn of a ``@function(num_api_spec_tokens=N)``
program the constant text and the gens are not sent one by one: they are recorded as terms, and at the end of
the turn one chat completion of up to N tokens is matched against them (each constant text where the template
puts it, each gen up to its stop). The turn's text is then the terms' texts, gens filled in; when the
model strays from the template, the gens matched so far keep their text and the rest are empty, as upstream's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecTerm:
    text: str | None  # constant text the model is expected to write; None for a gen
    name: str | None = None  # the gen's variable
    stop: list[str] = field(default_factory=list)
    params: Any = None  # the gen's sampling params


def gen_term(name: str, params) -> SpecTerm:
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    return SpecTerm(None, name, [s for s in stops if s], params)


def match_terms(terms: list[SpecTerm], completion: str) -> tuple[dict[str, str], bool]:
    """(values of the gens matched, whether the whole template matched). A gen ends at its earliest stop, else
    where the next constant text begins, else (the last term) at the end of the completion."""
    values: dict[str, str] = {}
    rest = completion
    for i, term in enumerate(terms):
        if term.text is not None:
            if not rest.startswith(term.text):
                return values, False
            rest = rest[len(term.text):]
            continue
        nxt = terms[i + 1] if i + 1 < len(terms) else None
        delimiters = term.stop or ([nxt.text] if nxt is not None and nxt.text else [])
        hits = [p for p in (rest.find(d) for d in delimiters) if p >= 0]
        if hits:
            cut = min(hits)
        elif nxt is None:
            cut = len(rest)
        else:
            return values, False
        values[term.name] = rest[:cut]
        rest = rest[cut:]
    return values, True
