"""The paper's JSON-decoding workload: a document + a regex with constant keys, decoded with jump-forward
(compressed FSM) vs without, and with the grammar cache vs rebuilding the token index per request.

    python -m benchmarks.bench_json_decode [--model-path P] [--num-docs 8] [--smoke] [--output F]

Reports forward passes per output token, wall time and the throughput ratio; token-index build time and
per-step mask time come from sglang_backend.runtime.constrained.bench.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time

from benchmarks.common import default_output, env_info, format_table, progress, write_json

CITIES = [
    ("Paris", "France", "the Eiffel Tower"), ("Rome", "Italy", "the Colosseum"), ("Berlin", "Germany", "the Brandenburg Gate"),
    ("Madrid", "Spain", "the Royal Palace"), ("Tokyo", "Japan", "the Tokyo Tower"), ("Cairo", "Egypt", "the Pyramids"),
    ("Lima", "Peru", "the Plaza Mayor"), ("Ottawa", "Canada", "Parliament Hill"), ("Athens", "Greece", "the Acropolis"),
    ("Vienna", "Austria", "the Hofburg"), ("Lisbon", "Portugal", "the Belem Tower"), ("Dublin", "Ireland", "Trinity College"),
]

# Constant keys: every key and separator is a forced (compressed) edge.
REGEX = (r'\{"name": "[A-Za-z ]{1,16}", "country": "[A-Za-z ]{1,16}", "landmark": "[A-Za-z ]{1,32}", '
         r'"capital": (true|false)\}')


def documents(n: int) -> list[str]:
    docs = []
    for i in range(n):
        city, country, landmark = CITIES[i % len(CITIES)]
        docs.append(f"{city} is the capital city of {country}. Visitors come from all over the world to see "
                    f"{landmark}, the most famous landmark of {city}.\nExtract the information as JSON.\nJSON: ")
    return docs


def run_mode(engine, docs, params, fresh_grammar_cache: bool = False) -> dict:
    engine.flush_cache()
    before = engine.get_stats()
    outs, t0 = [], time.perf_counter()
    for doc in progress(docs, desc="docs", disable=len(docs) < 4):
        if fresh_grammar_cache:  # no cache: every request builds its token index from scratch
            from sglang_backend.runtime.constrained import GrammarCache

            sched = engine.scheduler
            sched._grammar_cache = GrammarCache(engine.tokenizer, sched.model_runner.vocab_size, sched.eos_token_ids,
                                                disk_cache=False)
        outs.append(engine.generate(doc, params))
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    tokens = sum(len(o["output_ids"]) for o in outs)
    passes = (after["num_prefill_batches"] - before["num_prefill_batches"]) + (
        after["num_decode_batches"] - before["num_decode_batches"])
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "forward_passes": passes,
        "decode_steps": after["num_decode_batches"] - before["num_decode_batches"],
        "forward_passes_per_output_token": passes / tokens if tokens else None,
        "docs_per_s": len(docs) / wall,
        "jump_forwards": after["num_jump_forward"] - before["num_jump_forward"],
        "all_match": all(re.fullmatch(REGEX, o["text"]) for o in outs),
        "texts": [o["text"] for o in outs],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-docs", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny dummy model, 2 docs (CI)")
    ap.add_argument("--skip-index-bench", action="store_true")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)

    from sglang_backend import Engine

    model_path = args.model_path
    if args.smoke:
        from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

        model_path = save_dummy_hf_model(dummy_config(), tempfile.mkdtemp(prefix="bench-json-"))
        args.num_docs = 2
    engine = Engine(model_path=model_path, log_level="warning")
    docs = documents(args.num_docs)
    params = {"max_new_tokens": 96, "temperature": 0, "regex": REGEX}
    engine.generate(docs[0], params)  # warm-up: builds the grammar once
    results = {}
    for name, jf_off, fresh in (("jump_forward", False, False), ("no_jump_forward", True, False),
                                ("no_grammar_cache", False, True)):
        engine.scheduler.server_args.disable_jump_forward = jf_off
        results[name] = run_mode(engine, docs, params, fresh_grammar_cache=fresh)
    engine.scheduler.server_args.disable_jump_forward = False
    jf, nojf, nocache = results["jump_forward"], results["no_jump_forward"], results["no_grammar_cache"]
    summary = {
        "throughput_ratio_jump_forward": jf["docs_per_s"] / nojf["docs_per_s"],
        "forward_pass_ratio": nojf["forward_passes"] / max(jf["forward_passes"], 1),
        "same_outputs_with_and_without_jump_forward": jf["texts"] == nojf["texts"],
        "slowdown_without_grammar_cache": jf["docs_per_s"] / nocache["docs_per_s"],
    }
    index = None
    if not args.skip_index_bench and not args.smoke:
        from sglang_backend.runtime.constrained.bench import run as index_bench

        index = index_bench(engine.model_dir)
    engine.shutdown()
    rows = [[k, f"{v['wall_s']:.2f}", v["output_tokens"], v["forward_passes"],
             f"{v['forward_passes_per_output_token']:.3f}", f"{v['docs_per_s']:.2f}", v["jump_forwards"], v["all_match"]]
            for k, v in results.items()]
    print(format_table(["mode", "wall s", "out tokens", "fwd passes", "passes/token", "docs/s", "jumps", "all match"], rows))
    print(json.dumps(summary, indent=2))
    if index:
        js = index["json_schema"]
        print(f"token index (JSON schema, {index['vocab_size']} tokens): cold {js['cold_compile_s']:.3f}s, "
              f"disk {js['disk_cached_compile_s'] * 1e3:.1f} ms, memory {js['memory_cached_compile_s'] * 1e6:.1f} us; "
              f"fill_mask {js['fill_mask_us_wide']:.1f} us/step")
    result = {"benchmark": "json_decode", "env": env_info(), "model_path": engine.model_dir, "num_docs": args.num_docs,
              "regex": REGEX, "results": results, "summary": summary, "token_index": index}
    write_json(result, args.output or default_output("json_decode_smoke" if args.smoke else "json_decode"))
    return result


if __name__ == "__main__":
    main()
