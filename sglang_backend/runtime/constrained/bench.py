"""Micro-benchmark of the constrained-decoding core on a real tokenizer (default: SmolLM2's).

    python -m sglang_backend.runtime.constrained.bench [--model-path DIR] [--threads N] [--out FILE]

Reports (JSON): vocabulary build; for a JSON schema and for the paper's regex: cold compile split into
schema->regex, regex->DFA, token index, and the same grammar again from the memory LRU and from the
disk cache in a fresh ``GrammarCache``; per-step costs in microseconds: ``fill_mask`` in a narrow and a
wide (free-text) state (cached mask) and on a mask-cache miss, the ``masked_fill_`` alternative,
``fill_masks`` over a batch of 32 rows, ``advance``, ``forced_string`` and jump-forward re-tokenization.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from transformers import AutoTokenizer

from ..model_loader.embedded import default_model_path
from .grammar import GrammarCache, fill_masks, retokenize_jump_forward
from .json_schema import build_regex_from_schema
from .regex_fsm import compile_regex
from .token_index import TokenVocabulary, build_token_index

BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "birthday": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": r"^\d{5}$"}},
                    "required": ["street", "city"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
}
PAPER_REGEX = r"""\{"summary": "[\w\d\s]*", "grade": "[ABCD][+-]?"\}"""


def _us(fn, n: int, device: str = "cpu") -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def run(model_path: str | None = None, threads: int = 1, device: str = "cpu") -> dict:
    if model_path is None:
        model_path = default_model_path()
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_path)
    res: dict = {"model_path": model_path, "torch_threads": threads, "vocab_size": len(tok), "logits_device": device}
    t = time.perf_counter()
    vocab = TokenVocabulary.from_tokenizer(tok)
    res["vocab_build_s"] = time.perf_counter() - t
    res["vocab_trie_nodes"] = vocab.num_nodes
    res["vocab_max_token_bytes"] = vocab.max_len
    eos = {tok.eos_token_id}

    for name, kind, spec in [("json_schema", "json_schema", json.dumps(BENCH_SCHEMA)), ("paper_regex", "regex", PAPER_REGEX)]:
        r: dict = {}
        t = time.perf_counter()
        regex = build_regex_from_schema(spec) if kind == "json_schema" else spec
        r["schema_to_regex_s"] = time.perf_counter() - t
        t = time.perf_counter()
        dfa = compile_regex(regex)
        r["regex_to_dfa_s"] = time.perf_counter() - t
        t = time.perf_counter()
        index = build_token_index(dfa, vocab, len(tok), eos)
        r["token_index_s"] = time.perf_counter() - t
        r["dfa_states"] = dfa.num_states
        r["mask_classes"] = index.num_classes
        with tempfile.TemporaryDirectory() as d:
            c1 = GrammarCache(vocab, len(tok), eos, cache_dir=d)
            t = time.perf_counter()
            g = c1.compile(kind, spec)
            r["cold_compile_s"] = time.perf_counter() - t
            t = time.perf_counter()
            c1.compile(kind, spec)
            r["memory_cached_compile_s"] = time.perf_counter() - t
            c2 = GrammarCache(vocab, len(tok), eos, cache_dir=d)
            t = time.perf_counter()
            c2.compile(kind, spec)
            r["disk_cached_compile_s"] = time.perf_counter() - t
            c1.shutdown()
            c2.shutdown()
        # Per-step costs.
        m = g.matcher()
        narrow = m.copy()  # start state: '{' only
        wide = m.copy()
        wide.advance_text(wide.forced_string())  # inside the first string: almost every token allowed
        logits = torch.randn(g.vocab_size, device=device)
        for label, mm in [("narrow", narrow), ("wide", wide)]:
            r[f"allowed_tokens_{label}"] = int(mm.allowed_mask().sum())
            r[f"fill_mask_us_{label}"] = _us(lambda: mm.fill_mask(logits), 2000, device)
        bad = wide.disallowed_mask(device)
        r["masked_fill_bool_us_wide"] = _us(lambda: logits.masked_fill_(bad, float("-inf")), 500, device)
        batch = torch.randn(32, g.vocab_size, device=device)
        ms = [wide.copy() if i % 2 else narrow.copy() for i in range(32)]
        r["fill_masks_us_batch32"] = _us(lambda: fill_masks(batch, ms), 200, device)

        def miss():
            g._masks.clear()
            g._bits.clear()  # the C kernel's cache (CPU float32 rows)
            wide.fill_mask(logits)

        r["fill_mask_us_cache_miss"] = _us(miss, 200, device)
        tid = tok.encode("hello")[0]

        def adv():
            x = wide.copy()
            x.advance(tid)

        r["advance_us"] = _us(adv, 5000)
        r["forced_string_us"] = _us(lambda: m.forced_string(), 5000)
        out = tok.encode("{")
        forced = m.forced_string()[1:] or '"x"'
        r["retokenize_us"] = _us(lambda: retokenize_jump_forward(tok, out, forced), 500)
        res[name] = r
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the logits live for the per-step timings")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = run(args.model_path, args.threads, args.device)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
