"""Projected vision features by image hash (LRU, bounded in bytes), so a cached image skips the encoder."""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_MAX_BYTES = 1 << 30


class VisionFeatureCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.num_encoded_images = 0  # images that went through the vision encoder (the counter tests read)
        self.num_hits = 0

    def get(self, image_hash: str) -> torch.Tensor | None:
        feats = self._entries.get(image_hash)
        if feats is not None:
            self._entries.move_to_end(image_hash)
            self.num_hits += 1
        return feats

    def put(self, image_hash: str, feats: torch.Tensor) -> None:
        size = feats.numel() * feats.element_size()
        if size > self.max_bytes or image_hash in self._entries:
            return
        while self._bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        self._entries[image_hash] = feats
        self._bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)
