"""The second KV tier: host memory that holds KV the device pool evicted, so a later hit copies it back instead of
computing it again (``--kv-host-size``).

``HostKVPool`` keeps each token's K and V of every layer in one row of a host tensor ``[slots, 2 * layers,
kv_heads, head_dim]`` of the device pool's dtype (so a round trip is bit-identical), pinned when the device is a GPU.
Token-major rows make a node's KV a few contiguous runs of host memory (the free list is handed out lowest slot
first), so a copy is one device gather into a staging tensor, then one transfer per run straight between the
staging tensor and the host rows: no host-side scatter. Which tree node holds which host slots is the radix tree's
business (``RadixCache`` with ``host=``).

Copies run on the device's current stream, in order with the forwards around them: a backup gathers the evicted
slots before any later forward can write them, and a restore lands before the forward that reads it. Neither makes
the host wait on a GPU (pinned memory, non-blocking transfers; the host never reads the rows itself).
"""

from __future__ import annotations

import torch

COPY_CHUNK_BYTES = 64 * 2**20  # one staging tensor on the device, at most


class HostKVPool:
    def __init__(self, device_pool, size: int):
        assert size > 0
        self.device_pool = device_pool
        self.size = size
        self.on_gpu = torch.device(device_pool.device).type == "cuda"
        row = (2 * device_pool.layer_num, device_pool.head_num, device_pool.head_dim)
        self.buffer = torch.zeros((size + 1, *row), dtype=device_pool.dtype, pin_memory=self.on_gpu)  # + slot 0
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64)
        self._sorted = True
        self.written_tokens = 0  # device -> host, cumulative
        self.loaded_tokens = 0  # host -> device, cumulative

    # Slots ----------------------------------------------------------------------------------------------------------
    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> torch.Tensor | None:
        """The ``n`` lowest free slots (ascending: long contiguous runs), or None."""
        if n > len(self.free_slots):
            return None
        if not self._sorted:
            self.free_slots = torch.sort(self.free_slots).values
            self._sorted = True
        slots, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return slots

    def free(self, host_slots: torch.Tensor) -> None:
        if len(host_slots):
            assert int(host_slots.min()) >= 1, "freeing the reserved host slot 0"
            self.free_slots = torch.cat([self.free_slots, host_slots])
            self._sorted = False

    # Copies ---------------------------------------------------------------------------------------------------------
    def _layers(self) -> list[torch.Tensor]:
        dev = self.device_pool
        return dev.k_buffer + dev.v_buffer  # row index i of a host row is this list's i-th buffer

    def _chunks(self, device_slots: torch.Tensor, host_slots: torch.Tensor):
        assert len(device_slots) == len(host_slots)
        step = max(1, COPY_CHUNK_BYTES // (self.buffer[0].numel() * self.buffer.element_size()))
        for i in range(0, len(host_slots), step):
            yield device_slots[i : i + step].to(self.device_pool.device), host_slots[i : i + step]

    @staticmethod
    def _runs(host_slots: torch.Tensor):
        """(offset in host_slots, first slot, length) of each run of consecutive slots."""
        if len(host_slots) == 0:
            return
        breaks = ((host_slots[1:] - host_slots[:-1]) != 1).nonzero().flatten().add(1).tolist()
        starts = [0] + breaks
        ends = breaks + [len(host_slots)]
        for a, b in zip(starts, ends):
            yield a, int(host_slots[a]), b - a

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copies the KV at ``device_slots`` into the host rows ``host_slots``."""
        layers = self._layers()
        for idx, host_part in self._chunks(device_slots, host_slots):
            staging = torch.stack([buf[idx] for buf in layers], dim=1)  # [n, 2 * layers, heads, dim]
            for offset, first, n in self._runs(host_part):
                self.buffer[first : first + n].copy_(staging[offset : offset + n], non_blocking=self.on_gpu)
        self.written_tokens += len(host_slots)

    def restore(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copies the host rows ``host_slots`` into the KV at ``device_slots``."""
        layers = self._layers()
        for idx, host_part in self._chunks(device_slots, host_slots):
            staging = torch.empty((len(host_part), *self.buffer.shape[1:]), dtype=self.buffer.dtype,
                                  device=self.device_pool.device)
            for offset, first, n in self._runs(host_part):
                staging[offset : offset + n].copy_(self.buffer[first : first + n], non_blocking=self.on_gpu)
            for i, buf in enumerate(layers):
                buf[idx] = staging[:, i]
        self.loaded_tokens += len(host_slots)
