"""Engine.encode: pooled final hidden states (after the final norm) equal HF transformers' (CPU, fp32, atol 1e-5),
last-token and mean pooling, normalized or not, single and batched, through the scheduler (chunked prefill and
the prefix cache included); the KV pool is whole after every test (conftest)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from sglang_backend.runtime.managers.io_struct import PoolingParams
from tests.conftest import make_engine

ATOL = 1e-5


def hf_pooled(model, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """The reference: HF's last hidden state (the decoder's output after its final norm), pooled."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def random_prompts(vocab: int, lengths=(1, 5, 17, 64), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    assert torch.allclose(torch.tensor(got), expected, atol=ATOL, rtol=0), \
        f"max abs diff {(torch.tensor(got) - expected).abs().max().item():.2e}"


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_tiny_model_matches_hf(tiny_engine, tiny_gqa_dir, hf_model_cache, pooling, normalize):
    hf = hf_model_cache(tiny_gqa_dir)
    prompts = random_prompts(hf.config.vocab_size)
    expected = [hf_pooled(hf, p, pooling, normalize) for p in prompts]
    for p, want in zip(prompts, expected):  # one at a time
        out = tiny_engine.encode(input_ids=p, pooling=pooling, normalize=normalize)
        assert out["meta_info"]["prompt_tokens"] == len(p)
        assert_close(out["embedding"], want)
    batch = tiny_engine.encode(input_ids=prompts, pooling=pooling, normalize=normalize)  # one extend batch
    assert len(batch) == len(prompts)
    for out, want in zip(batch, expected):
        assert_close(out["embedding"], want)
    if normalize:
        assert abs(torch.tensor(batch[-1]["embedding"]).norm().item() - 1) < 1e-5


def test_cached_prefix_and_generation_in_the_same_batch(tiny_engine, tiny_gqa_dir, hf_model_cache):
    """Mean pooling computes every token even when the prompt is cached; last-token pooling over a cached prefix
    is still the same vector; an embedding batched with generation requests leaves them unchanged."""
    hf = hf_model_cache(tiny_gqa_dir)
    prompt = random_prompts(hf.config.vocab_size, lengths=(40,), seed=1)[0]
    params = {"max_new_tokens": 6, "temperature": 0}
    alone = tiny_engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    for pooling in ("mean", "last"):  # the prompt is now in the radix tree
        assert_close(tiny_engine.encode(input_ids=prompt, pooling=pooling)["embedding"],
                     hf_pooled(hf, prompt, pooling, True))
    results = {}

    def run_generate():
        results["gen"] = tiny_engine.generate(input_ids=prompt[:30] + [7, 8], sampling_params=params)

    t = threading.Thread(target=run_generate)
    t.start()
    emb = tiny_engine.encode(input_ids=[prompt, prompt[:10]], pooling="mean")
    t.join()
    assert_close(emb[1]["embedding"], hf_pooled(hf, prompt[:10], "mean", True))
    assert len(results["gen"]["output_ids"]) == 6
    assert tiny_engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == alone


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_prefill_pools_the_whole_prompt(tiny_gqa_dir, hf_model_cache, pooling):
    hf = hf_model_cache(tiny_gqa_dir)
    prompt = random_prompts(hf.config.vocab_size, lengths=(50,), seed=2)[0]
    engine = make_engine(tiny_gqa_dir, chunked_prefill_size=16, embedding_pooling=pooling)
    try:
        out = engine.encode(input_ids=prompt)  # the pooling comes from the engine's embedding_pooling
        assert_close(out["embedding"], hf_pooled(hf, prompt, pooling, True))
        assert engine.get_stats()["num_chunked_prefill_batches"] >= 3
        engine.check_pool_whole()
    finally:
        engine.shutdown()


def test_smollm_matches_hf(smollm_engine, smollm_dir, hf_model_cache):
    hf = hf_model_cache(smollm_dir)
    texts = ["The capital of France is Paris.", "Embeddings map text to vectors."]
    outs = smollm_engine.encode(texts, pooling="mean")
    for text, out in zip(texts, outs):
        ids = smollm_engine.tokenizer.encode(text)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert_close(out["embedding"], hf_pooled(hf, ids, "mean", True))
    one = smollm_engine.encode(texts[0])  # single prompt: one dict; default pooling "last"
    assert_close(one["embedding"], hf_pooled(hf, smollm_engine.tokenizer.encode(texts[0]), "last", True))


def test_bad_arguments_raise_before_anything_runs(tiny_engine):
    with pytest.raises(ValueError, match="pooling must be one of"):
        tiny_engine.encode(input_ids=[1, 2], pooling="max")
    with pytest.raises(ValueError, match="empty"):
        tiny_engine.encode(input_ids=[])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_engine.encode(input_ids=[1, 10**6])
    with pytest.raises(ValueError, match="exactly one"):
        tiny_engine.encode()
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams("last", normalize="yes")


def test_mean_pooled_prompts_sharing_a_prefix_run_in_one_batch(tiny_engine, tiny_gqa_dir, hf_model_cache):
    """In-batch prefix dedup holds a request back a round to reuse a prefix another one computes; mean pooling
    reuses no prefix, so prompts sharing a long one (an instruction, say) are not serialized one per round."""
    hf = hf_model_cache(tiny_gqa_dir)
    shared = random_prompts(hf.config.vocab_size, lengths=(48,), seed=3)[0]
    prompts = [shared + tail for tail in ([5], [6, 7], [8], [9, 10, 11])]
    before = tiny_engine.get_stats()["num_prefill_batches"]
    outs = tiny_engine.encode(input_ids=prompts, pooling="mean")
    assert tiny_engine.get_stats()["num_prefill_batches"] == before + 1
    for p, out in zip(prompts, outs):
        assert_close(out["embedding"], hf_pooled(hf, p, "mean", True))
