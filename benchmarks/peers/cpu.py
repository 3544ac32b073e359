"""CPU peer benchmark: our engine against llama.cpp (``llama-cpp-python``) on the very same GGUF file, the
embedded SmolLM2-135M-Instruct Q4_1, interleaved in one run.

    python -m benchmarks.peers.cpu --out benchmarks/results/cpu_peers_smollm2 [--threads N] [--rounds 3]
        [--sections decode1,batch16,shared_prefix] [--ours-arg key=value ...] [--llamacpp-arg key=value ...]
        [--variant-arg key=value ...] [--smoke]

writes ``<out>.json`` (machine, versions, every round's raw numbers, medians, ratios), ``<out>.md`` (one
table: workload | ours | llama.cpp | ours / llama.cpp) and ``<out>.png`` (bars normalised to llama.cpp = 1).

How:

* Each side runs in its own child process (``--child ours|llamacpp``), so memory, thread pools and allocator
  state never mix; both use ``--threads`` threads (default: the CPUs this process may run on) -- ours
  ``torch.set_num_threads``, llama.cpp ``n_threads = n_threads_batch``. A child loads its model once, then
  answers one JSON line per command on stdin (warm up / run a section). The parent warms every section up on
  both sides, then for each round and section runs ours and llama.cpp one after the other, alternating which
  goes first. Reported: the median over rounds (and every raw value).
* The workloads are token ids, made once in the parent with our tokenizer (converted from that GGUF) and fed
  to both sides unchanged. Greedy, EOS ignored, fixed output lengths.
  - ``decode1``: one 64-token prompt, 128 new tokens, streamed: decode tok/s = (n_out - 1) / (last token's
    time - first token's time), and time to first token. ours: ``Engine.generate(stream=True)``; llama.cpp:
    ``Llama.generate``. The first 16 greedy tokens of both sides are compared (informational: llama.cpp runs
    the matmuls on 8-bit-quantized activations, we dequantize the weights to float32).
  - ``batch16``: 16 different 64-token prompts, 64 new tokens each, all at once: output tok/s = 16 * 64 /
    wall. ours: one ``generate`` call with the 16 prompts; llama.cpp: its batched low-level API
    (``examples/batched``: 16 sequences in one context, one ``llama_decode`` per step).
  - ``shared_prefix``: 32 requests sharing a 730-token few-shot prefix, each with its own 20-token suffix,
    32 new tokens each: requests/s = 32 / wall and the median request completion time (every request arrives
    at the start). ours: one ``generate`` call with all 32 (the radix cache computes the prefix once);
    llama.cpp both ways a user might: the high-level ``Llama`` serving the requests one after another (it
    reuses the previous prompt's common prefix), and the batched API (prefix decoded once in seq 0 and
    ``llama_memory_seq_cp``-ed to the others); the faster one is reported as llama.cpp's number.
  Caches are cleared before every run on both sides: a round never reuses the previous round's prefix.
* ``--variant-arg``: a third side, ``ours_variant``: ours again in its own child with these Engine/ServerArgs
  kwargs on top of ``--ours-arg`` (e.g. ``cpu_activation_quant=q8``), interleaved with the other two in every
  round; reported as ``sections.*.ours_variant`` with ratios over llama.cpp and over ours, and in the table.
* ``--smoke``: tiny sizes and one round, to check the script end to end.
* llama-cpp-python is installed on demand into the user cache, never into the venv (see ``llamacpp_side``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIDES = ("ours", "llamacpp")
VARIANT = "ours_variant"  # --variant-arg: ours with extra kwargs, a third child
SECTIONS = ("decode1", "batch16", "shared_prefix")
FULL = dict(decode1=dict(prompt_len=64, n_new=128), batch16=dict(n=16, prompt_len=64, n_new=64),
            shared_prefix=dict(n=32, prefix_len=730, suffix_len=20, n_new=32))
SMOKE = dict(decode1=dict(prompt_len=64, n_new=8), batch16=dict(n=4, prompt_len=64, n_new=8),
             shared_prefix=dict(n=4, prefix_len=256, suffix_len=20, n_new=8))
WARMUP_NEW = 4  # output tokens of the batched sections' warm-up (decode1 warms up with the full generation)
FIRST_IDS = 16  # decode1: greedy tokens compared between the sides
LLAMA_N_CTX = 2048  # the high-level Llama's context: the longest single prompt + output is 782 tokens
SWITCH_PAUSE_S = 0.2  # between the sides' runs: the other side's idle thread pool stops spinning first


# Table rows: (section, metric, label, higher is better, drawn in the PNG)
ROWS = [
    ("decode1", "decode_tok_per_s", "decode1: decode tok/s, batch 1", True, True),
    ("decode1", "ttft_s", "decode1: time to first token, s (lower is better)", False, False),
    ("batch16", "output_tok_per_s", "batch16: aggregate output tok/s", True, True),
    ("shared_prefix", "requests_per_s", "shared_prefix: requests/s", True, True),
    ("shared_prefix", "p50_completion_s", "shared_prefix: p50 completion, s (lower is better)", False, False),
]


# Workloads --------------------------------------------------------------------------------------------------------
SUBJECTS = [  # distinct first words: the batch16 prompts share no prefix at all
    "Printing presses", "Steam locomotives", "Roman roads", "Honeybee colonies", "Glaciers", "Board games",
    "Medieval cathedrals", "Hydrothermal vents", "Paper making", "Bird migration", "Coral reefs", "Silk trade",
    "Early aviation", "Volcanic islands", "Periodic tables", "Tide pools", "Lighthouses", "Telescopes",
    "Deserts", "Ancient libraries",
]
FILLER = (" Explain how it started, who the important people were, what problems they had to solve, and how "
          "the ideas spread from one country to another over the following centuries. Give concrete examples, "
          "mention the tools and materials that were used, and describe what daily life looked like for the "
          "people involved. Finish with a short summary of why it still matters today.")
FEW_SHOT_HEAD = ("You are a support assistant for an online store. Read each customer review and answer with "
                 "its sentiment (positive, negative or mixed) and a one-sentence reason. Follow the format of "
                 "the examples exactly.\n\n")
EXAMPLES = [
    ("The blender is powerful and crushes ice in seconds, but it is louder than my old one.", "mixed",
     "the customer likes the power but dislikes the noise"),
    ("My order arrived two weeks late and the box was crushed. Nobody answered my emails.", "negative",
     "the delivery was late, damaged and support did not respond"),
    ("These running shoes are light, comfortable and still look new after three hundred miles.", "positive",
     "the shoes are comfortable and durable"),
    ("The jacket is warm enough, though the zipper broke after a month of normal use.", "mixed",
     "warmth is fine but the zipper failed early"),
    ("Great value for the price. The headphones sound clear and the battery lasts all week.", "positive",
     "good sound, long battery life and a fair price"),
    ("The lamp flickers constantly and the replacement did exactly the same thing.", "negative",
     "both the lamp and its replacement were defective"),
    ("Setup took five minutes and the router has been stable ever since. Range covers the whole house.",
     "positive", "easy setup, stable connection and good range"),
    ("The coffee grinder works, but cleaning it is a chore and grounds end up everywhere.", "mixed",
     "it works but is messy and hard to clean"),
    ("I returned the vacuum after one day: weak suction and the filter clogged immediately.", "negative",
     "poor suction and a filter that clogs"),
    ("The backpack has clever pockets and survived a month of hiking without a scratch.", "positive",
     "well designed and robust"),
    ("Colors on the monitor are gorgeous, yet the stand wobbles whenever I type.", "mixed",
     "great picture but an unstable stand"),
    ("The customer service team replaced my broken kettle within two days, no questions asked.", "positive",
     "fast and friendly replacement of a broken item"),
]
PRODUCTS = ["desk chair", "phone case", "rice cooker", "yoga mat", "electric kettle", "garden hose", "keyboard",
            "water bottle", "winter coat", "toaster", "bike lock", "tablet stand", "air fryer", "wool socks",
            "smart watch", "cutting board"]
VERDICTS = ["works better than expected", "stopped working after a week", "is fine but overpriced",
            "feels cheap and flimsy", "exceeded every expectation", "arrived scratched but works"]


def exact(tokenizer, text: str, n: int, what: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise ValueError(f"{what}: {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


def few_shot_prefix(tokenizer, n: int) -> list[int]:
    """The few-shot prompt head: instructions and worked examples (cycled) until ``n`` tokens."""
    text, k = FEW_SHOT_HEAD, 0
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < n:
        review, label, reason = EXAMPLES[k % len(EXAMPLES)]
        text += f"Review: {review}\nSentiment: {label}\nReason: {reason}.\n\n"
        k += 1
    return exact(tokenizer, text, n, "few-shot prefix")


def suffix(tokenizer, i: int, n: int) -> list[int]:
    """Request ``i``'s own review, cut to ``n`` tokens so that the prompt ends with 'Sentiment:'."""
    tail = tokenizer("\nSentiment:", add_special_tokens=False)["input_ids"]
    body = (f"Review: The {PRODUCTS[i % len(PRODUCTS)]} I bought (order {1000 + 37 * i}) "
            f"{VERDICTS[i % len(VERDICTS)]}, and I would tell my friends about it.")
    return exact(tokenizer, body, n - len(tail), f"suffix {i}") + tail


def build_workloads(tokenizer, sizes: dict, sections: list[str]) -> dict:
    """Token ids of every section (the same for both sides) with the sizes they were built for."""
    def essay(i, n):
        return exact(tokenizer, f"{SUBJECTS[i % len(SUBJECTS)]}: write a detailed essay about this topic.{FILLER}", n,
                     f"prompt {i}")

    out = {}
    if "decode1" in sections:
        p = sizes["decode1"]
        out["decode1"] = dict(p, prompt=essay(len(SUBJECTS) - 1, p["prompt_len"]))
    if "batch16" in sections:
        p = sizes["batch16"]
        out["batch16"] = dict(p, prompts=[essay(i, p["prompt_len"]) for i in range(p["n"])])
    if "shared_prefix" in sections:
        p = sizes["shared_prefix"]
        out["shared_prefix"] = dict(p, prefix=few_shot_prefix(tokenizer, p["prefix_len"]),
                                    suffixes=[suffix(tokenizer, i, p["suffix_len"]) for i in range(p["n"])])
    return out


# Metrics (pure: tested on fake numbers) ------------------------------------------------------------------------
def stream_metrics(t0: float, times: list[float]) -> dict:
    """Time to first token and decode tok/s = (n - 1) / (last - first) from each output token's arrival time."""
    n = len(times)
    span = times[-1] - times[0] if n > 1 else 0.0
    return dict(ttft_s=times[0] - t0, decode_tok_per_s=(n - 1) / span if span > 0 else None, n_out=n)


def completion_metrics(t0: float, done: list[float], n_new: int) -> dict:
    """Requests that all arrived at ``t0`` and finished at ``done``: requests/s, output tok/s, p50 completion."""
    wall = max(done) - t0
    return dict(wall_s=wall, requests_per_s=len(done) / wall, output_tok_per_s=len(done) * n_new / wall,
                p50_completion_s=statistics.median(d - t0 for d in done))


def well_formed(outs: list[list[int]], n_req: int, n_new: int, vocab: int) -> bool:
    return len(outs) == n_req and all(len(o) == n_new and all(0 <= t < vocab for t in o) for o in outs)


def medians(rounds: list[dict]) -> dict:
    """Per numeric key: the median over rounds (bools: all rounds true)."""
    out = {}
    for key in rounds[0] if rounds else ():
        vals = [r.get(key) for r in rounds]
        if all(isinstance(v, bool) for v in vals):
            out[key] = all(vals)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = statistics.median(vals)
    return out


def ratio(ours, peer) -> float | None:
    return ours / peer if ours and peer else None


def summarize_section(name: str, ours_rounds: list[dict], llama_rounds: list[dict]) -> dict:
    """Medians per side and the ratios ours / llama.cpp. A llama.cpp round with several variants (a dict of
    dicts) is reported by its variant with the most requests/s (median); all variants are kept."""
    llama: dict = {"rounds": llama_rounds}
    if llama_rounds and all(isinstance(v, dict) for v in llama_rounds[0].values()):
        variants = {v: {"rounds": [r[v] for r in llama_rounds]} for v in llama_rounds[0]}
        for entry in variants.values():
            entry["median"] = medians(entry["rounds"])
        best = max(variants, key=lambda v: variants[v]["median"].get("requests_per_s") or 0)
        llama.update(variants=variants, variant=best, median=variants[best]["median"])
    else:
        llama["median"] = medians(llama_rounds)
    ours = {"rounds": ours_rounds, "median": medians(ours_rounds)}
    ratios = {key: ratio(ours["median"].get(key), llama["median"].get(key))
              for key in ours["median"] if not isinstance(ours["median"][key], bool)}
    return {"ours": ours, "llamacpp": llama, "ratio_ours_over_llamacpp": ratios}


def table_rows(result: dict) -> list[dict]:
    rows = []
    for section, key, label, higher, plot in ROWS:
        sec = result["sections"].get(section)
        if not sec:
            continue
        a, b = sec["ours"]["median"].get(key), sec["llamacpp"]["median"].get(key)
        variant = sec["llamacpp"].get("variant")
        v = sec[VARIANT]["median"].get(key) if VARIANT in sec else None
        rows.append(dict(section=section, metric=key, label=label, ours=a, llamacpp=b, ratio=ratio(a, b),
                         higher_is_better=higher, plot=plot, llamacpp_variant=variant, ours_variant=v,
                         variant_ratio=ratio(v, b), variant_over_ours=ratio(v, a)))
    return rows


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def render_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# CPU: ours vs llama.cpp, {result['model']}", "",
             f"{result['date']}; {m['cpu_model']}, {m['threads']} threads (of {m['cpus_allowed']} CPUs); "
             f"{result['rounds']} round(s), medians; ours {result['versions']['ours']}, "
             f"llama-cpp-python {result['versions']['llama_cpp']}, torch {result['versions']['torch']}"
             + (" -- SMOKE sizes" if result["smoke"] else ""), "",
             "| workload | ours | llama.cpp | ours / llama.cpp |", "|---|---|---|---|"]
    for r in table_rows(result):
        peer = fmt(r["llamacpp"]) + (f" ({r['llamacpp_variant']})" if r["llamacpp_variant"] else "")
        lines.append(f"| {r['label']} | {fmt(r['ours'])} | {peer} | {fmt(r['ratio'])} |")
    if result.get("variant_args"):
        args = ", ".join(f"{k}={v}" for k, v in result["variant_args"].items())
        lines += ["", f"Ours with {args} (ours_variant), same rounds:", "",
                  "| workload | ours_variant | ours_variant / llama.cpp | ours_variant / ours |", "|---|---|---|---|"]
        lines += [f"| {r['label']} | {fmt(r['ours_variant'])} | {fmt(r['variant_ratio'])} | "
                  f"{fmt(r['variant_over_ours'])} |" for r in table_rows(result)]
    lines.append("")
    for name, sec in result["sections"].items():
        p = sec["params"]
        desc = ", ".join(f"{k}={v}" for k, v in p.items())
        ok = {side: sec[side]["median"].get("well_formed") for side in SIDES}
        lines.append(f"- {name}: {desc}; outputs well-formed: ours {ok['ours']}, llama.cpp {ok['llamacpp']}"
                     + (f", ours_variant {sec[VARIANT]['median'].get('well_formed')}" if VARIANT in sec else ""))
    d1 = result["sections"].get("decode1", {}).get("first_ids")
    if d1:
        where = "" if d1["equal"] else f", first difference at token {d1['first_diff']}"
        lines.append(f"- decode1: first {FIRST_IDS} greedy tokens of the two sides equal: {d1['equal']}{where} "
                     f"(informational: llama.cpp quantizes activations to 8 bits, we run float32)")
    d1v = result["sections"].get("decode1", {}).get("first_ids_variant")
    if d1v:
        where = "" if d1v["equal"] else f", first difference at token {d1v['first_diff']}"
        lines.append(f"- decode1: first {FIRST_IDS} greedy tokens of ours_variant and llama.cpp equal: "
                     f"{d1v['equal']}{where}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table_rows(result) if r["plot"] and r["ratio"]]
    fig, ax = plt.subplots(figsize=(1.8 + 2.2 * max(1, len(rows)), 4.2))
    xs = range(len(rows))
    bars_l = ax.bar([x - 0.2 for x in xs], [1.0] * len(rows), 0.4, label="llama.cpp", color="#999999")
    bars_o = ax.bar([x + 0.2 for x in xs], [r["ratio"] for r in rows], 0.4, label="ours", color="#1f77b4")
    for bar, r, key in [(b, r, "llamacpp") for b, r in zip(bars_l, rows)] + \
                       [(b, r, "ours") for b, r in zip(bars_o, rows)]:
        ax.annotate(fmt(r[key]), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r["label"].replace(": ", "\n") for r in rows], fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_ylim(0, 1.3 * max([1.0] + [r["ratio"] for r in rows]))  # room for the labels and the legend
    ax.set_ylabel("throughput relative to llama.cpp (= 1.0)")
    ax.set_title(f"CPU, {result['model']}: ours vs llama.cpp\n{result['date']}, "
                 f"{result['machine']['threads']} threads" + (" (smoke)" if result["smoke"] else ""), fontsize=10)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The sides, in their child processes ---------------------------------------------------------------------------
GREEDY = {"temperature": 0, "ignore_eos": True}


class OursSide:
    name = "ours"

    def __init__(self, threads: int, overrides: dict):
        import torch

        torch.set_num_threads(threads)
        from sglang_backend import Engine

        kw = dict(device="cpu", dtype="float32", log_level="warning")
        kw.update(overrides)
        t0 = time.perf_counter()
        self.eng = Engine(model_path="default", **kw)
        self.init_s = time.perf_counter() - t0
        self.vocab = self.eng.config.vocab_size
        self.torch = torch

    def info(self) -> dict:
        sa = self.eng.server_args
        return dict(init_s=self.init_s, n_vocab=self.vocab, torch_threads=self.torch.get_num_threads(),
                    device=sa.device, dtype=sa.dtype, attention_backend=sa.attention_backend,
                    max_total_tokens=self.eng.scheduler.model_runner.max_total_num_tokens)

    def close(self) -> None:
        self.eng.shutdown()

    def decode_stream(self, prompt: list[int], n_new: int) -> tuple[float, list[int], list[float]]:
        self.eng.flush_cache()
        times, ids = [], []
        t0 = time.perf_counter()
        for chunk in self.eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": n_new, **GREEDY},
                                       stream=True):
            now = time.perf_counter()
            ids = chunk["output_ids"]
            times += [now] * (len(ids) - len(times))  # a chunk may carry several tokens
        return t0, list(ids), times

    def batch(self, prompts: list[list[int]], n_new: int) -> tuple[float, list[list[int]], list[float]]:
        """One generate call with every prompt: (start, outputs, each request's finish time)."""
        self.eng.flush_cache()
        t0 = time.perf_counter()
        outs = self.eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n_new, **GREEDY})
        end = time.perf_counter()
        # e2e_latency counts from the request's creation, inside this call: within a few ms of t0
        done = [min(end, t0 + o["meta_info"]["e2e_latency"]) for o in outs]
        return t0, [list(o["output_ids"]) for o in outs], done

    def run(self, section: str, w: dict, warmup: bool) -> dict:
        if section == "decode1":
            t0, ids, times = self.decode_stream(w["prompt"], w["n_new"])
            return decode1_result(t0, ids, times, w["n_new"], self.vocab)
        n_new = WARMUP_NEW if warmup else w["n_new"]
        prompts = w["prompts"] if section == "batch16" else [w["prefix"] + s for s in w["suffixes"]]
        t0, outs, done = self.batch(prompts, n_new)
        return batch_result(t0, outs, done, n_new, self.vocab)


class LlamaCppSide:
    name = "llamacpp"

    def __init__(self, gguf: str, threads: int, install_path: str | None, extra: dict):
        from benchmarks.peers.llamacpp_side import LlamaSide

        self.side = LlamaSide(gguf, threads, LLAMA_N_CTX, install_path, extra)
        self.vocab = self.side.vocab

    def info(self) -> dict:
        return self.side.info()

    def close(self) -> None:
        self.side.close()

    def run(self, section: str, w: dict, warmup: bool) -> dict:
        s = self.side
        if section == "decode1":
            t0, ids, times = s.decode_stream(w["prompt"], w["n_new"])
            return decode1_result(t0, ids, times, w["n_new"], self.vocab)
        n_new = WARMUP_NEW if warmup else w["n_new"]
        if section == "batch16":
            t0, outs, end = s.batched("batch16", w["prompts"], n_new, size_new=w["n_new"])
            return batch_result(t0, outs, [end] * len(outs), n_new, self.vocab)
        prompts = [w["prefix"] + x for x in w["suffixes"]]
        t0, outs, done = s.sequential(prompts[:2] if warmup else prompts, n_new)
        seq = batch_result(t0, outs, done, n_new, self.vocab)
        seq_outs = outs
        t0, outs, end = s.batched("shared_prefix", w["suffixes"], n_new, prefix=w["prefix"], unified=True,
                                  size_new=w["n_new"])
        batched = batch_result(t0, outs, [end] * len(outs), n_new, self.vocab)
        # Self-check of the batched path: its greedy outputs should (mostly) equal the sequential ones
        batched["same_as_sequential"] = sum(a == b for a, b in zip(seq_outs, outs)) / len(seq_outs)
        return {"sequential": seq, "batched": batched}


def decode1_result(t0: float, ids: list[int], times: list[float], n_new: int, vocab: int) -> dict:
    return dict(stream_metrics(t0, times), well_formed=well_formed([ids], 1, n_new, vocab),
                first_ids=ids[:FIRST_IDS])


def batch_result(t0: float, outs: list[list[int]], done: list[float], n_new: int, vocab: int) -> dict:
    return dict(completion_metrics(t0, done, n_new), well_formed=well_formed(outs, len(done), n_new, vocab))


def child_main(args) -> None:
    """Load one side, say hello, then answer each command line on stdin with one JSON line."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (ours or llama.cpp's C code) go to stderr, never into the protocol

    def send(obj):
        proto.write(json.dumps(obj) + "\n")

    with open(args.workload) as f:
        workload = json.load(f)
    try:
        if args.child == "ours":
            side = OursSide(args.threads, parse_kv(args.ours_arg) | parse_kv(args.variant_arg))
        else:
            side = LlamaCppSide(workload["gguf"], args.threads, args.llama_path, parse_kv(args.llamacpp_arg))
        send({"ready": True, "info": side.info()})
    except Exception:  # noqa: BLE001 - reported to the parent, which stops
        send({"error": traceback.format_exc()})
        return
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "info":  # at the end: includes what was set up during the run
            send({"info": side.info()})
            continue
        try:
            send(side.run(msg["section"], workload["sections"][msg["section"]], msg["cmd"] == "warmup"))
        except Exception:  # noqa: BLE001
            send({"error": traceback.format_exc()})
    side.close()


# The parent ----------------------------------------------------------------------------------------------------
def parse_value(v: str):
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def parse_kv(items: list[str] | None) -> dict:
    """``key=value`` strings -> kwargs (ints, floats and true/false parsed; anything else a string)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected key=value, got {item!r}")
        out[key.replace("-", "_")] = parse_value(value)
    return out


def say(msg: str) -> None:
    print(f"[cpu peers] {msg}", file=sys.stderr, flush=True)


class Child:
    """One side's child process and its line protocol."""

    def __init__(self, side: str, args, workload_path: str, llama_path: str | None):
        cmd = [sys.executable, "-m", "benchmarks.peers.cpu", "--child", "ours" if side == VARIANT else side,
               "--workload", workload_path, "--threads", str(args.threads)]
        cmd += [f"--ours-arg={a}" for a in args.ours_arg or []]
        cmd += [f"--variant-arg={a}" for a in (args.variant_arg or []) if side == VARIANT]
        cmd += [f"--llamacpp-arg={a}" for a in args.llamacpp_arg or []]
        if llama_path:
            cmd += ["--llama-path", llama_path]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        self.side = side
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env=env)
        self.info = self._read()["info"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side} child exited (rc {self.proc.wait()}) without answering")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the {self.side} child failed:\n{reply['error']}")
        return reply

    def call(self, cmd: str, section: str) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, "section": section}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.info = self.call("info", "")["info"]
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()


def headline(section: str, res: dict) -> str:
    key = {"decode1": "decode_tok_per_s", "batch16": "output_tok_per_s"}.get(section, "requests_per_s")
    if all(isinstance(v, dict) for v in res.values()):
        return ", ".join(f"{k} {fmt(v.get(key))}" for k, v in res.items())
    return f"{key} {fmt(res.get(key))}"


def run_rounds(children: dict, sections: list[str], rounds: int) -> dict:
    """Warm every section up on every side, then ``rounds`` rounds, the order of the sides reversed every other
    round."""
    sides = tuple(children)
    raw = {s: {side: [] for side in sides} for s in sections}
    for s in sections:
        for side in sides:
            say(f"warm-up {s} {side}")
            children[side].call("warmup", s)
    for r in range(rounds):
        for s in sections:
            for side in (sides if r % 2 == 0 else sides[::-1]):
                time.sleep(SWITCH_PAUSE_S)
                res = children[side].call("run", s)
                raw[s][side].append(res)
                say(f"round {r + 1}/{rounds} {s} {side}: {headline(s, res)}")
    return raw


def git_version() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info(threads: int, loadavg_start: list[float]) -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return dict(cpu_model=model, cpu_count=os.cpu_count(), cpus_allowed=len(os.sched_getaffinity(0)),
                threads=threads, platform=platform.platform(), python=platform.python_version(),
                loadavg_start=loadavg_start, loadavg_end=list(os.getloadavg()))


def first_ids_check(raw_decode1: dict) -> dict:
    a, b = raw_decode1["ours"][-1]["first_ids"], raw_decode1["llamacpp"][-1]["first_ids"]
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a),
                                                                                                        len(b)))
    return dict(equal=a == b, first_diff=diff, ours=a, llamacpp=b)


def build_result(args, workloads: dict, raw: dict, infos: dict, started: dt.datetime, load0: list) -> dict:
    import torch

    sections = {}
    for s, per_side in raw.items():
        sec = summarize_section(s, per_side["ours"], per_side["llamacpp"])
        sec["params"] = {k: v for k, v in workloads[s].items() if not isinstance(v, list)}
        if s == "decode1":
            sec["first_ids"] = first_ids_check(per_side)
        if VARIANT in per_side:
            variant = summarize_section(s, per_side[VARIANT], per_side["llamacpp"])
            sec[VARIANT] = variant["ours"]
            sec["ratio_variant_over_llamacpp"] = variant["ratio_ours_over_llamacpp"]
            sec["ratio_variant_over_ours"] = {key: ratio(v, sec["ours"]["median"].get(key))
                                              for key, v in sec[VARIANT]["median"].items() if not isinstance(v, bool)}
            if s == "decode1":
                sec["first_ids_variant"] = first_ids_check({"ours": per_side[VARIANT],
                                                            "llamacpp": per_side["llamacpp"]})
        sections[s] = sec
    return dict(benchmark="cpu_peers", model="SmolLM2-135M-Instruct Q4_1 (GGUF)", gguf=workloads["gguf"],
                date=started.strftime("%Y-%m-%d %H:%M"), smoke=args.smoke, rounds=args.rounds,
                machine=machine_info(args.threads, load0),
                versions=dict(ours=git_version(), torch=torch.__version__,
                              llama_cpp=infos["llamacpp"].get("version")),
                ours_args=parse_kv(args.ours_arg), llamacpp_args=parse_kv(args.llamacpp_arg),
                variant_args=parse_kv(args.variant_arg),
                side_info=infos, sections=sections)


def write_outputs(result: dict, out: str) -> None:
    from benchmarks.common import write_json

    write_json(result, out + ".json")
    with open(out + ".md", "w") as f:
        f.write(render_markdown(result))
    plot(result, out + ".png")
    say(f"wrote {out}.json, {out}.md, {out}.png")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_peers_smollm2"),
                   help="output stem: writes OUT.json, OUT.md, OUT.png")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rounds", type=int, default=None, help="default 3 (smoke: 1)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--ours-arg", action="append", default=[], help="extra Engine/ServerArgs kwarg, key=value")
    p.add_argument("--llamacpp-arg", action="append", default=[], help="extra Llama(...) kwarg, key=value")
    p.add_argument("--variant-arg", action="append", default=[],
                   help="a third side: ours with these extra Engine/ServerArgs kwargs, key=value")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--llama-path", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 3
    args.out = args.out[:-5] if args.out.endswith(".json") else args.out
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    from transformers import AutoTokenizer

    from benchmarks.peers.llamacpp_side import ensure_llama_cpp
    from sglang_backend.runtime.model_loader.embedded import default_model_path, embedded_gguf_path

    started, load0 = dt.datetime.now(), list(os.getloadavg())  # load: other work on the machine skews timings
    llama_path = ensure_llama_cpp()  # before anything is timed: may build for ~20 minutes
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    workloads = build_workloads(tokenizer, SMOKE if args.smoke else FULL, sections)
    workloads["gguf"] = embedded_gguf_path()
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="cpu_peers_", delete=False) as f:
        json.dump({"gguf": workloads["gguf"], "sections": {s: workloads[s] for s in sections}}, f)
    children = {}
    try:
        for side in SIDES + ((VARIANT,) if args.variant_arg else ()):
            say(f"starting the {side} child ({args.threads} threads)")
            children[side] = Child(side, args, f.name, llama_path)
        raw = run_rounds(children, sections, args.rounds)
    finally:
        for c in children.values():
            c.close()
        os.unlink(f.name)
    result = build_result(args, workloads, raw, {k: c.info for k, c in children.items()}, started, load0)
    write_outputs(result, args.out)
    print(render_markdown(result))


if __name__ == "__main__":
    main()
