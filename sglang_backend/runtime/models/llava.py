"""LLaVA: a CLIP/SigLIP vision tower (transformers' own module) + the LLaVA projector + our Llama LM.

Prompts arrive with each image's placeholder span already holding hash-derived pad ids (see
``multimodal/inputs.py``); during an extend the embeddings at those positions are replaced by the image's
projected features. Only positions computed in this step get them: a cached prefix that ends inside or
after an image span needs no (or only the tail of the) features. Features are cached by image hash, so a
repeated image whose KV was evicted still skips the encoder.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..multimodal.feature_cache import VisionFeatureCache
from .llama import LlamaForCausalLM


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.activations import ACT2FN  # deferred: transformers is heavy to import

        layers = config.vision_feature_layer
        n_layers = 1 if isinstance(layers, int) else len(layers)
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * n_layers, hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel  # deferred: transformers is heavy to import

        self.config = config
        # CLIPVisionModel / SiglipVisionModel; in the dtype the rest is built in (the runner sets the default).
        self.vision_tower = AutoModel.from_config(config.vision_config).to(torch.get_default_dtype())
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.language_model = LlamaForCausalLM(config.text_config)
        self.feature_cache = VisionFeatureCache()

    @property
    def model(self):
        """The LM's decoder stack (the model runner reaches the rotary embedding through it)."""
        return self.language_model.model

    # Vision ---------------------------------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, tokens per image, LM hidden], as HF's ``get_image_features``."""
        dtype = next(self.vision_tower.parameters()).dtype
        out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True)
        layers = self.config.vision_feature_layer
        keep_cls = self.config.vision_feature_select_strategy != "default"
        picked = [out.hidden_states[i] for i in ([layers] if isinstance(layers, int) else layers)]
        picked = [h if keep_cls else h[:, 1:] for h in picked]
        return self.multi_modal_projector(torch.cat(picked, dim=-1).to(self.multi_modal_projector.linear_1.weight.dtype))

    def image_features(self, items) -> dict[str, torch.Tensor]:
        """Features per image hash: from the cache, else one encoder call for all missing images."""
        found, missing = {}, {}
        for it in items:
            if it.image_hash in found or it.image_hash in missing:
                continue
            feats = self.feature_cache.get(it.image_hash)
            if feats is None:
                missing[it.image_hash] = it.pixel_values
            else:
                found[it.image_hash] = feats
        if missing:
            device = self.multi_modal_projector.linear_1.weight.device
            encoded = self.encode_images(torch.stack(list(missing.values())).to(device))
            self.feature_cache.num_encoded_images += len(missing)
            for h, feats in zip(missing, encoded):
                self.feature_cache.put(h, feats)
                found[h] = feats
        return found

    def _merge_image_features(self, embeds: torch.Tensor, fb) -> None:
        """Writes image features over the pad-span rows computed in this extend (partial spans included)."""
        spans = []  # (first row in the flat batch, item, first span index, end span index)
        row = 0
        for mm, p, e in zip(fb.mm_inputs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            for it in (mm.items if mm else ()):
                lo, hi = max(it.offset, p), min(it.offset + it.length, p + e)
                if lo < hi:
                    spans.append((row + lo - p, it, lo - it.offset, hi - it.offset))
            row += e
        if not spans:
            return
        feats = self.image_features([s[1] for s in spans])
        for start, it, a, b in spans:
            embeds[start : start + b - a] = feats[it.image_hash][a:b].to(embeds.dtype)

    # Forward --------------------------------------------------------------------------------------------------
    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        fb = forward_batch
        if not (fb.forward_mode.is_extend() and fb.mm_inputs):
            return self.language_model(input_ids, positions, fb)
        lm = self.language_model.model
        # Pad ids are out of the vocabulary by design; their rows are overwritten by image features.
        embeds = lm.embed_tokens(input_ids.clamp(max=self.config.text_config.vocab_size - 1))
        self._merge_image_features(embeds, fb)
        return lm(input_ids, positions, fb, input_embeds=embeds)

    def compute_logits(self, hidden: torch.Tensor, opts=None) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, opts)

    # Weights --------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF LLaVA checkpoints, old layout (``language_model.model.*``, ``vision_tower.*``) and the one of
        transformers >= 4.52 (``model.language_model.*``, ``model.vision_tower.*``, ``lm_head.*``)."""
        lm, vision, proj = [], {}, {}
        for name, tensor in weights:
            for top in ("language_model.", "vision_tower.", "multi_modal_projector."):
                if name.startswith("model." + top):
                    name = name[len("model."):]
            if name.startswith("language_model."):
                rest = name[len("language_model."):]
                lm.append((rest if rest.startswith(("model.", "lm_head.")) else "model." + rest, tensor))
            elif name.startswith("lm_head."):
                lm.append((name, tensor))
            elif name.startswith("vision_tower."):
                vision[name[len("vision_tower."):]] = tensor
            elif name.startswith("multi_modal_projector."):
                proj[name[len("multi_modal_projector."):]] = tensor
            else:
                raise ValueError(f"unexpected weight {name!r} in LLaVA checkpoint")
        self.language_model.load_weights(lm)
        # CLIP/SigLIP towers name their weights with or without a ``vision_model.`` prefix depending on the
        # transformers version (and so do checkpoints): match the tower we built.
        ours = set(self.vision_tower.state_dict())
        prefix = "vision_model."
        fixed = {}
        for name, tensor in vision.items():
            if name not in ours and name.startswith(prefix) and name[len(prefix):] in ours:
                name = name[len(prefix):]
            elif name not in ours and prefix + name in ours:
                name = prefix + name
            fixed[name] = tensor
        with torch.no_grad():
            self.vision_tower.load_state_dict(fixed, strict=True)
            self.multi_modal_projector.load_state_dict(proj, strict=True)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """LM as LlamaForCausalLM does; vision tower and projector normal(0, initializer_range), norms 1."""
        self.language_model.init_dummy_weights(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        std = float(getattr(self.config.vision_config, "initializer_range", 0.02))
        with torch.no_grad():
            for name, p in [*self.vision_tower.named_parameters(), *self.multi_modal_projector.named_parameters()]:
                if name.endswith(".bias"):
                    p.zero_()
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def mm_stats(self) -> dict:
        return {"num_vision_encoder_images": self.feature_cache.num_encoded_images,
                "num_vision_feature_cache_hits": self.feature_cache.num_hits}


# Tiny / benchmark configs -----------------------------------------------------------------------------------------
IMAGE_TOKEN = "<image>"


def dummy_llava_config(text: dict | None = None, vision: dict | None = None, vision_type: str = "clip", **overrides):
    """A LlavaConfig built locally (no hub): CLIP (or ``vision_type="siglip"``) vision tower + Llama LM. The
    defaults are tiny (tests); ``llava_7b_config()`` gives LLaVA-1.5-7B's shapes. ``image_token_id`` defaults
    to the last vocab id."""
    # Test and benchmark helpers: transformers (heavy) and the loader only when called.
    from transformers import CLIPVisionConfig, LlavaConfig, SiglipVisionConfig
    from ..model_loader.loader import dummy_config

    text_cfg = dummy_config(**(text or {}))
    vision_kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     image_size=32, patch_size=8, projection_dim=32, initializer_range=0.1)
    if vision_type == "siglip":
        vision_kw.pop("projection_dim")
    vision_kw.update(vision or {})
    vision_cls = {"clip": CLIPVisionConfig, "siglip": SiglipVisionConfig}[vision_type]
    kw = dict(vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
              image_token_id=text_cfg.vocab_size - 1)
    kw.update(overrides)
    return LlavaConfig(vision_config=vision_cls(**vision_kw).to_dict(), text_config=text_cfg.to_dict(),
                       architectures=["LlavaForConditionalGeneration"], **kw)


def llava_7b_config():
    """LLaVA-1.5-7B shapes: CLIP ViT-L/14-336 (24 layers, 576 patches) + Llama-2-7B (vocab 32064)."""
    text = dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, initializer_range=0.02)
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu", initializer_range=0.02)
    return dummy_llava_config(text, vision, image_token_id=32000)


def save_dummy_llava(config, out_dir: str, seed: int = 0, weights: bool = True) -> str:
    """Writes config + tokenizer (the dummy BPE one with ``<image>`` at ``image_token_id``) + image processor
    config into ``out_dir``, and, with ``weights``, HF ``LlavaForConditionalGeneration`` random weights
    (seeded, fp32 safetensors). Without weights the dir is for ``load_format='dummy'`` (GPU benchmarks)."""
    # Test and benchmark helpers: transformers (heavy), the loader and the image processor only when called.
    import os
    from transformers import AddedToken, GenerationConfig
    from ..model_loader.loader import build_dummy_tokenizer
    from ..multimodal.processor import build_image_processor

    os.makedirs(out_dir, exist_ok=True)
    vocab = config.text_config.vocab_size
    image_id = config.image_token_id
    tok = build_dummy_tokenizer(image_id)  # ids below the image token; <image> gets the next id
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(IMAGE_TOKEN, special=True, normalized=False)]})
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == image_id, "image token id must follow the tokenizer's vocab"
    assert image_id < vocab
    tok.save_pretrained(out_dir)
    build_image_processor(config, None).save_pretrained(out_dir)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out_dir)
    if not weights:
        config.save_pretrained(out_dir)
        return out_dir
    from transformers import LlavaForConditionalGeneration as HFLlava  # deferred: heavy

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HFLlava(config).to(torch.float32).eval()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                if p.ndim == 1:  # norms and biases off their defaults, so a loader that drops them shows
                    p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


EntryClass = [LlavaForConditionalGeneration]
