"""Alias of upstream's ``sglang.srt.utils`` names that frontend programs import (a package, as upstream's: its
``hf_transformers_utils`` submodule is the path newer programs import ``get_tokenizer`` from)."""

from __future__ import annotations

from ...runtime.multimodal.image import load_image as _load_image


def load_image(image_file):
    """sglang_backend.runtime.multimodal.image.load_image with upstream's return shape: ``(image, image_size)``,
    image_size None for an image (upstream fills it only for video). Local files are allowed: the caller is
    the program's own process, not a server request."""
    return _load_image(image_file, allow_local_media=True), None


def is_hip() -> bool:
    """Upstream's check for a ROCm build of torch (its test programs import it): this runtime has no ROCm path."""
    return False
