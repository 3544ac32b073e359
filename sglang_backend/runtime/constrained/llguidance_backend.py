"""EBNF / Lark grammars through llguidance, behind the same matcher interface as ``grammar.GrammarMatcher``.

Our own pipeline (regex -> byte DFA -> token index) covers regular languages. Context-free grammars (the
``ebnf`` request field) go to llguidance's ``LLMatcher``, an Earley parser with a lazily computed token
mask, over our tokenizer (``llguidance.hf.from_tokenizer``). The grammar text may be GBNF (``root ::= ...``,
as upstream SGLang / llama.cpp take it) or llguidance's Lark dialect (``start: ...``, what
``guidance``'s ``node.ll_grammar()`` sends); ``llguidance.grammar_from("ebnf", text)`` accepts both.

The scheduler drives a matcher exactly like ``GrammarMatcher``: ``fill_mask`` before sampling, ``advance``
after, ``is_finished`` to end, ``forced_string`` + ``advance_text`` for jump-forward (llguidance's
``compute_ff_bytes`` is the forced text; re-tokenization stays the scheduler's). llguidance is optional:
without it an ``ebnf`` request is a clear ``ValueError`` (a 400 on the server).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["LLGuidanceCompiler", "LLGuidanceGrammar", "LLGuidanceMatcher", "llguidance_available"]


def llguidance_available() -> bool:
    try:
        import llguidance  # noqa: F401
        import llguidance.hf  # noqa: F401
    except ImportError:
        return False
    return True


def _whole_chars(data: bytes) -> str:
    """The longest prefix of ``data`` that is whole UTF-8 characters, decoded."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


class LLGuidanceCompiler:
    """Builds llguidance's tokenizer once per scheduler (~1 s) and compiles grammars against it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        if not llguidance_available():
            raise ValueError("ebnf grammars need the llguidance package (pip install llguidance==1.5.0)")
        import llguidance.hf  # optional dependency (the ebnf extra)

        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.primary_eos = int(eos) if eos is not None else min(self.eos_token_ids)
        self.vocab_size = int(vocab_size)
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                             eos_token=self.primary_eos)
        except ValueError as e:  # a slow (non-Rust) tokenizer
            raise ValueError(f"ebnf grammars need a fast tokenizer: {e}") from None
        self._lock = threading.Lock()

    def compile(self, spec: str) -> "LLGuidanceGrammar":
        import llguidance  # optional dependency (the ebnf extra)

        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("invalid ebnf grammar: expected a non-empty string")
        try:
            grammar = llguidance.grammar_from("ebnf", spec)
        except Exception as e:  # noqa: BLE001 - the GBNF converter raises plain Exceptions
            raise ValueError(f"invalid ebnf grammar: {e}") from None
        is_err, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_err:
            raise ValueError(f"invalid ebnf grammar: {messages[0].strip()}")
        return LLGuidanceGrammar(spec, grammar, self)


class LLGuidanceGrammar:
    """A validated grammar (read-only, shareable); ``matcher()`` starts a parse per request."""

    kind = "ebnf"

    def __init__(self, spec: str, grammar: str, compiler: LLGuidanceCompiler):
        self.spec = spec
        self.grammar = grammar
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.eos_token_ids = compiler.eos_token_ids

    def matcher(self) -> "LLGuidanceMatcher":
        import llguidance  # optional dependency (the ebnf extra)

        m = llguidance.LLMatcher(self.compiler.ll_tokenizer, self.grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid ebnf grammar: {m.get_error()}")
        return LLGuidanceMatcher(self, m)


class LLGuidanceMatcher:
    """Per-request parse state (not thread-safe; ``copy()`` for forks)."""

    __slots__ = ("grammar", "matcher", "terminated", "num_tokens")

    def __init__(self, grammar: LLGuidanceGrammar, matcher):
        self.grammar = grammar
        self.matcher = matcher
        self.terminated = False
        self.num_tokens = 0

    # -- masks -------------------------------------------------------------------------------------
    def allowed_mask(self, device=None) -> torch.Tensor:
        """Boolean [vocab_size]: True where the token is allowed."""
        g = self.grammar
        allowed = np.zeros(g.vocab_size, dtype=bool)
        if not self.terminated and not self.matcher.is_error():
            words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(words, bitorder="little", count=g.vocab_size).astype(bool)
        # EOS is allowed where the grammar may end (llguidance knows one EOS id; the model may have several).
        if self.terminated or self.matcher.is_error() or allowed[g.compiler.primary_eos]:
            for e in g.eos_token_ids:
                if 0 <= e < g.vocab_size:
                    allowed[e] = True
        out = torch.from_numpy(allowed)
        return out if device is None else out.to(device)

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place (extra columns past the vocab too)."""
        allowed = self.allowed_mask()
        v = allowed.shape[0]
        width = logits_row.shape[-1]
        if width > v:
            logits_row[..., v:] = float("-inf")
        n = min(width, v)
        logits_row[..., :n].masked_fill_(~allowed[:n].to(logits_row.device), float("-inf"))

    def allowed_token_ids(self) -> list[int]:
        return torch.nonzero(self.allowed_mask()).flatten().tolist()

    def is_allowed(self, token_id: int) -> bool:
        return bool(self.allowed_mask()[int(token_id)])

    # -- transitions -------------------------------------------------------------------------------
    def advance(self, token_id: int) -> None:
        """Consume a sampled token. Raises ``ValueError`` if the grammar does not allow it."""
        token_id = int(token_id)
        if self.terminated:
            raise ValueError(f"grammar already terminated; got token {token_id}")
        if token_id in self.grammar.eos_token_ids:
            if not self.matcher.is_accepting():
                raise ValueError(f"EOS token {token_id} before the grammar is complete")
            self.terminated = True
            self.num_tokens += 1
            return
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the grammar: {self.matcher.get_error()}")
        self.num_tokens += 1

    def advance_text(self, text: str | bytes) -> None:
        """Consume text appended by jump-forward. llguidance parses bytes, so any tokenization of the text
        reaches the same parse state; the tokenizer's own is used."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not data:
            return
        if self.terminated:
            raise ValueError("grammar already terminated")
        ids = self.grammar.compiler.ll_tokenizer.tokenize_bytes(data)
        if not self.matcher.consume_tokens(ids):
            raise ValueError(f"text {data[:60]!r} is not allowed by the grammar: {self.matcher.get_error()}")

    # -- queries -----------------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        return self.terminated or self.matcher.is_accepting()

    def is_finished(self) -> bool:
        """Terminated by EOS, or nothing but EOS can follow (complete, or the parse failed)."""
        return self.terminated or self.matcher.is_stopped()

    def forced_string(self) -> str:
        """Jump-forward text: the bytes every continuation starts with, cut to whole characters."""
        if self.terminated or self.matcher.is_stopped():
            return ""
        return _whole_chars(self.matcher.compute_ff_bytes())

    def copy(self) -> "LLGuidanceMatcher":
        m = LLGuidanceMatcher(self.grammar, self.matcher.deep_copy())
        m.terminated = self.terminated
        m.num_tokens = self.num_tokens
        return m

    def __repr__(self) -> str:
        return f"LLGuidanceMatcher(accepting={self.is_accepting()}, terminated={self.terminated})"
