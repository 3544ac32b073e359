"""Which kernels a forward pass uses, and their tuned launch configurations: one small object, resolved once
from ``ServerArgs`` by the model runner and handed to the layers and the attention backend with every batch
(``ForwardBatch.kernel_options``). Nothing here is read from the environment or from module globals.

* ``fused_ops``: Triton kernels inside the layers (RMSNorm with the residual add, rotary + KV store, SiLU-mul);
  off: the exact torch reference modules (always so on the CPU);
* ``native_cpu``: the C kernels of ``layers/native`` on the CPU (RMSNorm, decode attention read in place from
  the pool, matmuls over GGUF blocks), unless ``--disable-native-cpu-kernels`` or they do not build here;
* ``cpu_activation_quant``: with ``native_cpu``, ``q8`` multiplies GGUF block weights by activations rounded to
  8 bits per block of 32 (as llama.cpp; ``--cpu-activation-quant``), else ``none`` (float32 activations);
* ``gemv_mode``: one-token batches (decode at batch 1) through the Triton GEMV: ``off`` (cuBLAS), ``on`` (GEMV,
  norms and SiLU-mul separate), ``fused`` (the RMSNorm in the GEMV's prologue, SiLU-mul and the residual add in
  its epilogues), ``fused_rope`` (``fused`` plus rotary and the KV store in the qkv GEMV's epilogue, with
  backends that let the model store KV). ``auto``: ``fused_rope`` on Hopper and newer (measured fastest on an
  H100: 5.46 ms per batch-1 Llama-2-7B step against 5.55 for ``fused``, 5.78 for ``on``, 6.16 for cuBLAS),
  else ``off``;
* ``pdl``: programmatic dependent launch for the kernels that support it (only where the GPU and Triton do:
  see triton_ops/pdl.py);
* ``attention_merge``: triton decode attention merges its sequence splits in stage 1 (``fused``: the last split
  to finish merges) or in a separate ``stage2`` kernel;
* ``configs``: launch configurations tuned per device (:class:`KernelConfigs`), from
  ``triton_ops/configs/<device name>.json`` or ``--kernel-config``, else the built-in defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from dataclasses import dataclass, field

import torch

from ..server_args import CPU_ACTIVATION_QUANTS, GEMV_MODES
from . import native
CONFIG_DIR = pathlib.Path(__file__).parent / "attention" / "triton_ops" / "configs"

try:  # optional: triton (GPU kernels); without it every fused kernel is off
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


@dataclass(frozen=True)
class KernelConfigs:
    """Tuned launch parameters (the defaults are the values tuned on an H100 with benchmarks/bench_gpu.py)."""

    # Batch-1 GEMV (BLOCK_N, BLOCK_K, num_warps, num_stages): 4 rows x 1024-wide K tiles won for Llama-2-7B's
    # qkv, gate_up and down_proj and tied for o_proj (gemv_step_sweep, judged on the whole batch-1 step).
    gemv: tuple = (4, 1024, 4, 3)
    # Per-shape overrides, keyed "rows,cols,silu_mul" (e.g. "22016,4096,1"): what gemv_step_sweep writes.
    gemv_shapes: dict = field(default_factory=dict)
    # The same for FP8 weights (half the bytes per tile); per-shape overrides keyed "rows,cols,silu_mul,fp8".
    gemv_fp8: tuple = (4, 512, 2, 4)
    # Decode attention stage 1 (BLOCK_N, num_warps, num_stages, head_fastest) for small batches (the sequence
    # split many ways) and large ones (from decode_large_batch up); MHA through tl.dot, GQA with the query heads
    # of a KV head as the rows of one tile (bench_gpu attn_sweep).
    # An optional "cascade" entry serves the per-request part of a cascade batch (its own tokens after the
    # shared prefix: usually short, one tile, so small tiles that keep many programs per SM win; else "large").
    decode_mha: dict = field(default_factory=lambda: {"small": (64, 2, 1, True), "large": (64, 4, 3, False)})
    decode_gqa: dict = field(default_factory=lambda: {"small": (64, 4, 2, True), "large": (128, 4, 2, False)})
    decode_large_batch: int = 16
    # Cascade decode's shared-prefix kernel (BLOCK_M rows of (request, query head), BLOCK_N tokens per KV tile,
    # num_warps, num_stages): the fastest on an H100 at Llama-3-8B's shape, 1k-token prefix, batch 64 to 256
    # (41.7 us per layer at batch 128 against 50.7 for (64, 64, 4, 2)), with about one program per SM (below).
    decode_prefix: tuple = (64, 128, 4, 2)
    prefix_programs_per_sm: float = 1.0
    # Stage-1 programs per SM that decode aims for when it splits sequences: 16 splits at batch 1 for 32 MHA
    # heads on 132 SMs, the fastest in attn_sweep on an H100 (11.1 us per layer at 1k context vs 11.9 for 32).
    target_programs_per_sm: float = 3.875
    # Fused MoE (triton_ops/fused_moe.py) per layer shape "E,k,H,I" (I per rank): rows [max tokens, BLOCK_M,
    # BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages], the first with T <= max tokens wins (a null bound
    # matches all); shapes not listed use fused_moe's built-in table (benchmarks/bench_moe.py --sweep).
    fused_moe_shapes: dict = field(default_factory=dict)

    def gemv_config(self, rows: int, cols: int, silu_mul: bool, fp8: bool = False) -> tuple:
        key = f"{rows},{cols},{int(silu_mul)}" + (",fp8" if fp8 else "")
        return tuple(self.gemv_shapes.get(key, self.gemv_fp8 if fp8 else self.gemv))

    def decode_config(self, mha: bool, bs: int, cascade: bool = False) -> tuple:
        table = self.decode_mha if mha else self.decode_gqa
        if cascade and "cascade" in table:
            return tuple(table["cascade"])
        return tuple(table["large" if bs >= self.decode_large_batch else "small"])

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict) -> "KernelConfigs":
        """Missing keys keep the defaults; unknown ones are refused (a typo would silently change nothing)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"kernel config: unknown keys {unknown}; known: {sorted(names)}")
        base = cls()
        merged = {}
        for k, v in data.items():
            if k in ("decode_mha", "decode_gqa"):
                v = {**getattr(base, k), **{size: tuple(c) for size, c in v.items()}}
            elif k in ("gemv", "gemv_fp8", "decode_prefix"):
                v = tuple(v)
            elif k == "gemv_shapes":
                v = {key: tuple(c) for key, c in v.items()}
            elif k == "fused_moe_shapes":
                v = {key: tuple(tuple(row) for row in rows) for key, rows in v.items()}
            merged[k] = v
        return dataclasses.replace(base, **merged)


def device_config_name(device) -> str | None:
    """File name of the tuned configs of ``device``'s GPU model ("NVIDIA_H100_80GB_HBM3.json"); None off CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(dev)).strip("_") + ".json"


def load_kernel_configs(device, path: str | None = None) -> KernelConfigs:
    """``path`` if given, else this device's file in triton_ops/configs/ if there is one, else the defaults."""
    if path is None:
        name = device_config_name(device)
        candidate = CONFIG_DIR / name if name else None
        if candidate is None or not candidate.is_file():
            return KernelConfigs()
        path = str(candidate)
    with open(path) as f:
        return KernelConfigs.from_json(json.load(f))


@dataclass(frozen=True)
class KernelOptions:
    """Resolved for one device (``resolve``): on the CPU every kernel choice is off, so the layers run the torch
    reference whatever the flags say (the layers themselves look only at these options)."""

    fused_ops: bool = False
    native_cpu: bool = False  # the CPU's C kernels (layers/native): RMSNorm, decode attention, GGUF matmuls
    cpu_activation_quant: str = "none"  # q8: the GGUF matmuls round activations to 8 bits (needs native_cpu)
    gemv_mode: str = "off"  # resolved: off, on, fused or fused_rope
    pdl: bool = False
    attention_merge: str = "fused"
    configs: KernelConfigs = field(default_factory=KernelConfigs)
    # A one-token batch's PDL and merge where they differ from the above (``for_tokens``: auto on GQA models).
    one_token_pdl: bool | None = None
    one_token_merge: str | None = None

    def __post_init__(self):
        if self.gemv_mode not in GEMV_MODES[1:]:
            raise ValueError(f"gemv_mode must be one of {GEMV_MODES[1:]} once resolved, got {self.gemv_mode!r}")
        for merge in (self.attention_merge, self.one_token_merge or "fused"):  # resolved: never "auto"
            if merge not in ("fused", "stage2"):
                raise ValueError(f"attention_merge must be fused or stage2, got {merge!r}")
        if self.cpu_activation_quant not in CPU_ACTIVATION_QUANTS:
            raise ValueError(f"cpu_activation_quant must be one of {CPU_ACTIVATION_QUANTS}, "
                             f"got {self.cpu_activation_quant!r}")
        if self.cpu_activation_quant != "none" and not self.native_cpu:
            raise ValueError(f"cpu_activation_quant {self.cpu_activation_quant!r} needs native_cpu (the C kernels)")
        if self.gemv_mode != "off" and not self.fused_ops:
            raise ValueError(f"gemv_mode {self.gemv_mode!r} needs fused_ops (the Triton kernels)")

    def for_tokens(self, num_tokens: int) -> "KernelOptions":
        """The options of a batch of ``num_tokens`` tokens (``one_token_*`` applied for a single one)."""
        return self._one_token if num_tokens == 1 else self

    @functools.cached_property
    def _one_token(self) -> "KernelOptions":
        pdl = self.pdl if self.one_token_pdl is None else self.one_token_pdl
        merge = self.one_token_merge or self.attention_merge
        if (pdl, merge) == (self.pdl, self.attention_merge):
            return self
        return dataclasses.replace(self, pdl=pdl, attention_merge=merge, one_token_pdl=None, one_token_merge=None)

    @property
    def fused_gemv(self) -> bool:
        """One-token batches fold the norms and the residual adds into the GEMVs (decoder layers)."""
        return self.gemv_mode in ("fused", "fused_rope")

    @property
    def q8_activations(self) -> bool:
        """GGUF block matmuls quantize their activations to 8 bits (gguf_quant.matmul / gemv_fused ``q8``)."""
        return self.cpu_activation_quant == "q8"

    def one_token_path(self, x: torch.Tensor) -> bool:
        """Whether a one-token batch ``x`` runs the decoder layers' fused one-token path (forward_one_token): the
        fused GEMVs on the GPU, the native kernels' fused calls on a float32 CPU run."""
        return x.shape[0] == 1 and (self.fused_gemv or (self.native_cpu and x.dtype == torch.float32))

    def use_gemv(self, x: torch.Tensor) -> bool:
        """Whether a linear layer runs ``x`` through the GEMV (one row, GEMV on)."""
        return self.gemv_mode != "off" and x.shape[0] == 1

    @classmethod
    def resolve(cls, server_args, device, grouped_query: bool = False) -> "KernelOptions":
        """From ``ServerArgs`` (gemv_mode, disable_fused_ops, pdl, attention_merge, kernel_config,
        disable_native_cpu_kernels, cpu_activation_quant), the device and the model (``grouped_query``: fewer KV
        heads than query heads): the Triton kernels off on the CPU or without triton, the C kernels on on the CPU
        when they build (and 8-bit activations with them when asked); ``auto`` GEMV mode by compute capability,
        ``auto`` PDL and merge by the attention's shape: on a GQA model a one-token batch runs without PDL and
        with the stage-2 merge, larger ones with both (Llama-3-8B on an H200: batch 1 4.47 vs 4.67 ms per engine
        step, batch 64 7.70 vs 7.96-8.03 ms the other way round)."""
        dev = torch.device(device)
        on_gpu = dev.type == "cuda" and HAVE_TRITON
        fused = on_gpu and not server_args.disable_fused_ops
        mode = server_args.gemv_mode
        if not fused:
            mode = "off"
        elif mode == "auto":
            mode = "fused_rope" if torch.cuda.get_device_capability(dev.index or 0)[0] >= 9 else "off"
        native_cpu = dev.type == "cpu" and not server_args.disable_native_cpu_kernels and native.kernels() is not None
        options = cls(fused_ops=fused, native_cpu=native_cpu,
                      cpu_activation_quant=server_args.cpu_activation_quant if native_cpu else "none", gemv_mode=mode,
                      pdl=on_gpu and server_args.pdl != "off",
                      attention_merge="fused" if server_args.attention_merge == "auto" else server_args.attention_merge,
                      configs=load_kernel_configs(dev, server_args.kernel_config) if on_gpu else KernelConfigs())
        if not grouped_query:
            return options
        return dataclasses.replace(options, one_token_pdl=False if server_args.pdl == "auto" else None,
                                   one_token_merge="stage2" if server_args.attention_merge == "auto" else None)


DEFAULT_OPTIONS = KernelOptions()
