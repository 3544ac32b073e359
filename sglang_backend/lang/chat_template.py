"""Role markup for the DSL's ``system/user/assistant`` blocks: each role is a (prefix, suffix) pair of text
around the message, as in upstream SGLang. A template is picked by looking at the model's own HF chat
template (ChatML, Llama-3, Llama-2/Mistral markers) or its path."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: list[str] = field(default_factory=list)
    image_token: str = "<image>"  # what upstream's image() writes for this template

    def get_prefix_and_suffix(self, role: str, history: list[dict] | None = None) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"role {role!r} is not in chat template {self.name!r}")
        return self.role_prefix_and_suffix[role]


CHATML = ChatTemplate(
    "chatml",
    {"system": ("<|im_start|>system\n", "<|im_end|>\n"), "user": ("<|im_start|>user\n", "<|im_end|>\n"),
     "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n")},
    stop_str=["<|im_end|>"],
)
LLAMA3 = ChatTemplate(
    "llama-3-instruct",
    {"system": ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
     "user": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
     "assistant": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")},
    stop_str=["<|eot_id|>"],
)
LLAMA2 = ChatTemplate(
    "llama-2-chat",
    {"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"), "user": ("[INST] ", " [/INST]"), "assistant": ("", " </s><s>")},
    stop_str=["</s>"],
)
DEFAULT = ChatTemplate(
    "default",
    {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
)

# More of upstream's names, for programs that pick a template with get_chat_template("...").
_CHATML_ROLES = CHATML.role_prefix_and_suffix
_EXTRA = (
    ChatTemplate("qwen", _CHATML_ROLES, "You are a helpful assistant.", ["<|im_end|>"]),
    ChatTemplate("chatml-llava", _CHATML_ROLES, "You are a helpful assistant.", ["<|im_end|>"], "<image>\n"),
    ChatTemplate("llama-3-instruct-llava", LLAMA3.role_prefix_and_suffix, None, ["<|eot_id|>"], "<image>\n"),
    ChatTemplate("vicuna_v1.1", {"system": ("", " "), "user": ("USER:", " "), "assistant": ("ASSISTANT:", "</s>")},
                 "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.", [], " <image>\n"),
    ChatTemplate("claude", {"system": ("", ""), "user": ("\n\nHuman: ", ""), "assistant": ("\n\nAssistant:", "")}),
    ChatTemplate("gemma-it", {"system": ("", ""), "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
                              "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n")}),
)
TEMPLATES = {t.name: t for t in (CHATML, LLAMA3, LLAMA2, DEFAULT, *_EXTRA)}


def get_chat_template(name: str) -> ChatTemplate:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def guess_chat_template(hf_template: str | None = None, model_path: str | None = None) -> ChatTemplate:
    text = hf_template or ""
    path = (model_path or "").lower()
    if "<|im_start|>" in text or any(k in path for k in ("qwen", "smollm", "chatml")):
        return CHATML
    if "<|start_header_id|>" in text or "llama-3" in path:
        return LLAMA3
    if "[INST]" in text or "llama-2" in path or "mistral" in path:
        return LLAMA2
    return DEFAULT
