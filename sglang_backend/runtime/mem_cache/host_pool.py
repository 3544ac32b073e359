"""The second KV tier: host memory that holds KV the device pool evicted, so a later hit copies it back instead of
computing it again (``--kv-host-size``).

``HostKVPool`` mirrors the device pool's layout (per layer, K and V, ``[slots, kv_heads, head_dim]``, the same dtype,
so a round trip is bit-identical) in CPU memory, pinned when the device is a GPU. Host slots are handed out one token
at a time from a free list (slot 0 reserved, as on the device); which tree node holds which host slots is the radix
tree's business (``RadixCache`` with ``host=``).

Copies run on the device's current stream, in order with the forwards around them: a backup reads the evicted slots
before any later forward can write them, and a restore lands before the forward that reads it. A backup waits for
its data (the host copy must be whole before the slots are reused); a restore from pinned memory does not block the
host.
"""

from __future__ import annotations

import torch

from .memory_pool import TokenToKVPoolAllocator

COPY_CHUNK_BYTES = 64 * 2**20  # one transfer's staging tensor, at most (all layers of a chunk of tokens)


class HostKVPool:
    def __init__(self, device_pool, size: int):
        assert size > 0
        self.device_pool = device_pool
        self.size = size
        self.allocator = TokenToKVPoolAllocator(size, 1, "cpu")
        pin = torch.device(device_pool.device).type == "cuda"
        shape = (size + 1, device_pool.head_num, device_pool.head_dim)  # + slot 0, never handed out
        self.k_buffer = [torch.zeros(shape, dtype=device_pool.dtype, pin_memory=pin) for _ in range(device_pool.layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=device_pool.dtype, pin_memory=pin) for _ in range(device_pool.layer_num)]
        self.written_tokens = 0  # device -> host, cumulative
        self.loaded_tokens = 0  # host -> device, cumulative

    def available_size(self) -> int:
        return self.allocator.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free(self, host_slots: torch.Tensor) -> None:
        self.allocator.free(host_slots)

    @staticmethod
    def bytes_per_token(device_pool) -> int:
        return device_pool.bytes_per_token(device_pool.head_num, device_pool.head_dim, device_pool.layer_num,
                                           device_pool.dtype)

    def _buffers(self):
        """(host, device) buffer pairs: every layer's K, then every layer's V."""
        dev = self.device_pool
        return list(zip(self.k_buffer + self.v_buffer, dev.k_buffer + dev.v_buffer))

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copies the KV at ``device_slots`` into ``host_slots``; returns once the host copy is whole (the device
        slots are freed next). All layers travel in one transfer."""
        pairs = self._buffers()
        for dev_part, host_part in self._chunks(device_slots, host_slots):
            idx = dev_part.to(self.device_pool.device)
            rows = torch.stack([device[idx] for _, device in pairs]).to("cpu")
            for (host, _), layer_rows in zip(pairs, rows):
                host[host_part] = layer_rows
        self.written_tokens += len(host_slots)

    def restore(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copies the KV at ``host_slots`` into ``device_slots``, queued on the device's stream (from pinned memory
        on a GPU: the host does not wait). All layers travel in one transfer."""
        dev = self.device_pool
        pairs = self._buffers()
        for host_part, dev_part in self._chunks(host_slots, device_slots):
            rows = torch.stack([host[host_part] for host, _ in pairs])
            if torch.device(dev.device).type == "cuda":
                rows = rows.pin_memory().to(dev.device, non_blocking=True)
            idx = dev_part.to(dev.device)
            for (_, device), layer_rows in zip(pairs, rows):
                device[idx] = layer_rows
        self.loaded_tokens += len(host_slots)

    def _chunks(self, src: torch.Tensor, dst: torch.Tensor):
        assert len(src) == len(dst)
        step = max(1, COPY_CHUNK_BYTES // self.bytes_per_token(self.device_pool))
        for i in range(0, len(src), step):
            yield src[i : i + step], dst[i : i + step]
