"""LLaVA-bench-like workload: N questions over M images (M << N), our Engine vs HF transformers ``generate``.

Each question is ``USER: <image>\\n<question> ASSISTANT:`` about image ``j % M`` (random-noise PNGs, sent as
encoded bytes so every system decodes and preprocesses them). Every question generates exactly
``--max-new-tokens`` tokens greedily (``min_new_tokens = max_new_tokens`` for both systems, so EOS cannot end a
request early). Systems, run one after the other in one process, the GPU memory freed in between:

* ``hf``        HF ``LlavaForConditionalGeneration.generate`` in batches of ``--hf-batch-size`` (left padding);
                every request's image is preprocessed and encoded again (no cross-request reuse).
* ``ours``      our Engine, all N questions in one ``generate`` call: image-hash radix keys share the KV of
                ``BOS USER: <image>`` across questions on the same image; the vision-feature cache skips the encoder.
* ``ours_no_radix``       the same with the radix cache off (vision features still cached and shared).
* ``ours_unique_images``  radix cache on, but every question's image differs from all others in one pixel:
                          nothing image-related can be shared (no KV, no features), i.e. the image cache off
                          at equal work. Near-identical images must never collide, so this also shows they don't.

Reported per system: total seconds, questions/s, output tokens/s, and for ours the cache hit rate and the
number of images that went through the vision encoder. Ratios are throughput over HF's.

    python -m benchmarks.bench_llava --smoke                      # tiny CPU model (CI); checks ours == HF tokens
    python -m benchmarks.bench_llava --model llava-7b --device cuda   # dummy LLaVA-1.5-7B shapes, bf16 (H100)

Models are built locally (``models/llava.py``: CLIP ViT-L/14-336 + Llama-2-7B shapes); nothing is downloaded.
The tiny and small (CPU-sized, 256 image tokens) models have real (random, seeded) HF weights shared by both
systems, so those runs also check that our greedy tokens equal HF's for the first questions; the 7B one uses
dummy weights (throughput only).
"""

from __future__ import annotations

import argparse
import gc
import io
import logging
import os
import sys
import tempfile
import time

from benchmarks.common import default_output, env_info, format_table, progress, safe_div, write_json

NAME = "llava"
QUESTIONS = ["What is shown in this image?", "Describe the colors in detail.", "Is there any text in the picture?",
             "What might have happened just before this photo was taken?", "Count the distinct objects.",
             "Write a short caption.", "What is unusual about this image?", "Which region is brightest?"]


# Workload ---------------------------------------------------------------------------------------------------------
def build_model(model: str, out_dir: str) -> tuple[str, bool]:
    """(model dir, has weights). Tiny: HF weights saved; 7B: config + tokenizer only (load_format=dummy)."""
    from sglang_backend.runtime.models.llava import dummy_llava_config, llava_7b_config, save_dummy_llava

    if model == "tiny":
        return save_dummy_llava(dummy_llava_config(), out_dir, seed=0), True
    if model == "small":  # CPU-sized: 256 image tokens per image, so image prefill dominates as in LLaVA
        text = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=8, max_position_embeddings=2048, vocab_size=1024)
        vision = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      image_size=224, patch_size=14, projection_dim=128)
        return save_dummy_llava(dummy_llava_config(text, vision), out_dir, seed=0), True
    return save_dummy_llava(llava_7b_config(), out_dir, weights=False), False


def make_images(m: int, size: int, seed: int = 0) -> list[bytes]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(m):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def make_workload(n: int, images: list[bytes]) -> tuple[list[str], list[bytes]]:
    prompts = [f"USER: <image>\n{QUESTIONS[j % len(QUESTIONS)]} (question {j}) ASSISTANT:" for j in range(n)]
    return prompts, [images[j % len(images)] for j in range(n)]


def unique_copies(images: list[bytes]) -> list[bytes]:
    """Question j's image with its first pixel set to a value no other question uses (j < 65536)."""
    import numpy as np
    from PIL import Image

    out = []
    for j, data in enumerate(images):
        arr = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
        arr[0, 0] = [j & 255, (j >> 8) & 255, 255 - arr[0, 0, 2]]
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def sampling(n_tokens: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n_tokens, "min_new_tokens": n_tokens}


# Systems ------------------------------------------------------------------------------------------------------------
def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_ours(model_dir: str, has_weights: bool, prompts, images, args, radix: bool) -> dict:
    from sglang_backend import Engine

    import torch

    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    kwargs = dict(device=args.device, dtype=args.dtype, disable_radix_cache=not radix, log_level="warning",
                  mem_fraction_static=args.mem_fraction_static, random_seed=0,
                  attention_backend="triton" if on_gpu else "torch_native")
    if not has_weights:
        kwargs["load_format"] = "dummy"
    engine = Engine(model_path=model_dir, **kwargs)
    try:
        warm = make_images(1, 64, seed=12345)[0]  # an image outside the workload: warms kernels, caches nothing used
        engine.generate(prompts[0], sampling(2), image_data=warm)
        engine.flush_cache()
        before = engine.get_stats()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sampling(args.max_new_tokens), image_data=images)
        total = time.perf_counter() - t0
        after = engine.get_stats()
    finally:
        engine.shutdown()
        del engine
        free_memory()
    n_out = sum(len(o["output_ids"]) for o in outs)
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return {"total_s": total, "questions_per_s": len(prompts) / total, "output_tokens_per_s": n_out / total,
            "output_tokens": n_out, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "cache_hit_rate": cached / prompt_tokens,
            "vision_encoder_images": after["num_vision_encoder_images"] - before["num_vision_encoder_images"],
            "output_ids_head": [o["output_ids"] for o in outs[: args.check]]}


def hf_inputs(processor, tokenizer, prompt: str, image: bytes):
    """HF's view of one request: ids with the image token repeated over the span, and its pixel values."""
    ids, mm = processor.expand(tokenizer.encode(prompt), image, 1 << 30, 1 << 30)
    for it in mm.items:
        ids[it.offset : it.offset + it.length] = [processor.image_token_id] * it.length
    return ids, mm.items[0].pixel_values


def run_hf(model_dir: str, has_weights: bool, prompts, images, args) -> dict:
    import torch
    from transformers import AutoConfig, LlavaForConditionalGeneration

    from sglang_backend.runtime.model_loader.loader import load_tokenizer
    from sglang_backend.runtime.multimodal import MultimodalProcessor

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else getattr(torch, args.dtype if args.dtype != "auto" else "bfloat16")
    config = AutoConfig.from_pretrained(model_dir)
    if has_weights:
        model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device)
    else:  # random weights at the real shapes, built on the device in the target dtype
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlavaForConditionalGeneration(config)
        finally:
            torch.set_default_dtype(prev)
    model.eval()
    tokenizer = load_tokenizer(model_dir)
    processor = MultimodalProcessor(config, model_dir, tokenizer, allow_local_media=False)
    pad = tokenizer.pad_token_id
    n_tok = args.max_new_tokens

    def generate(batch_prompts, batch_images) -> list[list[int]]:
        rows = [hf_inputs(processor, tokenizer, p, im) for p, im in zip(batch_prompts, batch_images)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r, _ in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r, _ in rows], device=device)
        pixels = torch.stack([pv for _, pv in rows]).to(device, dtype)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=n_tok,
                                 min_new_tokens=n_tok, do_sample=False, pad_token_id=pad)
        return out[:, width:].tolist()

    try:
        generate(prompts[:1], images[:1])  # warm-up
        processor._pixels.clear()  # HF preprocesses every request's image; no cache from the warm-up
        outs = []
        bs = args.hf_batch_size
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for i in progress(range(0, len(prompts), bs), desc="hf", disable=args.no_progress):
            processor._pixels.clear()
            outs += generate(prompts[i : i + bs], images[i : i + bs])
        sync()
        total = time.perf_counter() - t0
        head = [generate([p], [im])[0] for p, im in zip(prompts[: args.check], images[: args.check])]  # unpadded
    finally:
        del model
        free_memory()
    n_out = sum(len(o) for o in outs)
    return {"total_s": total, "questions_per_s": len(prompts) / total, "output_tokens_per_s": n_out / total,
            "output_tokens": n_out, "output_ids_head": head}


# Main -------------------------------------------------------------------------------------------------------------
SYSTEMS = ("hf", "ours", "ours_no_radix", "ours_unique_images")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llava-7b", choices=["tiny", "small", "llava-7b"])
    ap.add_argument("--num-questions", "-N", type=int, default=240)
    ap.add_argument("--num-images", "-M", type=int, default=24)
    ap.add_argument("--image-size", type=int, default=512, help="side of the square source images (pixels)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--check", type=int, default=4, help="questions whose tokens are compared with HF (tiny)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: N=16, M=4, 8 new tokens")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.device = "tiny", "cpu"
        args.num_questions, args.num_images, args.image_size, args.max_new_tokens = 16, 4, 64, 8
        args.hf_batch_size = 4
    logging.basicConfig(level=logging.WARNING)
    systems = [s for s in args.systems.split(",") if s]
    bad = set(systems) - set(SYSTEMS)
    if bad:
        ap.error(f"unknown systems {sorted(bad)}; choose from {SYSTEMS}")

    with tempfile.TemporaryDirectory(prefix="bench-llava-") as tmp:
        model_dir, has_weights = build_model(args.model, tmp)
        prompts, images = make_workload(args.num_questions, make_images(args.num_images, args.image_size))
        results = {}
        for name in systems:
            print(f"[bench_llava] {name} ...", file=sys.stderr, flush=True)
            if name == "hf":
                results[name] = run_hf(model_dir, has_weights, prompts, images, args)
            else:
                run_images = unique_copies(images) if name == "ours_unique_images" else images
                results[name] = run_ours(model_dir, has_weights, prompts, run_images, args, radix=name != "ours_no_radix")
    hf_tps = results.get("hf", {}).get("questions_per_s")
    for name, r in results.items():
        r["speedup_vs_hf"] = safe_div(r["questions_per_s"], hf_tps)
    if "ours" in results:
        for name in ("ours_no_radix", "ours_unique_images"):
            if name in results:
                results[name]["ours_speedup_over_this"] = safe_div(results["ours"]["questions_per_s"],
                                                                   results[name]["questions_per_s"])
    correctness = None
    if has_weights and "hf" in results and "ours" in results:
        correctness = {"questions": args.check,
                       "outputs_match": results["ours"]["output_ids_head"] == results["hf"]["output_ids_head"]}
    data = {"name": NAME, "config": vars(args), "env": env_info(), "results": results, "correctness": correctness}
    rows = [[name, f"{r['total_s']:.2f}", f"{r['questions_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
             "" if r.get("cache_hit_rate") is None else f"{r['cache_hit_rate']:.3f}",
             r.get("vision_encoder_images", ""), "" if r["speedup_vs_hf"] is None else f"{r['speedup_vs_hf']:.2f}x"]
            for name, r in results.items()]
    print(format_table(["system", "total s", "questions/s", "out tok/s", "cache hit", "encoded imgs", "vs hf"], rows))
    if correctness is not None:
        print(f"greedy tokens of the first {args.check} questions equal HF's: {correctness['outputs_match']}")
    out = args.output or default_output(f"{NAME}_{args.model}" + ("_smoke" if args.smoke else ""))
    print(f"wrote {write_json(data, out)}")
    return data


if __name__ == "__main__":
    main()
