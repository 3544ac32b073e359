"""The second KV tier: host memory that holds KV the device pool evicted, so a later hit copies it back instead of
computing it again (``--kv-host-size``).

``HostKVPool`` keeps each token's K and V of every layer in one row of a host tensor ``[slots, 2 * layers,
kv_heads, head_dim]`` of the device pool's dtype (so a round trip is bit-identical), pinned when the device is a GPU.
Token-major rows make a node's KV a few contiguous runs of host memory (the free list is handed out lowest slot
first), so a copy is one device gather into a staging tensor, then one transfer per run straight between the
staging tensor and the host rows: no host-side scatter. Which tree node holds which host slots is the radix tree's
business (``RadixCache`` with ``host=``).

On a GPU the transfers run on a copy stream of their own, overlapped with the forwards, while the device-side
gather and scatter stay on the compute stream, in order with the forwards around them: a backup gathers the evicted
slots into a staging tensor before any later forward can write them and its transfer to the host runs meanwhile;
a restore's transfer starts at once (it overlaps the forward in flight), and the compute stream waits for it only
before scattering the rows into the pool; or (an asynchronous load, ``wait=False``) the scatter runs on the copy
stream as well and the caller keeps the request out of the forwards until the returned event is done. One copy
stream keeps a host row's writes and reads in order. The host never waits, except to bound the staging memory of
backups still in transfer (``MAX_STAGED_BYTES``).
"""

from __future__ import annotations

from collections import deque

import torch

COPY_CHUNK_BYTES = 256 * 2**20  # one staging tensor on the device, at most
MAX_STAGED_BYTES = 1 * 2**30  # device memory of backups' staging tensors still in transfer, at most


class HostKVPool:
    def __init__(self, device_pool, size: int):
        assert size > 0
        self.device_pool = device_pool
        self.size = size
        self.on_gpu = torch.device(device_pool.device).type == "cuda"
        row = (2 * device_pool.layer_num, device_pool.head_num, device_pool.head_dim)
        # Uninitialised: a row is always written before it is read (zeroing tens of GiB of pinned memory takes seconds).
        self.buffer = torch.empty((size + 1, *row), dtype=device_pool.dtype, pin_memory=self.on_gpu)  # + slot 0
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64)
        self._sorted = True
        self.copy_stream = torch.cuda.Stream(device=device_pool.device) if self.on_gpu else None
        self._staged: deque[tuple[torch.cuda.Event, int]] = deque()  # backups in transfer: (done, staging bytes)
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
        slots, self.free_slots = self.free_slots[:n].clone(), self.free_slots[n:]  # own storage: nodes keep it
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
            yield self._on_device(device_slots[i : i + step]), host_slots[i : i + step]

    def _on_device(self, slots: torch.Tensor) -> torch.Tensor:
        """The slot indices on the pool's device. On a GPU through pinned memory, without blocking: a plain upload
        from pageable memory would wait for every forward queued on the stream."""
        if not self.on_gpu:
            return slots
        pinned = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)  # PyTorch's caching host allocator
        pinned.copy_(slots)
        return pinned.to(self.device_pool.device, non_blocking=True)

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
            if self.copy_stream is None:
                self._copy_runs(host_part, staging, to_host=True)
                continue
            self._bound_staged(staging.numel() * staging.element_size())
            self.copy_stream.wait_stream(torch.cuda.current_stream())  # after the gather
            with torch.cuda.stream(self.copy_stream):
                self._copy_runs(host_part, staging, to_host=True)
            staging.record_stream(self.copy_stream)  # not reused before its transfer is done
            done = torch.cuda.Event()
            done.record(self.copy_stream)
            self._staged.append((done, staging.numel() * staging.element_size()))
        self.written_tokens += len(host_slots)

    def _bound_staged(self, more: int) -> None:
        while self._staged and self._staged[0][0].query():
            self._staged.popleft()
        while self._staged and sum(b for _, b in self._staged) + more > MAX_STAGED_BYTES:
            self._staged.popleft()[0].synchronize()

    def _copy_runs(self, host_slots: torch.Tensor, staging: torch.Tensor, to_host: bool) -> None:
        for offset, first, n in self._runs(host_slots):
            if to_host:
                self.buffer[first : first + n].copy_(staging[offset : offset + n], non_blocking=self.on_gpu)
            else:
                staging[offset : offset + n].copy_(self.buffer[first : first + n], non_blocking=self.on_gpu)

    def restore(self, host_slots: torch.Tensor, device_slots: torch.Tensor, wait: bool = True):
        """Copies the host rows ``host_slots`` into the KV at ``device_slots``. ``wait``: the compute stream waits for
        the copy before anything queued after this call (a forward may read the slots at once). Else (a load that
        nothing reads until it is done) the rows are scattered on the copy stream too, after the compute work
        queued so far (it may still gather the freshly evicted slots), and the returned event says when they are
        in place; the forwards queued meanwhile run beside the copy."""
        layers = self._layers()
        shape = self.buffer.shape[1:]
        main = torch.cuda.current_stream() if self.copy_stream is not None else None
        for idx, host_part in self._chunks(device_slots, host_slots):
            if main is None:
                staging = torch.empty((len(host_part), *shape), dtype=self.buffer.dtype)
                self._copy_runs(host_part, staging, to_host=False)
                self._scatter(layers, idx, staging)
                continue
            with torch.cuda.stream(self.copy_stream):  # starts now, beside the forward in flight
                staging = torch.empty((len(host_part), *shape), dtype=self.buffer.dtype, device=idx.device)
                self._copy_runs(host_part, staging, to_host=False)
            if wait:
                main.wait_stream(self.copy_stream)
                staging.record_stream(main)  # the scatter below reads it on the compute stream
                self._scatter(layers, idx, staging)
            else:
                # After the compute work queued so far and after idx's upload, which is queued on the compute
                # stream too (behind a forward in flight, maybe): the scatter must not read idx before it lands.
                queued = torch.cuda.Event()
                queued.record(main)
                self.copy_stream.wait_event(queued)
                idx.record_stream(self.copy_stream)  # made on the compute stream, read on the copy stream
                with torch.cuda.stream(self.copy_stream):
                    self._scatter(layers, idx, staging)
        self.loaded_tokens += len(host_slots)
        if wait:
            return None
        if main is None:
            return COPIED  # a CPU copy is done when the call returns
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return done

    @staticmethod
    def _scatter(layers: list[torch.Tensor], idx: torch.Tensor, staging: torch.Tensor) -> None:
        for i, buf in enumerate(layers):
            buf[idx] = staging[:, i]


class _Copied:
    """A finished copy, as an event: what ``restore(wait=False)`` returns on the CPU."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        pass


COPIED = _Copied()
