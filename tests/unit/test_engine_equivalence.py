"""Greedy outputs and logprobs of our engine equal HF transformers' (CPU, fp32), token for token."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import make_engine

NEW_TOKENS = 32


def random_prompts(vocab: int, lengths=(5, 17, 33, 64, 120), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def smollm_prompts(tokenizer) -> list[list[int]]:
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Why is the sky blue? Answer briefly.",
        "Translate 'good morning' into Spanish.",
    ]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return [tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("which", ["tiny_gqa_dir", "tiny_tied_dir", "tiny_llama3_dir", "tiny_qwen3_dir",
                                   "tiny_qwen3_moe_dir", "tiny_mixtral_dir", "tiny_gemma3_dir", "tiny_quantized_dir",
                                   "smollm_dir"])
def test_greedy_matches_hf_single_and_batch(which, request, hf_model_cache):
    path = request.getfixturevalue(which)
    hf = hf_model_cache(path)
    engine = make_engine(path)
    try:
        prompts = smollm_prompts(engine.tokenizer) if which == "smollm_dir" else random_prompts(hf.config.vocab_size)
        expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
        # One request at a time.
        singles = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        assert singles == expected
        engine.flush_cache()
        # One mixed-length batch (no cache: every prompt computed fresh in one extend batch).
        batch = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert batch == expected
        # Again with everything cached: outputs must not change.
        cached = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in cached] == expected
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in cached)
        engine.check_pool_whole()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("which", ["tiny_gqa_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_mixtral_dir",
                                   "tiny_gemma3_dir", "tiny_quantized_dir", "smollm_dir"])
def test_logprobs_match_hf(which, request, hf_model_cache):
    path = request.getfixturevalue(which)
    hf = hf_model_cache(path)
    engine = make_engine(path)
    try:
        prompt = smollm_prompts(engine.tokenizer)[0] if which == "smollm_dir" else random_prompts(hf.config.vocab_size)[3]
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
        meta = out["meta_info"]
        full = prompt + out["output_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
        # Prompt: token i scored by the logits at i - 1; the first token has none.
        inp = meta["input_token_logprobs"]
        assert len(inp) == len(prompt) and inp[0][0] is None
        for i in range(1, len(prompt)):
            assert inp[i][1] == prompt[i]
            assert abs(inp[i][0] - ref[i - 1, prompt[i]].item()) < 1e-4
        outp = meta["output_token_logprobs"]
        assert len(outp) == len(out["output_ids"])
        for j, (lp, tok, _) in enumerate(outp):
            pos = len(prompt) - 1 + j
            assert tok == full[pos + 1]
            assert abs(lp - ref[pos, tok].item()) < 1e-4
        # Top-k logprobs are the k best of the reference distribution.
        top = meta["output_top_logprobs"][0]
        ref_vals, ref_ids = ref[len(prompt) - 1].topk(3)
        assert [t[1] for t in top] == ref_ids.tolist()
        assert all(abs(t[0] - v) < 1e-4 for t, v in zip(top, ref_vals.tolist()))

        # A later logprob_start_len still reuses the cached prefix before it, and the values agree.
        start = len(prompt) // 2
        again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0},
                                return_logprob=True, logprob_start_len=start)
        assert again["meta_info"]["cached_tokens"] == start - 1
        inp2 = again["meta_info"]["input_token_logprobs"]
        assert len(inp2) == len(prompt) - start
        for k, (lp, tok, _) in enumerate(inp2):
            i = start + k
            assert tok == prompt[i] and abs(lp - ref[i - 1, prompt[i]].item()) < 1e-4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("engine_kwargs", [dict(chunked_prefill_size=16), dict(page_size=4),
                                           dict(page_size=4, chunked_prefill_size=16),
                                           dict(chunked_prefill_size=16, enable_mixed_chunk=True)], ids=str)
@pytest.mark.parametrize("which", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_gemma3_dir", "tiny_quantized_dir"])
def test_qwen3_matches_hf_chunked_and_paged(engine_kwargs, which, request, hf_model_cache):
    """Qwen3's q/k norms, the experts and Gemma 3's sliding windows (8 tokens, shorter than a chunk) hold under
    chunked prefill (16 tokens at a time), 4-token pages and mixed chunks (the running requests decode inside
    the prefill batches, as one-token extends)."""
    path = request.getfixturevalue(which)
    hf = hf_model_cache(path)
    prompts = random_prompts(hf.config.vocab_size, seed=1)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    engine = make_engine(path, **engine_kwargs)
    try:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)] == expected
        again = engine.generate(input_ids=prompts, sampling_params=params)  # over the cached prefixes
        assert [o["output_ids"] for o in again] == expected
        if engine_kwargs.get("enable_mixed_chunk"):
            assert engine.get_stats()["num_mixed_batches"] > 0
        engine.check_pool_whole()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model_fixture", ["tiny_gemma3_dir", "tiny_mistral_window_dir", "tiny_qwen3_window_dir"])
def test_window_over_cached_prefix(model_fixture, request, hf_model_cache):
    """A cached prefix of 40 tokens (five windows of 8) extended by suffixes shorter and longer than the window:
    global layers attend the whole prefix, local ones only its last positions, as HF's full recomputation
    (Gemma 3 and Qwen3 with use_sliding_window interleave both kinds; Mistral windows every layer)."""
    model_dir = request.getfixturevalue(model_fixture)
    hf = hf_model_cache(model_dir)
    prefix = random_prompts(hf.config.vocab_size, lengths=(40,), seed=2)[0]
    suffixes = random_prompts(hf.config.vocab_size, lengths=(1, 3, 8, 9, 20), seed=3)
    prompts = [prefix + s for s in suffixes]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    engine = make_engine(model_dir)
    try:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
        engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1, "temperature": 0})
        singles = [engine.generate(input_ids=p, sampling_params=params) for p in prompts[:2]]
        assert all(o["meta_info"]["cached_tokens"] >= len(prefix) for o in singles)
        batch = engine.generate(input_ids=prompts[2:], sampling_params=params)  # one extend batch over the prefix
        assert all(o["meta_info"]["cached_tokens"] >= len(prefix) for o in batch)
        assert [o["output_ids"] for o in singles + batch] == expected
        engine.check_pool_whole()
    finally:
        engine.shutdown()
