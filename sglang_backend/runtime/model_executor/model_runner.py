"""Owns the model weights, the KV pools and the attention backend; runs one forward pass per batch."""

from __future__ import annotations

import logging

import torch

from ..mem_cache.memory_pool import MHATokenToKVPool, MirroredReqToTokenPool, ReqToTokenPool, TokenToKVPoolAllocator
from ..distributed.followers import ReqToTokenWriteLog, TPFollowers, release_graphs
from ..distributed.parallel_state import all_reduce_min, check_tp_config, kv_head_range, split_evenly
from ..layers import fp8
from ..layers.kernel_options import KernelOptions
from ..model_loader.loader import gguf_block_types, iterate_weights
from ..models.llama import LlamaForCausalLM, head_dim_of
from ..models.registry import get_model_class
from .cuda_graph_runner import CudaGraphRunner
from .forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

SMALL_MODEL_PARAMS = 64_000_000  # dummy weights up to this size are drawn on the host (reproducible across devices)
CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool on CPU when max_total_tokens is not given
MAX_DEFAULT_POOL_TOKENS = 1 << 18
MAX_GPU_POOL_TOKENS = 1 << 22  # tiny models: a bigger pool only costs start-up time and host memory


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, dtype)


def pool_hidden_states(hidden: torch.Tensor, spans: list) -> list:
    """Each span's final hidden states (after the final norm) summed in fp32, for embedding requests; the
    scheduler divides by the token count (mean pooling) once the whole prompt has been computed."""
    return [None if span is None else hidden[span[0]:span[1]].float().sum(dim=0) for span in spans]


class ModelRunner:
    def __init__(self, server_args, config, model_dir: str | None, tp_rank: int = 0):
        self.server_args = server_args
        self.config = config
        self.text_config = config.get_text_config()  # the LM's config (LLaVA nests it; Llama is its own)
        self.device = resolve_device(server_args.device)
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        self.tp_rank = tp_rank
        self.tp_followers = None  # rank 0 of a tensor-parallel group: its handle on the other ranks
        self.quantized_params: list[str] = []  # parameters kept as GGUF blocks (_keep_quantized)
        self.fp8_weights = False  # linear weights served as FP8 (_fp8_plan)
        if server_args.tp_size > 1:
            self._init_tensor_parallel()
        self.context_len = server_args.context_length or int(getattr(self.text_config, "max_position_embeddings", 2048))
        self.vocab_size = self.text_config.vocab_size
        heads = self.text_config.num_attention_heads
        grouped_query = (getattr(self.text_config, "num_key_value_heads", None) or heads) < heads
        self.kernel_options = KernelOptions.resolve(server_args, self.device, grouped_query)  # the layers' kernels
        try:
            self._load_model(model_dir)
            self._init_memory_pools()
            self._init_attention_backend()
            self._init_gpu_fast_path()
        except BaseException:
            self.shutdown(wait_s=5)  # tensor parallelism: do not leave the other ranks waiting
            raise
        if self.tp_followers is not None:
            self.tp_followers.ready = True  # every rank is past its start-up collectives

    # Set-up ------------------------------------------------------------------------------------------------------
    def _init_tensor_parallel(self) -> None:
        """Rank r uses cuda:r; rank 0 launches ranks 1..N-1 (which joined the group before building theirs)."""
        tp = self.server_args.tp_size
        if get_model_class(self.config) is not LlamaForCausalLM:
            raise ValueError("tp_size > 1 supports the Llama family (Llama, Mistral, Qwen2) only")
        check_tp_config(self.text_config, tp)
        if self.device.startswith("cuda"):
            if torch.cuda.device_count() < tp:
                raise ValueError(f"tp_size={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")
            self.device = f"cuda:{self.tp_rank}"
            torch.cuda.set_device(self.device)
        if self.tp_rank == 0:
            self.tp_followers = TPFollowers(self.server_args, self.device)

    def shutdown(self, wait_s: float = 30) -> None:
        """Stops the other tensor-parallel ranks (rank 0 only; nothing to do at tp_size 1)."""
        if self.tp_followers is not None:
            release_graphs(self)  # as the followers do: graphs first, then the communicators
            self.tp_followers.shutdown(wait_s)
            self.tp_followers = None

    def _load_model(self, model_dir: str | None) -> None:
        torch.manual_seed(self.server_args.random_seed)
        model_cls = get_model_class(self.config)
        fp8_checkpoint, serve_fp8 = self._fp8_plan()
        fp8_kept = fp8_checkpoint and serve_fp8  # else dequantized at load (and requantized online if serving FP8)
        if self.device == "cpu":
            with torch.device("cpu"):
                model = model_cls(self.config)
        else:
            # Build the parameters directly on the GPU in the target dtype: no fp32 copy on the host.
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                with torch.device(self.device):
                    model = model_cls(self.config)
            finally:
                torch.set_default_dtype(prev)
        if (fp8_checkpoint or serve_fp8) and not hasattr(model, "fp8_layers"):
            raise ValueError(f"FP8 weights are supported for the decoder-only models, not {type(model).__name__}")
        if fp8_checkpoint:
            for layer in model.fp8_layers():
                layer.keep_fp8()
        if self.server_args.load_format == "dummy" and self.device == "cpu":
            model.init_dummy_weights(self.server_args.random_seed)
        elif self.server_args.load_format == "dummy":
            self._init_dummy_weights(model)
        else:
            if self.device == "cpu":
                self.quantized_params = self._keep_quantized(model, model_dir)
            model.load_weights(iterate_weights(model_dir))
        if fp8_checkpoint and not fp8_kept:
            for layer in model.fp8_layers():
                layer.dequantize_fp8(self.dtype)
        if self.device == "cpu":  # built in fp32 on the host: floats to the run's dtype (uint8 blocks, e4m3 stay)
            model = model._apply(lambda t: t.to(self.dtype) if t.is_floating_point() and t.dtype != fp8.FP8 else t)
        else:
            model = model.to(self.device)  # buffers made on the host (rope init) move too
        if serve_fp8 and not fp8_kept:
            for layer in model.fp8_layers():
                if layer.gguf_type is None:
                    layer.quantize_fp8()
        self.fp8_weights = serve_fp8
        self.model = model.eval()
        # The rope frequencies stay fp32 (HF keeps inv_freq in fp32 too).
        self.model.model.rotary_emb.inv_freq = self.model.model.rotary_emb.inv_freq.float()

    def _fp8_plan(self) -> tuple[bool, bool]:
        """(the checkpoint's linear weights are FP8, serve them as FP8): ``--quantization fp8`` always (online
        from a float checkpoint), ``auto`` when the checkpoint is FP8 and the GPU runs FP8 GEMMs, ``none`` never."""
        sa = self.server_args
        scheme = fp8.checkpoint_scheme(self.text_config) if sa.load_format != "dummy" else None
        checkpoint = scheme == "fp8"
        if sa.quantization == "fp8":
            if not fp8.runs_fp8_gemms(self.device):
                raise ValueError(f"--quantization fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                                 f"{torch.cuda.get_device_name(self.device)} is "
                                 f"{'.'.join(map(str, torch.cuda.get_device_capability(self.device)))}")
            return checkpoint, True
        if sa.quantization == "auto" and checkpoint and self.device != "cpu" and fp8.runs_fp8_gemms(self.device):
            return True, True
        if checkpoint:
            logger.info("FP8 checkpoint: weights dequantized to %s at load (--quantization %s, device %s)",
                        self.dtype, sa.quantization, self.device)
        return checkpoint, False

    def _keep_quantized(self, model, model_dir: str) -> list[str]:
        """CPU, float32: the layers whose checkpoint weights are GGUF blocks keep them (``--quantization``)."""
        if (self.server_args.quantization == "none" or not self.kernel_options.native_cpu
                or self.dtype != torch.float32 or not hasattr(model, "keep_gguf_blocks")):
            return []
        block_types = gguf_block_types(model_dir)
        if not block_types:
            return []
        return model.keep_gguf_blocks(block_types)

    def _init_dummy_weights(self, model) -> None:
        """Small models: the model's own seeded host init (same weights as on the CPU). Large ones: the same
        rules (normal(0, initializer_range), norms ``dummy_norm_value``, biases 0) drawn on the GPU, in seconds."""
        seed = self.server_args.random_seed
        numel = sum(p.numel() for p in model.parameters())
        if numel <= SMALL_MODEL_PARAMS:
            model.init_dummy_weights(seed)
            return
        gen = torch.Generator(device=self.device).manual_seed(seed)
        std = float(getattr(self.text_config, "initializer_range", 0.02))
        norm_value = getattr(model, "dummy_norm_value", 1.0)  # Gemma's (1 + w) norms: 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(norm_value)
                elif name.endswith(".bias"):
                    p.zero_()
                elif self.server_args.tp_size == 1:
                    p.normal_(0.0, std, generator=gen)
                else:  # draw the full tensor and keep this rank's shard: the same model at every tp_size
                    full = torch.empty(model.full_shape(name, p), dtype=p.dtype, device=p.device)
                    model._load_full(name, p, full.normal_(0.0, std, generator=gen))

    def _init_memory_pools(self) -> None:
        sa = self.server_args
        cfg = self.text_config
        # This rank's KV heads (all of them at tp_size 1).
        self.num_heads = split_evenly(cfg.num_attention_heads, "num_attention_heads")
        num_kv_heads = self.num_kv_heads = kv_head_range(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)[1]
        head_dim = head_dim_of(cfg)
        per_token = MHATokenToKVPool.bytes_per_token(num_kv_heads, head_dim, cfg.num_hidden_layers, self.dtype)
        if sa.max_total_tokens:
            total = sa.max_total_tokens
        elif self.device == "cpu":
            total = min(CPU_KV_BUDGET_BYTES // per_token, MAX_DEFAULT_POOL_TOKENS)
        else:
            torch.cuda.empty_cache()
            free, total_mem = torch.cuda.mem_get_info(self.device)
            budget = free - total_mem * (1 - sa.mem_fraction_static)
            total = min(int(budget // per_token), MAX_GPU_POOL_TOKENS)
            if total <= 0:
                raise RuntimeError("not enough GPU memory for the KV pool; raise --mem-fraction-static")
        total = all_reduce_min(total)  # tensor parallelism: rank 0 hands out slots every rank must have
        total = max(sa.page_size, total // sa.page_size * sa.page_size)
        self.max_total_num_tokens = total
        if self.device != "cpu" and sa.attention_backend in ("triton", "flashinfer", "fa3"):
            self.req_to_token_pool = MirroredReqToTokenPool(sa.max_running_requests, self.context_len + 8, self.device)
        else:
            self.req_to_token_pool = ReqToTokenPool(sa.max_running_requests, self.context_len + 8, self.device)
        if self.tp_followers is not None:
            self.req_to_token_pool = ReqToTokenWriteLog(self.req_to_token_pool)  # replayed by the other ranks
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(total, sa.page_size, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(total, self.dtype, num_kv_heads, head_dim, cfg.num_hidden_layers,
                                                 self.device, sa.page_size)
        logger.info("KV pool: %d tokens (%.1f MiB)", total, total * per_token / 2**20)

    def _init_attention_backend(self) -> None:
        name = self.server_args.attention_backend
        if self.device == "cpu" and name != "torch_native":
            logger.warning("attention backend %s needs a GPU; using torch_native on CPU", name)
            name = "torch_native"
        if name == "torch_native":
            from ..layers.attention.torch_native import TorchNativeAttnBackend  # each backend only when chosen

            self.attn_backend = TorchNativeAttnBackend(native_kernels=self.kernel_options.native_cpu)
        elif name == "triton":
            from ..layers.attention.triton_backend import TritonAttnBackend  # optional: triton

            self.attn_backend = TritonAttnBackend(self)
        elif name == "fa3":
            from ..layers.attention.fa3_backend import FA3AttnBackend  # optional: FlashAttention 3 (vLLM's wheel)

            self.attn_backend = FA3AttnBackend(self)
        else:
            from ..layers.attention.flashinfer_backend import FlashInferAttnBackend  # optional: flashinfer

            self.attn_backend = FlashInferAttnBackend(self)

    def _init_gpu_fast_path(self) -> None:
        """GPU: CUDA graphs for decode, with backends that support them (triton). The fused kernels are chosen
        inside the model's layers from ``self.kernel_options``."""
        self.graph_runner = None
        if self.device == "cpu":
            return
        if not getattr(self.model, "supports_cuda_graph", True):
            logger.info("decode runs without CUDA graphs: without triton this model's MoE layers run the torch "
                        "path, which reads expert loads on the host each step")
        elif not self.server_args.disable_cuda_graph and self.attn_backend.supports_cuda_graph:
            self.graph_runner = CudaGraphRunner(self)

    def set_kernel_options(self, options: KernelOptions, capture_bs: list[int] | None = None) -> None:
        """Runs later batches with ``options`` (benchmarks compare kernel variants); CUDA graphs are captured
        again, for ``capture_bs`` (default: the same batch sizes). The attention backend keeps the split-count
        tuning it was built with (it sizes its scratch buffers)."""
        self.kernel_options = options
        if self.graph_runner is not None:
            capture_bs = capture_bs or self.graph_runner.capture_bs
            self.graph_runner = None  # its graphs' memory goes back before the new capture
            self.graph_runner = CudaGraphRunner(self, capture_bs)

    # Forward ------------------------------------------------------------------------------------------------------
    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb.input_ids, fb.positions, fb)

    def _compute_logits(self, hidden: torch.Tensor, options: KernelOptions) -> torch.Tensor:
        return self.model.compute_logits(hidden, options)

    def _logits_all_rows(self, fb: ForwardBatch) -> torch.Tensor:
        """Decode body captured by the CUDA graph runner: logits of every row, no host work."""
        return self._compute_logits(self._run_model(fb), fb.kernel_options)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs the batch; returns float32 logits for the rows in ``fb.logits_indices``."""
        if self.tp_followers is not None:
            self.tp_followers.send_forward(fb, self.req_to_token_pool.take())
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        fb.kernel_options = self.kernel_options.for_tokens(fb.input_ids.shape[0])
        sync = getattr(self.req_to_token_pool, "sync_to_device", None)
        if sync is not None:
            sync()
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        hidden = self._run_model(fb)
        if fb.pool_spans is not None:
            fb.pooled_sums = pool_hidden_states(hidden, fb.pool_spans)
        if fb.logits_indices is None or len(fb.logits_indices) == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        return self._compute_logits(hidden[fb.logits_indices], fb.kernel_options)
