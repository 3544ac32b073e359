"""Architecture name (config.architectures[0]) -> our model class."""

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .llava import LlavaForConditionalGeneration

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # q/k norms switched on by model_type (models/llama.py)
    "Qwen3MoeForCausalLM": LlamaForCausalLM,  # and mixture-of-experts MLPs (layers/moe.py)
    "MixtralForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # gemma3_text configs (models/gemma3.py)
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}

# model_type -> class, for configs that name no architecture.
_BY_MODEL_TYPE = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
                  "qwen3": LlamaForCausalLM, "qwen3_moe": LlamaForCausalLM, "mixtral": LlamaForCausalLM,
                  "gemma3_text": Gemma3ForCausalLM}


def get_model_class(config):
    archs = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    supported = f"supported: {sorted(MODEL_REGISTRY)}"
    if model_type == "gemma3":  # the multimodal wrapper (vision tower + text_config): not the text-only model
        raise ValueError(f"Model architecture {archs or model_type} (Gemma 3 multimodal, model_type 'gemma3') is "
                         f"not supported, only text-only Gemma 3 (model_type 'gemma3_text'); {supported}")
    if not archs and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"Model architecture {archs or model_type} is not supported; {supported}")
