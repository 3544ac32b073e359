"""Finding, describing and reading models.

* ``resolve_model_path``: a user's ``--model-path`` (alias, HF directory, ``.gguf`` file, hub id) -> a
  local Hugging Face directory.
* ``load_config`` / ``check_supported``: the transformers config and the architecture gate.
* ``iterate_weights``: HF-named tensors from ``*.safetensors`` (or ``*.bin``) for the model runner.
* ``load_tokenizer``: the tokenizer, with a pad token guaranteed.
* ``dummy_config`` / ``save_dummy_hf_model``: tiny random models (with a matching byte-level BPE
  tokenizer) that both our engine and HF transformers load from the same directory, for tests.

Heavy imports (transformers, safetensors, torch) happen inside the functions that need them, so
resolving an already-cached model path stays cheap.
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, Any, Iterator

from ... import environ
from .embedded import (DEFAULT_MODEL_ALIASES, GEMMA3_MODEL_ALIASES, converted_gguf_path, default_model_path,
                       embedded_gguf_path, gemma3_model_path)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "resolve_model_path",
    "load_config",
    "check_supported",
    "iterate_weights",
    "gguf_block_types",
    "load_hf_reference",
    "load_tokenizer",
    "dummy_config",
    "save_dummy_hf_model",
    "build_dummy_tokenizer",
]

# HF architecture class name -> model_type. SmolLM/SmolLM2 use LlamaForCausalLM.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # Llama's forward with per-head RMSNorm on q and k (models/llama.py)
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3 with mixture-of-experts MLPs (layers/moe.py)
    "MixtralForCausalLM": "mixtral",  # Mistral with mixture-of-experts MLPs
    "Gemma3ForCausalLM": "gemma3_text",  # text-only Gemma 3, sliding-window + global layers (models/gemma3.py)
    "LlavaForConditionalGeneration": "llava",  # vision tower + a Llama-family LM (models/llava.py)
}


class UnsupportedModelError(NotImplementedError, ValueError):
    """The model's architecture is not implemented by this runtime (catchable as either
    NotImplementedError or ValueError)."""


# --------------------------------------------------------------------------------------------------
# path resolution
# --------------------------------------------------------------------------------------------------

def _unknown(model_path: Any, reason: str) -> ValueError:
    return ValueError(
        f"Unknown model path {model_path!r}: not a local directory with config.json, not a .gguf file, "
        f"and not a Hugging Face model available locally or downloadable ({reason})")


def _resolve_gguf(path: str) -> str:
    path = os.path.abspath(path)
    try:
        embedded = embedded_gguf_path()
    except FileNotFoundError:
        embedded = None
    if embedded is not None and os.path.exists(embedded) and os.path.samefile(path, embedded):
        return default_model_path()  # share the default model's cache entry
    return converted_gguf_path(path)


def resolve_model_path(model_path: str | None) -> str:
    """Turn a user-facing model path into a local Hugging Face model directory.

    * ``None``, ``""``, ``"default"``, ``"smollm2"``, ``"SmolLM2-135M-Instruct"`` (any case) -> the
      embedded SmolLM2 converted into the cache (:func:`default_model_path`).
    * ``"gemma3-270m"``, ``"gemma-3-270m"``, ``"gemma3"`` (any case) -> the embedded Gemma 3 270M converted
      into the cache (:func:`gemma3_model_path`; FileNotFoundError naming the pip command when its packages
      are missing).
    * a directory with ``config.json`` -> itself (absolute).
    * a ``*.gguf`` file (or a directory holding exactly one ``*.gguf`` and no config.json) -> its
      conversion in the cache.
    * otherwise a Hugging Face hub id: the local hub cache first, then a download.

    Raises ``ValueError("Unknown model path ...")`` when nothing matches.
    """
    if model_path is None or (isinstance(model_path, str) and model_path.strip() == ""):
        return default_model_path()
    if not isinstance(model_path, (str, os.PathLike)):
        raise _unknown(model_path, f"expected a string, got {type(model_path).__name__}")
    raw = os.fspath(model_path)
    if raw.strip().lower() in {a.lower() for a in DEFAULT_MODEL_ALIASES}:
        return default_model_path()
    if raw.strip().lower() in {a.lower() for a in GEMMA3_MODEL_ALIASES}:
        return gemma3_model_path()

    path = os.path.expanduser(raw)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return os.path.abspath(path)
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return _resolve_gguf(ggufs[0])
        reason = ("directory has several .gguf files; pass one of them" if ggufs
                  else "directory exists but has no config.json")
        raise _unknown(model_path, reason)
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            try:
                return _resolve_gguf(path)
            except NotImplementedError:
                raise
            except Exception as e:  # corrupt file etc.
                raise _unknown(model_path, f"GGUF conversion failed: {type(e).__name__}: {e}") from e
        raise _unknown(model_path, "a file that is not .gguf")
    if path.lower().endswith(".gguf"):
        raise _unknown(model_path, "no such .gguf file")
    if os.path.isabs(path) or raw.startswith((".", "~")) or raw.count("/") > 1:
        raise _unknown(model_path, "no such local path")

    return _resolve_hub(raw)


def _resolve_hub(repo_id: str) -> str:
    try:  # huggingface_hub is no direct dependency of ours (transformers brings it); imported only for hub ids
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub ships with transformers
        raise _unknown(repo_id, f"huggingface_hub is not installed: {e}") from e
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    errors = []
    for local_only in (True, False):
        if not local_only and environ.HF_HUB_OFFLINE.get():
            errors.append("download skipped: HF_HUB_OFFLINE is set")
            break
        try:
            d = snapshot_download(repo_id, local_files_only=local_only, allow_patterns=patterns)
        except Exception as e:
            errors.append(f"{'local cache' if local_only else 'download'}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": "))
            continue
        if os.path.isfile(os.path.join(d, "config.json")):
            if not glob.glob(os.path.join(d, "*.safetensors")):
                # an old repo with only .bin weights
                try:
                    d = snapshot_download(repo_id, local_files_only=local_only,
                                          allow_patterns=patterns + ["*.bin"])
                except Exception as e:
                    errors.append(f"bin weights: {type(e).__name__}")
                    continue
            return d
        errors.append(f"{'local cache' if local_only else 'download'}: snapshot has no config.json")
    raise _unknown(repo_id, "; ".join(errors))


# --------------------------------------------------------------------------------------------------
# config / architecture
# --------------------------------------------------------------------------------------------------

def load_config(model_path: str | None) -> "PretrainedConfig":
    """``AutoConfig`` of the (resolved) model path."""
    from transformers import AutoConfig  # deferred: transformers takes seconds (see the module docstring)

    return AutoConfig.from_pretrained(resolve_model_path(model_path))


def check_supported(config: "PretrainedConfig") -> str:
    """Return the architecture name if this runtime implements it, else raise UnsupportedModelError."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration's wrapper (vision tower + text_config)
        raise UnsupportedModelError(
            f"Unsupported model {', '.join(archs) or 'gemma3'} (model_type 'gemma3'): the multimodal Gemma 3 is not "
            f"implemented, only text-only Gemma 3 (Gemma3ForCausalLM with model_type 'gemma3_text'); sglang_backend "
            f"implements {', '.join(SUPPORTED_ARCHITECTURES)}")
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    if not archs:
        for a, mt in SUPPORTED_ARCHITECTURES.items():
            if mt == model_type:
                return a
    shown = ", ".join(archs) if archs else f"model_type={model_type!r}"
    raise UnsupportedModelError(
        f"Unsupported model architecture {shown}: sglang_backend implements "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama / SmolLM / Mistral / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 text "
        f"families)")


# --------------------------------------------------------------------------------------------------
# weights / tokenizer
# --------------------------------------------------------------------------------------------------

def _weight_files(model_dir: str, ext: str, index_name: str) -> list[str]:
    index = os.path.join(model_dir, index_name)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return [os.path.join(model_dir, n) for n in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, f"*{ext}")))
    # Mistral-style repos ship a duplicate consolidated.* next to the HF shards
    hf_files = [f for f in files if not os.path.basename(f).startswith("consolidated")]
    if ext == ".bin":
        hf_files = [f for f in hf_files if os.path.basename(f) not in ("training_args.bin", "optimizer.bin")]
    return hf_files or files


def gguf_block_types(model_dir: str) -> dict[str, str]:
    """Tensor name -> GGUF type of the weights ``model_dir`` stores as GGUF blocks (a converted GGUF)."""
    from safetensors import safe_open  # deferred, like every heavy import here (module docstring)
    from ..layers.gguf_quant import read_block_types  # deferred: imports torch (module docstring)

    types: dict[str, str] = {}
    for fn in _weight_files(model_dir, ".safetensors", "model.safetensors.index.json"):
        with safe_open(fn, framework="pt", device="cpu") as f:
            types.update(read_block_types(f.metadata()))
    return types


def load_hf_reference(model_dir: str, dtype: "torch.dtype | None" = None):
    """transformers' ``AutoModelForCausalLM`` for ``model_dir`` in eval mode (float32 by default), the reference
    the equality tests compare with. Weights stored as GGUF blocks are dequantized as gguf-py does, which
    ``from_pretrained`` cannot read."""
    import torch  # deferred, like every heavy import here (module docstring)
    from transformers import AutoConfig, AutoModelForCausalLM
    from ..layers.gguf_quant import GGUFBlocks

    dtype = dtype or torch.float32
    if not gguf_block_types(model_dir):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    state = {name: (t.dequantize() if isinstance(t, GGUFBlocks) else t).to(dtype)
             for name, t in iterate_weights(model_dir)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{model_dir}: weights do not fit {type(model).__name__}: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    model.tie_weights()
    return model.eval()


def iterate_weights(model_dir: str) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield ``(hf_name, tensor)`` for every weight in ``model_dir``'s ``*.safetensors`` files, or,
    when there are none, its ``*.bin`` files (``torch.load(weights_only=True)``). Tensors keep their
    stored dtype and live on CPU; a tensor stored as GGUF blocks comes as ``gguf_quant.GGUFBlocks``."""
    files = _weight_files(model_dir, ".safetensors", "model.safetensors.index.json")
    if files:
        from safetensors import safe_open  # deferred, like every heavy import here (module docstring)
        from ..layers.gguf_quant import GGUFBlocks, read_block_types  # deferred: imports torch (docstring)

        for fn in files:
            with safe_open(fn, framework="pt", device="cpu") as f:
                block_types = read_block_types(f.metadata())
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    yield name, GGUFBlocks(block_types[name], tensor) if name in block_types else tensor
        return
    files = _weight_files(model_dir, ".bin", "pytorch_model.bin.index.json")
    if not files:
        raise FileNotFoundError(f"No *.safetensors or *.bin weight files in {model_dir}")
    import torch  # deferred: only old *.bin checkpoints need torch.load (module docstring)

    for fn in files:
        state = torch.load(fn, map_location="cpu", weights_only=True)
        for name, tensor in state.items():
            yield name, tensor
        del state


def load_tokenizer(model_dir: str, **kwargs: Any):
    """``AutoTokenizer.from_pretrained(model_dir)`` with a pad token guaranteed (eos, else unk)."""
    from transformers import AutoTokenizer  # deferred: transformers takes seconds (see the module docstring)

    tok = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    if tok.pad_token is None:
        if tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        elif tok.unk_token is not None:
            tok.pad_token = tok.unk_token
        else:
            tok.add_special_tokens({"pad_token": "<|pad|>"})
    return tok


# --------------------------------------------------------------------------------------------------
# tiny dummy models for tests
# --------------------------------------------------------------------------------------------------

_DUMMY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.1,  # larger than HF's 0.02 so random models have non-degenerate logits
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_DUMMY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
_DUMMY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def dummy_config(**overrides: Any) -> "PretrainedConfig":
    """A tiny config for tests: Llama by default (vocab 512, hidden 64, intermediate 128, 2 layers,
    4 heads / 2 KV heads, 512 positions, tied embeddings off, init std 0.1).

    ``model_type="qwen2"`` / ``"qwen3"`` / ``"mistral"`` (or ``architecture="Qwen2ForCausalLM"`` ...) picks
    that family's config class instead (Qwen3: head_dim = hidden / heads unless given); every other keyword
    overrides a config field. ``"gemma3_text"``: Gemma 3 with tied embeddings, head_dim = hidden / heads,
    query_pre_attn_scalar = head_dim, a 16-token window and every second layer global, unless given.
    """
    # deferred: heavy (module docstring)
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config,
                              Qwen3MoeConfig)

    overrides = dict(overrides)
    model_type = overrides.pop("model_type", None)
    arch = overrides.pop("architecture", None)
    if arch is not None and model_type is None:
        model_type = SUPPORTED_ARCHITECTURES.get(arch)
        if model_type is None:
            raise UnsupportedModelError(f"dummy_config: unsupported architecture {arch!r}")
    model_type = model_type or "llama"
    classes = {"llama": (LlamaConfig, "LlamaForCausalLM"),
               "mistral": (MistralConfig, "MistralForCausalLM"),
               "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
               "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
               "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
               "mixtral": (MixtralConfig, "MixtralForCausalLM"),
               "gemma3_text": (Gemma3TextConfig, "Gemma3ForCausalLM")}
    if model_type not in classes:
        raise UnsupportedModelError(f"dummy_config: unsupported model_type {model_type!r}")
    cls, arch_name = classes[model_type]
    kwargs = dict(_DUMMY_DEFAULTS)
    kwargs["architectures"] = [arch_name]
    if model_type in ("mistral", "mixtral"):  # full attention unless asked (the config classes default to 4096)
        kwargs["sliding_window"] = None
    if model_type == "qwen3_moe":  # 4 experts of 32, top 2, every layer sparse
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True)
    if model_type == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2)
    if model_type == "gemma3_text":
        kwargs.update(tie_word_embeddings=True, sliding_window=16)
    kwargs.update(overrides)
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):  # the class's default (128 / 256) would not fit
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if model_type == "gemma3_text":
        kwargs.setdefault("query_pre_attn_scalar", kwargs["head_dim"])
        kwargs.setdefault("layer_types", ["full_attention" if i % 2 else "sliding_attention"
                                          for i in range(kwargs["num_hidden_layers"])])
    return cls(**kwargs)


def _dummy_corpus() -> list[str]:
    words = (
        "the of and to in is was for on that with as by at from his her it an are were which be this "
        "has had not but or have they one their all new after first two also been who its more other "
        "time when into only can over than may most such year world city state people system water "
        "model token cache prefix radix tree batch request answer question program language paris "
        "france capital hello world what how why where number value true false json regex select"
    ).split()
    lines = []
    n = len(words)
    for i in range(400):
        a, b, c, d = words[i % n], words[(i * 7 + 3) % n], words[(i * 13 + 5) % n], words[(i * 31 + 11) % n]
        lines.append(f"{a.capitalize()} {b} {c}, {d} {i}. {a}-{c}: {i * 17 % 1000} + {i % 10} = ?")
    lines.append("".join(chr(c) for c in range(32, 127)))
    lines.append("User: What is the capital of France? Assistant: The capital of France is Paris.")
    lines.append('{"name": "Alice", "age": 30, "tags": ["a", "b"], "ok": true}')
    return lines


def build_dummy_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` tokens, built in-process (no network).

    Ids 0/1/2 are ``<|endoftext|>`` (unk/pad), ``<|im_start|>`` (bos) and ``<|im_end|>`` (eos); the
    next 256 ids are the byte alphabet so any text round-trips; the rest are merges learned from a
    fixed corpus (padded with ``<|extra_N|>`` special tokens if the corpus runs out of merges).
    Returns a ``PreTrainedTokenizerFast`` with a ChatML-style chat template.
    """
    # deferred: transformers takes seconds to import (see the module docstring)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    min_size = len(_DUMMY_SPECIAL_TOKENS) + 256
    if vocab_size < min_size:
        raise ValueError(f"dummy tokenizer needs vocab_size >= {min_size} (byte alphabet + specials), "
                         f"got {vocab_size}")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_DUMMY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=1,
    )
    tk.train_from_iterator(_dummy_corpus(), trainer=trainer)
    n = tk.get_vocab_size(with_added_tokens=True)
    if n < vocab_size:
        tk.add_special_tokens([AddedToken(f"<|extra_{i}|>", special=True) for i in range(vocab_size - n)])
    assert tk.get_vocab_size(with_added_tokens=True) == vocab_size, tk.get_vocab_size()
    for i, t in enumerate(_DUMMY_SPECIAL_TOKENS):
        assert tk.token_to_id(t) == i, (t, tk.token_to_id(t))

    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=1 << 30,
    )
    tok.chat_template = _DUMMY_CHAT_TEMPLATE
    return tok


def save_dummy_hf_model(config: "PretrainedConfig", out_dir: str, seed: int = 0) -> str:
    """Save a randomly initialized HF model for ``config`` (+ a matching tokenizer) into ``out_dir``.

    The model class follows ``config.model_type`` (llama / mistral / mixtral / qwen2 / qwen3 / qwen3_moe /
    gemma3_text).
    Initialization is seeded
    (the global RNG state is left untouched) and uses ``config.initializer_range``; 1-D parameters
    (norm weights, biases) get extra noise so a loader that swaps or drops them changes the logits.
    Weights are saved as float32 safetensors. Returns ``out_dir``.
    """
    # deferred: torch and transformers take seconds to import (see the module docstring)
    import torch
    from transformers import (Gemma3ForCausalLM, GenerationConfig, LlamaForCausalLM, MistralForCausalLM,
                              MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)

    classes = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
               "qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM,
               "gemma3_text": Gemma3ForCausalLM}
    cls = classes.get(config.model_type)
    if cls is None:
        raise UnsupportedModelError(f"save_dummy_hf_model: unsupported model_type {config.model_type!r}")
    if not getattr(config, "architectures", None):
        config.architectures = [cls.__name__]

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32).eval()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = build_dummy_tokenizer(config.vocab_size)
    tok.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out_dir)
    return out_dir


def read_chat_template(value: str) -> str:
    """``--chat-template``: a path to a Jinja file, or the template text itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def load_model_assets(server_args) -> tuple[str, "PretrainedConfig", Any]:
    """(model_dir, config, tokenizer) for the server args, with the chat template of ``--chat-template`` if given;
    raises ValueError for unknown models."""
    model_dir = resolve_model_path(server_args.model_path)
    config = load_config(model_dir)
    tokenizer = load_tokenizer(server_args.tokenizer_path or model_dir)
    if server_args.chat_template:
        tokenizer.chat_template = read_chat_template(server_args.chat_template)
    return model_dir, config, tokenizer
