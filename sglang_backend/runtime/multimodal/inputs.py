"""What a multimodal request carries to the scheduler, and how an image's content hash becomes radix keys.

The prompt's placeholder span for an image (as many positions as the image has feature vectors) holds
token ids derived from the image's content hash instead of the placeholder token. The radix tree keys on
token ids, so the same image's KV is reused wherever the same text precedes it, and two different images
never share a node: the ids are out of the vocabulary (no text token equals them) and every position
carries 30 fresh bits of a SHA-256-based stream, so two images match only if their hashes do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

PAD_ID_BITS = 30


def pad_ids_for_hash(image_hash: str, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids >= ``vocab_size`` spelled by the hash (SHAKE-256 stream seeded with it)."""
    stream = hashlib.shake_256(bytes.fromhex(image_hash)).digest(4 * length)
    mask = (1 << PAD_ID_BITS) - 1
    return [vocab_size + (int.from_bytes(stream[4 * i : 4 * i + 4], "little") & mask) for i in range(length)]


@dataclass
class ImageItem:
    image_hash: str  # hex SHA-256 of the decoded pixels (see image.image_hash)
    offset: int  # first prompt position of the image's span
    length: int  # number of positions (= feature vectors) of the span
    pixel_values: torch.Tensor  # [3, H, W] float32, processed; the scheduler encodes it on a feature-cache miss


@dataclass
class MultimodalInputs:
    items: list[ImageItem] = field(default_factory=list)
    pad_id_floor: int = 0  # the vocabulary size: ids from here up are image pad ids

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def span_end(self) -> int:
        """Prompt position after the last image span."""
        return max((it.offset + it.length for it in self.items), default=0)
