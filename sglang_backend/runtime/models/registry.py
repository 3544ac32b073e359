"""Architecture name (config.architectures[0]) -> our model class."""

from .llama import LlamaForCausalLM
from .llava import LlavaForConditionalGeneration

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # q/k norms switched on by model_type (models/llama.py)
    "Qwen3MoeForCausalLM": LlamaForCausalLM,  # and mixture-of-experts MLPs (layers/moe.py)
    "MixtralForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}


def get_model_class(config):
    archs = getattr(config, "architectures", None) or []
    if not archs and getattr(config, "model_type", None) in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"):
        return LlamaForCausalLM
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"Model architecture {archs or config.model_type} is not supported; supported: {sorted(MODEL_REGISTRY)}")
