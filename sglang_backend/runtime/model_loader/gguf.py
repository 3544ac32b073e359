"""GGUF (llama.cpp) -> Hugging Face directory conversion.

``convert_gguf_to_hf(gguf_path, out_dir)`` reads a GGUF file with the ``gguf`` package, dequantizes every
tensor to float32, maps llama.cpp tensor names to Hugging Face names, undoes llama.cpp's rotary row
permutation of the Q/K projections, and writes a normal HF model directory (``config.json``,
``generation_config.json``, ``model.safetensors`` in float32, and the tokenizer with its chat template).

The directory is written into a temporary sibling first and renamed into place at the end, so a crash
never leaves a half-written model where a later run would look for one.

Only the ``llama`` architecture (Llama, SmolLM, Mistral-as-llama GGUFs) is supported; anything else
raises ``NotImplementedError`` naming the architecture.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
from tqdm import tqdm

__all__ = [
    "CONVERTER_VERSION",
    "CONVERSION_MARKER",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "convert_gguf_to_hf",
    "gguf_to_hf_config",
    "gguf_tensor_name_to_hf",
    "permute_qk_for_gguf",
    "unpermute_qk_from_gguf",
    "read_gguf_metadata",
]

# Bump when the output format changes so cached conversions are redone.
CONVERTER_VERSION = 1
# Written last inside a finished conversion; its presence marks the directory as complete.
CONVERSION_MARKER = "sglang_backend_conversion.json"
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# llama.cpp per-block tensor names -> HF names (for the llama family)
_BLOCK_TENSOR_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSOR_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that HF recomputes (precomputed rotary tables); skipped silently.
_SKIPPED_SUFFIXES = ("rope_freqs.weight", "attn_rot_embd.weight", "rope_factors_long.weight",
                     "rope_factors_short.weight")


# --------------------------------------------------------------------------------------------------
# metadata helpers
# --------------------------------------------------------------------------------------------------

def _field_value(field: Any) -> Any:
    """Decode one GGUFReader field into a Python value (str / int / float / bool / list)."""
    from gguf import GGUFValueType  # deferred: gguf is slow to import; embedded.py imports this module

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        elem = types[-1] if len(types) > 1 else None
        out = []
        for idx in field.data:
            part = field.parts[idx]
            if elem == GGUFValueType.STRING:
                out.append(bytes(part).decode("utf-8", errors="replace"))
            else:
                out.append(part.tolist()[0] if len(part) == 1 else part.tolist())
        return out
    part = field.parts[field.data[0]]
    if types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    val = part.tolist()[0]
    if types[0] == GGUFValueType.BOOL:
        return bool(val)
    if types[0] == GGUFValueType.FLOAT32:
        return float(str(np.float32(val)))  # 1e-05, not 9.999999747378752e-06
    return val


def read_gguf_metadata(reader: Any, *, skip_large_arrays: bool = True) -> dict[str, Any]:
    """All key/value metadata of a GGUFReader as a plain dict.

    The tokenizer's big arrays (tokens, merges, scores, token types) are replaced by their length when
    ``skip_large_arrays`` is set, since decoding them is slow and the config only needs the count.
    """
    from gguf import GGUFValueType  # deferred: gguf is slow to import; embedded.py imports this module

    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        types = list(field.types)
        if skip_large_arrays and types and types[0] == GGUFValueType.ARRAY and len(field.data) > 1024:
            meta[name] = _ArrayLen(len(field.data))
            continue
        meta[name] = _field_value(field)
    return meta


class _ArrayLen(int):
    """Length stand-in for a large metadata array that was not decoded."""


def gguf_tensor_name_to_hf(name: str) -> str | None:
    """Map a llama.cpp tensor name (``blk.3.attn_q.weight``) to its HF name, or None to skip it."""
    if name.endswith(_SKIPPED_SUFFIXES):
        return None
    base, _, kind = name.rpartition(".")  # kind: weight / bias
    if kind not in ("weight", "bias"):
        raise ValueError(f"Unexpected GGUF tensor name {name!r}")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = _BLOCK_TENSOR_MAP.get(part)
        if hf is None:
            raise NotImplementedError(f"GGUF tensor {name!r} has no Hugging Face llama equivalent")
        return f"model.layers.{int(layer)}.{hf}.{kind}"
    hf = _GLOBAL_TENSOR_MAP.get(base)
    if hf is None:
        raise NotImplementedError(f"GGUF tensor {name!r} has no Hugging Face llama equivalent")
    return f"{hf}.{kind}"


def permute_qk_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of HF Q/K rows (rotate-half layout -> interleaved pairs).

    Per head, HF stores rotary dims as [x0..x_{d/2-1}, y0..y_{d/2-1}]; llama.cpp stores them as
    [x0, y0, x1, y1, ...]. Used by tests to build GGUF files from HF weights.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk_from_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk_for_gguf`: llama.cpp Q/K rows back to HF rotate-half order."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def gguf_to_hf_config(meta: dict[str, Any], *, has_output_tensor: bool, vocab_size: int | None = None):
    """Build a transformers ``LlamaConfig`` from GGUF metadata (``llama.*`` keys)."""
    from transformers import LlamaConfig  # deferred: transformers takes seconds to import

    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    p = f"{arch}."

    def need(key: str) -> Any:
        if p + key not in meta:
            raise ValueError(f"GGUF metadata is missing required key {p + key!r}")
        return meta[p + key]

    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_kv = int(meta.get(p + "attention.head_count_kv", n_head))
    if vocab_size is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = int(len(tokens)) if tokens is not None else int(need("vocab_size"))

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0))}
    scaling_type = meta.get(p + "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope["rope_type"] = "linear" if scaling_type == "linear" else scaling_type
        if p + "rope.scaling.factor" in meta:
            rope["factor"] = float(meta[p + "rope.scaling.factor"])
        if p + "rope.scaling.original_context_length" in meta:
            rope["original_max_position_embeddings"] = int(meta[p + "rope.scaling.original_context_length"])
        if scaling_type == "yarn":
            # llama.cpp stores no beta values by default; HF uses its own defaults then.
            if p + "rope.scaling.yarn_log_multiplier" in meta:
                rope["mscale"] = float(meta[p + "rope.scaling.yarn_log_multiplier"])

    head_dim = int(meta.get(p + "attention.key_length", hidden // n_head))

    kwargs: dict[str, Any] = dict(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(p + "context_length", 2048)),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope,
        tie_word_embeddings=not has_output_tensor,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )
    return LlamaConfig(**kwargs)


# --------------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------------

def _dequantize(tensor: Any) -> np.ndarray:
    """One GGUF tensor as float32 in HF (row-major, reversed GGUF) shape."""
    # deferred: gguf is slow to import, and resolving a cached model path imports this module
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    # GGUF lists dims fastest-first (ne0 = columns); HF/numpy lists them slowest-first.
    hf_shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F32:
        arr = np.array(tensor.data, dtype=np.float32)  # copy out of the read-only memmap
    else:  # F16 / BF16 / every block-quantized type
        arr = dequantize(tensor.data, qtype)
    return np.ascontiguousarray(arr.reshape(hf_shape), dtype=np.float32)


def _save_tokenizer(gguf_path: str, out_dir: str, config: Any) -> Any:
    from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                        gguf_file=os.path.basename(gguf_path))
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.save_pretrained(out_dir)
    return tok


def _fix_permissions(path: str) -> None:
    """mkdtemp/safetensors create owner-only entries; give the cache normal umask permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o666 & ~mask)


def convert_gguf_to_hf(gguf_path: str, out_dir: str, progress: bool = False) -> str:
    """Convert a llama-architecture GGUF file into a float32 Hugging Face model directory.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer
    files (with the GGUF's chat template) into ``out_dir`` atomically and returns ``out_dir``.
    An existing ``out_dir`` is replaced. ``progress``: one progress bar on stderr (reading, then each
    tensor, the weights file, the tokenizer).
    """
    # deferred: torch, gguf and transformers are slow to import, and resolving an already converted
    # model path (embedded.py, loader.py) imports this module
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    gguf_path = os.path.abspath(gguf_path)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir = os.path.abspath(out_dir)

    bar = tqdm(desc="reading the GGUF", unit="step", disable=not progress, leave=False)
    reader = GGUFReader(gguf_path)
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} in {gguf_path} is not supported; only "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} GGUF files can be converted")

    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{gguf_path}: no token_embd.weight tensor")
    vocab_size = int(embd.shape[-1])  # GGUF shape is [hidden, vocab]
    config = gguf_to_hf_config(meta, has_output_tensor="output.weight" in names, vocab_size=vocab_size)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads

    tensors: dict[str, torch.Tensor] = {}
    bar.reset(total=len(reader.tensors) + 2)  # each tensor, then the weights file and the tokenizer
    bar.set_description_str("dequantizing tensors")
    for t in reader.tensors:
        bar.update()
        hf_name = gguf_tensor_name_to_hf(t.name)
        if hf_name is None:
            continue
        w = _dequantize(t)
        if hf_name.endswith("self_attn.q_proj.weight") or hf_name.endswith("self_attn.q_proj.bias"):
            w = unpermute_qk_from_gguf(w, n_head)
        elif hf_name.endswith("self_attn.k_proj.weight") or hf_name.endswith("self_attn.k_proj.bias"):
            w = unpermute_qk_from_gguf(w, n_kv)
        tensors[hf_name] = torch.from_numpy(w)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)

    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config.num_hidden_layers):
        for hf in _BLOCK_TENSOR_MAP.values():
            expected.add(f"model.layers.{i}.{hf}.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"{gguf_path}: missing tensors after conversion: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")

    parent = os.path.dirname(out_dir) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        config.save_pretrained(tmp)
        bar.set_description_str("writing model.safetensors")
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        del tensors
        bar.update()
        bar.set_description_str("converting the tokenizer")
        tok = _save_tokenizer(gguf_path, tmp, config)
        bar.update()
        bar.close()
        gen = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id if config.pad_token_id is not None else tok.pad_token_id,
        )
        gen.save_pretrained(tmp)
        st = os.stat(gguf_path)
        with open(os.path.join(tmp, CONVERSION_MARKER), "w") as f:
            json.dump({
                "source": gguf_path,
                "source_size": st.st_size,
                "source_mtime_ns": st.st_mtime_ns,
                "converter_version": CONVERTER_VERSION,
                "architecture": arch,
                "general.name": meta.get("general.name"),
                "file_type": meta.get("general.file_type"),
                "seconds": round(time.perf_counter() - t0, 3),
            }, f, indent=2)
        _fix_permissions(tmp)
        # swap into place: move an old directory aside first so the rename itself is atomic
        old = None
        if os.path.lexists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
