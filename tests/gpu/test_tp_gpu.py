"""Tensor parallelism on 2 GPUs (NCCL): TP=2 gives TP=1's greedy outputs with the triton backend, CUDA graphs
on (NCCL collectives captured in the decode graphs, replayed by every rank) and off; the KV pool is whole
afterwards; rank 0 hands every step to the follower without a device sync (CUDA sync debug mode "warn"
around it, counted); the follower leaves promptly with exit code 0 (an exit header, then both ranks tear the
NCCL communicators down together: a rank waiting for the other to exit first would hang until killed)."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)


@pytest.fixture(scope="module")
def peaked_gqa_dir(tmp_path_factory):
    """Small GQA Llama with clear logit winners (init std 0.2): greedy is insensitive to rounding-level
    differences in the all-reduce order."""
    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model

    out = str(tmp_path_factory.mktemp("tp_gpu"))
    cfg = dummy_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048, initializer_range=0.2)
    return save_dummy_hf_model(cfg, out, seed=0)


def _run(path: str, tp: int, graphs: bool, overlap: bool) -> list[list[int]]:
    from sglang_backend import Engine

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 1000, (200,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 50)]
    prompts += [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 300)]
    eng = Engine(model_path=path, device="cuda", dtype="float32", attention_backend="triton", tp_size=tp,
                 disable_cuda_graph=not graphs, disable_overlap_schedule=not overlap, max_running_requests=8,
                 max_total_tokens=8192, check_pool_on_idle=True, log_level="warning")
    assert (eng.scheduler.overlap is not None) == overlap
    followers = eng.scheduler.model_runner.tp_followers
    procs = list(followers.procs) if followers is not None else []
    syncs = _sends_must_not_sync(followers) if followers is not None else []
    try:
        sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        out.append(eng.generate(input_ids=prompts[3], sampling_params=sp))  # batch 1: the GEMV path
        assert not syncs, f"rank 0 synced with the device while sending a step: {syncs[0]}"
        eng.check_pool_whole()
    finally:
        t0 = time.monotonic()
        eng.shutdown()
    assert [p.wait(timeout=30) for p in procs] == [0] * (tp - 1)
    assert time.monotonic() - t0 < 20, "tensor-parallel shutdown took too long"
    return [o["output_ids"] for o in out]


def _sends_must_not_sync(followers) -> list[str]:
    """Records each device sync rank 0 makes while sending a step (CUDA sync debug mode "warn"; from the second
    step on: the first may set up the NCCL communicator). Warnings, not errors: an exception half-way through a
    step would leave the follower waiting for the rest of it."""
    send, calls, syncs = followers.send_forward, [0], []

    def checked(*args):
        calls[0] += 1
        if calls[0] == 1:
            return send(*args)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                send(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))

    followers.send_forward = checked
    return syncs


@pytest.mark.parametrize("graphs,overlap", [(False, False), (True, False), (True, True)],
                         ids=["eager", "graphs", "graphs-overlap"])
def test_tp2_matches_tp1_on_gpu(peaked_gqa_dir, graphs, overlap):
    """fp32 greedy, a batch of 4 (cascade decode over a shared prefix) then one request alone (batch-1 GEMVs with
    the row-parallel all-reduce); overlapped decode is the GPU default at every tp size."""
    assert _run(peaked_gqa_dir, 2, graphs, overlap) == _run(peaked_gqa_dir, 1, graphs, overlap)
