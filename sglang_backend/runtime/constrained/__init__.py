"""Constrained decoding: regex / JSON schema -> byte DFA -> compressed FSM + per-state token masks, or llguidance.

Modules (design notes live in their docstrings):

* ``regex_fsm``      regex -> trimmed byte-level DFA (interegular parse + to_fsm, our UTF-8 conversion)
* ``compressed_fsm`` singular-transition chains -> compressed edges / forced strings (paper §4, App. B.1)
* ``token_index``    allowed-token masks per state over a real vocabulary; memory + disk cache; async
* ``json_schema``    JSON schema / pydantic model -> regex
* ``grammar``        ``GrammarCache`` / ``CompiledGrammar`` / ``GrammarMatcher`` for the scheduler, and
                     jump-forward re-tokenization (App. B.2)
* ``llguidance_backend``  every grammar kind on llguidance (the default engine: millisecond compiles, lazy
                     masks, forced bytes for jump-forward), same matcher interface; regexes it cannot parse
                     and installs without it stay on our engine above
* ``budget``         the compile budget: sizes, states and llguidance's fuel, never wall-clock seconds
* ``mask_row``       the mask on a CPU logits row in one C call (``mask_row.c``), for both engines' ``fill_mask``
"""

from .budget import GrammarTooComplex
from .compressed_fsm import CompressedFSM
from .grammar import (
    CompiledGrammar,
    GrammarCache,
    GrammarMatcher,
    apply_jump_forward,
    cache_options,
    fill_masks,
    retokenize_jump_forward,
)
from .json_schema import build_regex_from_schema, schema_from_pydantic
from .regex_fsm import ByteDFA, compile_regex
from .token_index import TokenIndex, TokenIndexCache, TokenVocabulary, build_token_index, get_vocabulary

__all__ = [
    "ByteDFA",
    "CompiledGrammar",
    "CompressedFSM",
    "GrammarCache",
    "GrammarMatcher",
    "GrammarTooComplex",
    "TokenIndex",
    "TokenIndexCache",
    "TokenVocabulary",
    "apply_jump_forward",
    "cache_options",
    "build_regex_from_schema",
    "build_token_index",
    "compile_regex",
    "fill_masks",
    "get_vocabulary",
    "retokenize_jump_forward",
    "schema_from_pydantic",
]
