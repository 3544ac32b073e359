"""Multimodal inputs: image/video loading, content hashes as radix keys, the vision-feature cache."""

from .feature_cache import VisionFeatureCache
from .image import encode_image_data_url, image_hash, load_image
from .inputs import ImageItem, MultimodalInputs, pad_ids_for_hash
from .processor import MultimodalProcessor, is_multimodal_config
from .video import load_video_frames

__all__ = ["ImageItem", "MultimodalInputs", "MultimodalProcessor", "VisionFeatureCache", "encode_image_data_url",
           "image_hash", "is_multimodal_config", "load_image", "load_video_frames", "pad_ids_for_hash"]
