"""Synthetic text measured in real tokens: every workload's prompts are built from this, so their lengths
(in the model's own tokenizer) match the shapes the paper describes."""

from __future__ import annotations

import random
import re

_WORD = re.compile(r"^[a-z]{3,12}$")
_FALLBACK = ("time year people way day man thing woman life child world school state family student group "
             "country problem hand part place case week company system program question work government number "
             "night point home water room mother area money story fact month lot right study book eye job word "
             "business issue side kind head house service friend father power hour game line end member law car "
             "city community name president team minute idea kid body information back parent face others level "
             "office door health person art war history party result change morning reason research girl guy "
             "moment air teacher force education river garden bridge market paper window music forest island").split()


class TextGen:
    """Random English-like text of an exact token length, from words the tokenizer knows as single tokens."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        words = set()
        for tok_id in range(min(len(tokenizer), 60000)):
            w = tokenizer.decode([tok_id]).strip()
            if _WORD.match(w):
                words.add(w)
        self.words = sorted(words) if len(words) >= 200 else list(_FALLBACK)

    def n_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, n_tokens: int, capitalize: bool = True) -> str:
        """About ``n_tokens`` tokens of text (exact up to the word boundary at the end)."""
        if n_tokens <= 0:
            return ""
        words = [self.rng.choice(self.words) for _ in range(n_tokens)]
        ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False)[:n_tokens]
        out = self.tokenizer.decode(ids).strip()
        return out[:1].upper() + out[1:] if capitalize else out

    def between(self, lo: int, hi: int) -> str:
        return self.text(self.rng.randint(lo, hi))

    def randint(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq):
        return self.rng.choice(seq)
