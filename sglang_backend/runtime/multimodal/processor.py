"""Turns a prompt's image placeholders into hash-derived pad spans plus the images' pixel values.

Runs where requests are tokenized (the Engine's caller thread, the server's TokenizerManager); the
scheduler process receives ids that already carry the image hashes and encodes pixels only on a miss.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

from .image import image_hash, load_image
from .inputs import ImageItem, MultimodalInputs, pad_ids_for_hash

logger = logging.getLogger(__name__)

DEFAULT_MAX_IMAGES = 16
_PIXEL_CACHE_ENTRIES = 64


def is_multimodal_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def image_token_id_of(config) -> int:
    tid = getattr(config, "image_token_id", None)
    return int(tid if tid is not None else getattr(config, "image_token_index"))


def num_image_tokens_of(config) -> int:
    """Feature vectors per image: the tower's output length (patches, plus CLS for CLIP; SigLIP has none),
    less the first vector under the "default" strategy (which drops it, as HF does)."""
    vc = config.vision_config
    n = (vc.image_size // vc.patch_size) ** 2
    if not vc.model_type.startswith("siglip"):
        n += 1  # CLS
    if getattr(config, "vision_feature_select_strategy", "default") == "default":
        n -= 1
    return n


def build_image_processor(config, model_dir: str | None):
    """The checkpoint's own image processor when it ships one, else CLIP preprocessing at the tower's size."""
    if model_dir and os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
        # deferred: takes seconds, and the DSL's image/video helpers import this package
        from transformers import AutoImageProcessor

        try:
            return AutoImageProcessor.from_pretrained(model_dir)
        except (ValueError, ImportError, OSError) as e:  # e.g. a processor class this transformers lacks
            logger.warning("could not load %s's image processor (%s); using CLIP preprocessing", model_dir, e)
    try:
        from transformers import CLIPImageProcessorPil as cls  # no torchvision needed
    except ImportError:  # older transformers: the PIL one is the default
        from transformers import CLIPImageProcessor as cls
    size = config.vision_config.image_size
    return cls(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


class MultimodalProcessor:
    def __init__(self, config, model_dir: str | None, tokenizer, allow_local_media: bool,
                 max_images: int = DEFAULT_MAX_IMAGES):
        self.image_token_id = image_token_id_of(config)
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.num_image_tokens = num_image_tokens_of(config)
        self.vocab_size = config.get_text_config().vocab_size
        self.bos_token_id = tokenizer.bos_token_id
        self.allow_local_media = allow_local_media
        self.max_images = max_images
        self.image_processor = build_image_processor(config, model_dir)
        self._pixels: OrderedDict[str, object] = OrderedDict()  # hash -> pixel_values (repeat images skip resizing)
        self._lock = threading.Lock()

    @staticmethod
    def for_model(config, model_dir, tokenizer, allow_local_media: bool) -> "MultimodalProcessor | None":
        return MultimodalProcessor(config, model_dir, tokenizer, allow_local_media) if is_multimodal_config(config) else None

    def _pixel_values(self, img, h: str):
        with self._lock:  # Engine.generate may be called from several threads
            pv = self._pixels.get(h)
            if pv is not None:
                self._pixels.move_to_end(h)
                return pv
        pv = self.image_processor(images=img, return_tensors="pt")["pixel_values"][0].float()
        with self._lock:
            self._pixels[h] = pv
            if len(self._pixels) > _PIXEL_CACHE_ENTRIES:
                self._pixels.popitem(last=False)
        return pv

    def expand(self, input_ids: list[int], image_data, context_len: int, max_total_tokens: int,
               return_logprob: bool = False, logprob_start_len: int | None = None):
        """(ids with each placeholder replaced by its image's pad span, MultimodalInputs). Placeholders are
        the image token; a prompt without any gets them after its BOS. Raises ValueError for bad input."""
        images = image_data if isinstance(image_data, (list, tuple)) else [image_data]
        if not images:
            return list(input_ids), None
        if len(images) > self.max_images:
            raise ValueError(f"too many images: {len(images)} (at most {self.max_images} per request)")
        ids = list(input_ids)
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if not slots:
            at = 1 if ids and ids[0] == self.bos_token_id else 0
            ids[at:at] = [self.image_token_id] * len(images)
            slots = list(range(at, at + len(images)))
        if len(slots) != len(images):
            raise ValueError(f"the prompt has {len(slots)} image placeholders ({self.image_token}) "
                             f"but {len(images)} images were given")
        total = len(ids) + len(images) * (self.num_image_tokens - 1)
        if total >= context_len:
            raise ValueError(f"the prompt with its images has {total} tokens, but the model's context length is "
                             f"{context_len}")
        if total + 1 > max_total_tokens:
            raise ValueError(f"the prompt with its images has {total} tokens, more than the KV cache holds "
                             f"({max_total_tokens})")
        out, items, prev = [], [], 0
        for k, (slot, item) in enumerate(zip(slots, images)):
            img = load_image(item, self.allow_local_media, what=f"image {k}")
            h = image_hash(img)
            out.extend(ids[prev:slot])
            items.append(ImageItem(h, len(out), self.num_image_tokens, self._pixel_values(img, h)))
            out.extend(pad_ids_for_hash(h, self.num_image_tokens, self.vocab_size))
            prev = slot + 1
        out.extend(ids[prev:])
        if return_logprob and logprob_start_len is not None and 0 <= logprob_start_len < len(out):
            raise ValueError("prompt logprobs are not supported for requests with images "
                             "(output logprobs are; leave logprob_start_len unset)")
        return out, MultimodalInputs(items, self.vocab_size)
