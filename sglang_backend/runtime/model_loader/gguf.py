"""GGUF (llama.cpp) -> Hugging Face directory conversion.

``convert_gguf_to_hf(gguf_path, out_dir)`` reads a GGUF file with the ``gguf`` package, maps llama.cpp tensor
names to Hugging Face names, undoes llama.cpp's rotary row permutation of the Q/K projections, and writes an HF
model directory (``config.json``, ``generation_config.json``, ``model.safetensors``, and the tokenizer with its
chat template). Tensors in a block format the CPU kernels run (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K: ``layers.gguf_quant``) are stored as their blocks, uint8 ``[rows, row_bytes]``, and named in the
safetensors metadata, so the directory is about the GGUF's size (tokenizer.json is written unindented for
that: Gemma 3's is 14 MB so, 33 MB indented); every other tensor is dequantized to float32. Our loader reads
both; ``loader.load_hf_reference`` builds the transformers model from it (dequantizing the blocks).

The directory is written into a temporary sibling first and renamed into place at the end, so a crash
never leaves a half-written model where a later run would look for one.

Supported architectures: ``llama`` (Llama, SmolLM, Mistral-as-llama GGUFs) and ``gemma3`` (Gemma 3 text
models -> ``Gemma3ForCausalLM``; llama.cpp stores its RMSNorm weights as ``1 + w`` and its Q/K rows unpermuted,
see :func:`_invert_llama_cpp`). Anything else raises ``NotImplementedError`` naming the architecture.
"""

from __future__ import annotations

import functools
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
    "GEMMA3_CHAT_TEMPLATE",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "convert_gguf_to_hf",
    "gguf_to_hf_config",
    "gguf_tensor_name_to_hf",
    "permute_qk_for_gguf",
    "unpermute_qk_from_gguf",
    "read_gguf_metadata",
]

# Bump when the output format changes so cached conversions are redone.
CONVERTER_VERSION = 3  # 2: Q4_0/Q4_1/Q8_0 tensors kept as blocks; 3: Q5_0/Q5_1/Q4_K/Q5_K/Q6_K too
# Written last inside a finished conversion; its presence marks the directory as complete.
CONVERSION_MARKER = "sglang_backend_conversion.json"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "gemma3")

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
# Gemma 3 (llama.cpp's MODEL_ARCH.GEMMA3 tensor list): four norms per block plus per-head q/k norms. Its
# ``ffn_norm`` is the *pre*-feedforward norm (gguf's FFN_PRE_NORM, an alias of FFN_NORM), not Llama's
# post_attention_layernorm, which here is ``post_attention_norm`` (ATTN_POST_NORM).
_GEMMA3_BLOCK_TENSOR_MAP = {
    **{k: v for k, v in _BLOCK_TENSOR_MAP.items() if k != "ffn_norm"},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_TENSOR_MAPS = {"llama": _BLOCK_TENSOR_MAP, "gemma3": _GEMMA3_BLOCK_TENSOR_MAP}
_GLOBAL_TENSOR_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that HF recomputes (precomputed rotary tables); skipped silently.
_SKIPPED_SUFFIXES = ("rope_freqs.weight", "attn_rot_embd.weight", "rope_factors_long.weight",
                     "rope_factors_short.weight")

# Gemma's turn format, for Gemma 3 GGUFs that carry no chat template (GGUFs of the pretrained checkpoints):
# ``<bos>``, then per message ``<start_of_turn>{user|model}\n{text}<end_of_turn>\n`` (a system message goes
# in front of the first user turn; Gemma has no system role), then ``<start_of_turn>model\n`` to answer.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] if messages[0]['content'] is string"
    " else messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if loop.first and ns.system -%}{{ ns.system + '\n\n' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] | trim }}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


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


def gguf_tensor_name_to_hf(name: str, arch: str = "llama") -> str | None:
    """Map a llama.cpp tensor name (``blk.3.attn_q.weight``) of a GGUF of architecture ``arch`` to its HF
    name, or None to skip it."""
    if name.endswith(_SKIPPED_SUFFIXES):
        return None
    base, _, kind = name.rpartition(".")  # kind: weight / bias
    if kind not in ("weight", "bias"):
        raise ValueError(f"Unexpected GGUF tensor name {name!r}")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = _BLOCK_TENSOR_MAPS[arch].get(part)
        if hf is None:
            raise NotImplementedError(f"GGUF tensor {name!r} has no Hugging Face {arch} equivalent")
        return f"model.layers.{int(layer)}.{hf}.{kind}"
    hf = _GLOBAL_TENSOR_MAP.get(base)
    if hf is None:
        raise NotImplementedError(f"GGUF tensor {name!r} has no Hugging Face {arch} equivalent")
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


def _required(meta: dict[str, Any], prefix: str):
    """``need(key)``: the metadata value at ``prefix + key``, or a ValueError naming the missing key."""
    def need(key: str) -> Any:
        if prefix + key not in meta:
            raise ValueError(f"GGUF metadata is missing required key {prefix + key!r}")
        return meta[prefix + key]

    return need


def gguf_to_hf_config(meta: dict[str, Any], *, has_output_tensor: bool, vocab_size: int | None = None):
    """Build a transformers ``LlamaConfig`` from GGUF metadata (``llama.*`` keys)."""
    from transformers import LlamaConfig  # deferred: transformers takes seconds to import

    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    if arch == "gemma3":
        return _gemma3_config(meta, has_output_tensor=has_output_tensor, vocab_size=vocab_size)
    p = f"{arch}."
    need = _required(meta, p)

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


def _gemma3_layer_types(meta: dict[str, Any], n_layers: int) -> list[str]:
    """Per-layer attention kinds. llama.cpp's converter writes no pattern for Gemma 3: its loader hard-codes
    ``set_swa_pattern(6)`` (every 6th layer global), as HF's default ``sliding_window_pattern`` does. Newer
    files may carry ``attention.sliding_window_pattern`` (an int period, or one bool per layer: sliding)."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries "
                             f"for {n_layers} layers")
        return ["sliding_attention" if s else "full_attention" for s in pattern]
    period = int(pattern)
    return ["full_attention" if period > 0 and (i + 1) % period == 0 else "sliding_attention"
            for i in range(n_layers)]


def _gemma3_config(meta: dict[str, Any], *, has_output_tensor: bool, vocab_size: int | None):
    """A transformers ``Gemma3TextConfig`` (``Gemma3ForCausalLM``) from ``gemma3.*`` GGUF metadata.

    What llama.cpp's ``Gemma3Model.set_gguf_parameters`` does not write, its model loader (llama-model.cpp,
    ``LLM_ARCH_GEMMA3``) hard-codes, and so do we: the sliding-window layers' rope base 10000 (HF's
    ``rope_local_base_freq``), the attention scale ``1/sqrt(head_dim)`` (HF ``query_pre_attn_scalar =
    head_dim``) except for the 62-layer 27B, where it is ``hidden_size / num_heads``. Rope scaling (linear)
    applies to the global layers only. EOS: ``<eos>`` and, when the vocabulary has it, the end-of-turn token
    (``tokenizer.ggml.eot_token_id``), both of which end generation in llama.cpp.
    """
    from transformers import Gemma3TextConfig  # deferred: transformers takes seconds to import

    p = "gemma3."
    need = _required(meta, p)

    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_layers = int(need("block_count"))
    head_dim = int(meta.get(p + "attention.key_length", 256))
    if vocab_size is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = int(len(tokens)) if tokens is not None else int(need("vocab_size"))
    full = {"rope_type": "default", "rope_theta": float(meta.get(p + "rope.freq_base", 1_000_000.0))}
    scaling_type = meta.get(p + "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        if scaling_type != "linear":
            raise NotImplementedError(f"gemma3 GGUF with rope scaling {scaling_type!r} (only linear is known)")
        full.update(rope_type="linear", factor=float(need("rope.scaling.factor")))
    local = {"rope_type": "default", "rope_theta": float(meta.get(p + "rope.freq_base_swa", 10_000.0))}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    softcap = meta.get(p + "final_logit_softcapping")
    return Gemma3TextConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=int(meta.get(p + "attention.head_count_kv", n_head)),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(p + "context_length", 131072)),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters={"full_attention": full, "sliding_attention": local},
        sliding_window=int(need("attention.sliding_window")),
        layer_types=_gemma3_layer_types(meta, n_layers),
        query_pre_attn_scalar=hidden // n_head if n_layers == 62 else head_dim,
        final_logit_softcapping=float(softcap) if softcap else None,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=not has_output_tensor,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[eos, eot] if eot is not None and eos is not None and eot != eos else eos,
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        architectures=["Gemma3ForCausalLM"],
        dtype="float32",
    )


def _find_token_id(reader: Any, text: str) -> int | None:
    """Id of the vocabulary entry spelled ``text`` (scanning ``tokenizer.ggml.tokens``), or None."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    want = text.encode("utf-8")
    for i, idx in enumerate(field.data):
        part = field.parts[idx]
        if len(part) == len(want) and bytes(part) == want:
            return i
    return None


# --------------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------------

@functools.cache
def _gguf_reader_class() -> type:
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map.

    The reader slices its ``np.memmap`` once per value (1.3 million times for the tokens, scores and token
    types of a 262k-token vocabulary), and every slice of a memmap subclass runs ``__getitem__`` and
    ``__array_finalize__`` in Python; on a plain ndarray view of the same mapping the slices are the same
    bytes at a third of the time (the reader takes 4-5 s instead of ~15 s on Gemma 3's GGUF). Defined on first
    use: gguf is slow to import, and resolving a cached model path imports this module.
    """
    from gguf import GGUFReader  # deferred: see the docstring

    class PlainViewGGUFReader(GGUFReader):
        def __init__(self, path: str):
            self._plain = np.memmap(path, mode="r").view(np.ndarray)  # the view keeps the mapping alive
            super().__init__(path, "r")

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
            """As ``GGUFReader._get`` (``count`` values of ``dtype`` at ``offset``, in the file's byte order)."""
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = self._plain[offset:end].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainViewGGUFReader


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


def _save_tokenizer(gguf_path: str, out_dir: str, config: Any, default_chat_template: str | None = None,
                    tokenizer_type: str | None = None) -> Any:
    """The GGUF's tokenizer (built by transformers from the vocabulary, merges and special tokens it carries)
    saved into ``out_dir``; ``default_chat_template`` is used when the GGUF carries no chat template.

    ``tokenizer_type``: the model type whose tokenizer class to build, when known. Without it AutoTokenizer
    first derives a config from the GGUF with transformers' generic GGUF loader, which decodes every metadata
    value (20-30 s for Gemma 3's 262k-token vocabulary on 2 cores) only to pick that class. None (llama):
    transformers has no tokenizer mapping for ``llama``, so its generic fast tokenizer is built directly."""
    # deferred: transformers takes seconds to import
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    where = dict(pretrained_model_name_or_path=os.path.dirname(os.path.abspath(gguf_path)),
                 gguf_file=os.path.basename(gguf_path))
    if tokenizer_type is None:
        # AutoTokenizer lands on the generic fast tokenizer (no mapping for llama) after deriving a whole config
        # with the slow generic reader: 7.3 s against 0.45 s for SmolLM2's 49k vocabulary, same saved files.
        tok = PreTrainedTokenizerFast.from_pretrained(**where)
    else:
        tok = AutoTokenizer.from_pretrained(**where, tokenizer_type=tokenizer_type)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    if default_chat_template is not None and not tok.chat_template:
        tok.chat_template = default_chat_template
    tok.save_pretrained(out_dir)
    # save_pretrained indents tokenizer.json: 33 MB for Gemma 3's 262k tokens, 14 MB without the indentation
    # (the cache is to stay within 10% of the GGUF's size)
    tok.backend_tokenizer.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    return tok


def _invert_llama_cpp(arch: str, hf_name: str, w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """Undo what llama.cpp's convert_hf_to_gguf.py did to an HF tensor.

    * llama: ``LlamaModel.modify_tensors`` permutes the Q/K rows (``LlamaModel.permute``) for llama.cpp's
      interleaved rope -> :func:`unpermute_qk_from_gguf`.
    * gemma3: ``Gemma3Model.modify_tensors`` adds ``norm_shift = 1.0`` to every ``*norm.weight`` (HF's
      Gemma3RMSNorm scales by ``1 + w``; llama.cpp's plain RMSNorm by the stored value) -> subtract 1. Q/K
      are not permuted (llama.cpp runs Gemma's rope in NEOX = HF's rotate-half layout).
    """
    if arch == "gemma3":
        return w - np.float32(1.0) if hf_name.endswith("norm.weight") else w
    if hf_name.endswith("self_attn.q_proj.weight") or hf_name.endswith("self_attn.q_proj.bias"):
        return unpermute_qk_from_gguf(w, n_head)
    if hf_name.endswith("self_attn.k_proj.weight") or hf_name.endswith("self_attn.k_proj.bias"):
        return unpermute_qk_from_gguf(w, n_kv)
    return w


def _kept_block_type(tensor: Any) -> str | None:
    """The tensor's GGUF type when it is stored as blocks (a matrix in a format the kernels run), else None."""
    from ..layers.gguf_quant import can_keep  # deferred: imports torch (see _convert_tensors)

    name = tensor.tensor_type.name
    return name if len(tensor.shape) == 2 and can_keep(name, int(tensor.shape[0])) else None


def _convert_tensors(reader: Any, arch: str, config: Any, gguf_path: str, bar: Any
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    """Every GGUF tensor renamed and inverted into an HF torch tensor (``bar`` ticks once per GGUF tensor):
    blocks kept as uint8 rows where ``_kept_block_type`` says so, float32 otherwise; and the kept tensors'
    types. Checks that no tensor the HF model needs is missing."""
    import torch  # deferred: torch is slow to import, and resolving a cached model path imports this module

    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    tensors: dict[str, torch.Tensor] = {}
    block_types: dict[str, str] = {}
    for t in reader.tensors:
        bar.update()
        hf_name = gguf_tensor_name_to_hf(t.name, arch)
        if hf_name is None:
            continue
        kept = _kept_block_type(t)
        if kept is not None:  # a row permutation (Q/K) moves whole rows of blocks
            block_types[hf_name] = kept
            data = np.array(t.data, dtype=np.uint8)  # [rows, row_bytes], copied out of the memmap
        else:
            data = _dequantize(t)
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(_invert_llama_cpp(arch, hf_name, data, n_head, n_kv)))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        block_types.pop("lm_head.weight", None)

    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config.num_hidden_layers):
        for hf in _BLOCK_TENSOR_MAPS[arch].values():
            expected.add(f"model.layers.{i}.{hf}.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"{gguf_path}: missing tensors after conversion: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    return tensors, block_types


def _fix_permissions(path: str) -> None:
    """mkdtemp/safetensors create owner-only entries; give the cache normal umask permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o666 & ~mask)


def convert_gguf_to_hf(gguf_path: str, out_dir: str, progress: bool = False,
                       marker_extra: dict[str, Any] | None = None) -> str:
    """Convert a llama- or gemma3-architecture GGUF file into a Hugging Face model directory (float32 but for
    the tensors kept as GGUF blocks, see the module docstring).

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer
    files (with the GGUF's chat template) into ``out_dir`` atomically and returns ``out_dir``.
    An existing ``out_dir`` is replaced. ``progress``: one progress bar on stderr (reading, then each
    tensor, the weights file, the tokenizer). ``marker_extra``: more fields for the conversion marker.
    """
    # deferred: gguf, safetensors and transformers are slow to import, and resolving an already converted
    # model path (embedded.py, loader.py) imports this module
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    from ..layers.gguf_quant import GGUF_TYPES_METADATA

    t0 = time.perf_counter()
    gguf_path = os.path.abspath(gguf_path)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir = os.path.abspath(out_dir)

    bar = tqdm(desc="reading the GGUF", unit="step", disable=not progress, leave=False)
    reader = _gguf_reader_class()(gguf_path)
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
    if arch == "gemma3" and "tokenizer.ggml.eot_token_id" not in meta:
        # as llama.cpp's vocabulary loader does: the end-of-turn token is found by its text
        meta = {**meta, "tokenizer.ggml.eot_token_id": _find_token_id(reader, "<end_of_turn>")}
    config = gguf_to_hf_config(meta, has_output_tensor="output.weight" in names, vocab_size=vocab_size)
    bar.reset(total=len(reader.tensors) + 2)  # each tensor, then the weights file and the tokenizer
    bar.set_description_str("converting tensors")
    tensors, block_types = _convert_tensors(reader, arch, config, gguf_path, bar)

    parent = os.path.dirname(out_dir) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        config.save_pretrained(tmp)
        bar.set_description_str("writing model.safetensors")
        save_file(tensors, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt", GGUF_TYPES_METADATA: json.dumps(block_types)})
        del tensors
        bar.update()
        bar.set_description_str("converting the tokenizer")
        if arch == "gemma3":
            tok = _save_tokenizer(gguf_path, tmp, config, default_chat_template=GEMMA3_CHAT_TEMPLATE,
                                  tokenizer_type=config.model_type)
        else:
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
                **(marker_extra or {}),
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
