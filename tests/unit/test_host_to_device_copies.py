"""The host-to-device copies of a forward's index data (on the CPU here the "device" is the CPU, and the code paths
are the same ones):

* MirroredReqToTokenPool: the device copy of the request-to-slot table equals the host table after every sync,
  whatever mix of spans (prompts, cached prefixes, chunks) and single tokens (decode steps) was written since the
  last one;
* upload_int64: one buffer, each vector a 16-byte-aligned view holding its values."""

from __future__ import annotations

import random

import torch

from sglang_backend.runtime.mem_cache.memory_pool import MirroredReqToTokenPool
from sglang_backend.runtime.model_executor.forward_batch import upload_int64


def test_device_table_follows_every_write():
    rng = random.Random(7)
    pool = MirroredReqToTokenPool(size=9, max_context_len=300, device="cpu")
    for step in range(60):
        kind = rng.choice(["spans", "tokens", "mixed", "nothing"])
        if kind in ("spans", "mixed"):
            for _ in range(rng.randint(1, 5)):
                row, start = rng.randrange(9), rng.randrange(290)
                n = rng.randint(0, 300 - start)
                pool.write(row, start, torch.randint(1, 10_000, (n,)))
        if kind in ("tokens", "mixed"):
            rows = torch.tensor(rng.sample(range(9), rng.randint(1, 9)))
            cols = torch.randint(0, 300, (len(rows),))
            pool.write_tokens(rows, cols, torch.randint(1, 10_000, (len(rows),)))
        pool.sync_to_device()
        assert torch.equal(pool.device_table, pool.req_to_token), (step, kind)
        assert pool._pending == []


def test_overlapping_spans_keep_the_last_write():
    pool = MirroredReqToTokenPool(size=2, max_context_len=16, device="cpu")
    pool.write(1, 0, torch.arange(1, 11))
    pool.write(1, 4, torch.full((3,), 99))
    pool.write_tokens(torch.tensor([1]), torch.tensor([5]), torch.tensor([7]))
    pool.sync_to_device()
    assert pool.device_table[1, :10].tolist() == [1, 2, 3, 4, 99, 7, 99, 8, 9, 10]
    assert torch.equal(pool.device_table, pool.req_to_token)


def test_upload_int64_views_are_aligned_and_exact():
    parts = [[5, 6, 7], torch.tensor([1, 2], dtype=torch.int32), [], torch.arange(9), [3]]
    out = upload_int64(parts, "cpu")
    assert [t.tolist() for t in out] == [[5, 6, 7], [1, 2], [], list(range(9)), [3]]
    assert all(t.dtype == torch.int64 for t in out)
    assert all(t.storage_offset() * t.element_size() % 16 == 0 for t in out)
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1  # one copy
