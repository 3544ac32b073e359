"""FP8 (e4m3) linear weights with one scale per output channel; activations quantized per token on the fly.

Where the weights come from:

* online, ``--quantization fp8``: a float weight ``W [N, K]`` becomes ``Wq = e4m3(W / s)`` with
  ``s[n] = max|W[n, :]| / 448`` (:func:`quantize_weight`), after the checkpoint (or the dummy init) is loaded;
* an FP8 checkpoint (``quantization_config.quant_method`` "fp8", or "compressed-tensors" with 8-bit float
  weights): its e4m3 weights and ``weight_scale`` are loaded as they are. A per-tensor scale becomes one scale
  per row (fused q/k/v or gate/up layers keep each part's own scale that way). Its ``input_scale`` (static
  activation scales) is not used: activations are always scaled per token, which is at least as exact.
  Block-wise scales (``weight_block_size``) are refused with a clear error.

How they multiply (:func:`linear`): the activation rows are quantized to e4m3 with one scale each
(:func:`quantize_rows`: one Triton kernel on the GPU) and ``torch._scaled_mm`` runs the FP8 tensor-core GEMM
with the row and channel scales (fast accumulation on the GPU, as vLLM's kernels), writing the activation dtype. A one-row batch on the
GPU instead takes the Triton GEMV (``gemv(..., weight_scale=)``), which reads the e4m3 weights and multiplies
them by the unquantized activation: at batch 1 only the weight bytes matter, and they are half of bf16's.

FP8 GEMMs need compute capability 8.9 (Ada, Hopper) on the GPU; torch also runs ``_scaled_mm`` on the CPU
(slowly: tests use it). Embeddings, the LM head and MoE experts stay in the model dtype.
"""

from __future__ import annotations

import torch

try:  # optional: triton (the GPU row quantizer)
    from .attention.triton_ops.fp8_quant import quantize_rows_triton
except ImportError:
    quantize_rows_triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero row gets this scale (its quants are all zero anyway)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax * fp32(1/448), as the Triton quantizer computes it (bit for bit)."""
    return (amax.float() * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (e4m3 ``[N, K]``, fp32 scales ``[N]``): per output channel, amax mapped to 448 (the
    row quantizer's arithmetic, one row per channel)."""
    q, scale = quantize_rows_reference(weight)
    return q, scale.view(-1)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.float() * scale.float()[:, None]).to(dtype)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): each row's amax mapped to 448 (what the kernel computes)."""
    xf = x.float()
    scale = _scale_of(xf.abs().amax(dim=1, keepdim=True))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda and quantize_rows_triton is not None:
        return quantize_rows_triton(x)
    return quantize_rows_reference(x)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (Wq * s).T (+ bias)`` with ``x`` quantized per row: x ``[..., K]`` float, weight e4m3 ``[N, K]``,
    scale fp32 ``[N]``; out in x's dtype."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    N = weight.shape[0]
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], N)
    xq, xs = quantize_rows(x2)
    # Fast accumulation on the GPU, as vLLM's CUTLASS FP8 kernels use: the tensor cores' partial sums are not
    # promoted to fp32 every few K steps (the scales are applied once, in the epilogue, either way).
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, N), out_dtype=x.dtype,
                           use_fast_accum=x2.is_cuda)
    if bias is not None:  # after the scales, in the activation dtype (as an unquantized linear adds it)
        out += bias
    return out.reshape(*x.shape[:-1], N)


def runs_fp8_gemms(device) -> bool:
    """A CUDA GPU of compute capability 8.9+ (FP8 tensor cores), or the CPU (torch's ``_scaled_mm``)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type == "cpu"
    return torch.cuda.get_device_capability(dev) >= (8, 9)


def checkpoint_scheme(config) -> str | None:
    """The FP8 scheme of a checkpoint's ``quantization_config`` ("fp8"), None when it has none; raises for
    quantization this loader does not read (so a user sees why, not a shape error)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise NotImplementedError(f"block-wise FP8 checkpoints (weight_block_size={qc['weight_block_size']}) "
                                      "are not supported; per-tensor and per-channel FP8 are")
        return "fp8"
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if not (w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("tensor", "channel")):
                raise NotImplementedError(f"compressed-tensors scheme {w} is not supported; 8-bit float weights "
                                          "with per-tensor or per-channel scales are")
        return "fp8"
    raise NotImplementedError(f"quantization_config quant_method {method!r} is not supported (fp8 and GGUF are)")
