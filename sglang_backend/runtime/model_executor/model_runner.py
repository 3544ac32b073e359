"""Owns the model weights, the KV pools and the attention backend; runs one forward pass per batch."""

from __future__ import annotations

import logging

import torch

from ..mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from ..models.llama import head_dim_of
from ..models.registry import get_model_class
from .forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool on CPU when max_total_tokens is not given
MAX_DEFAULT_POOL_TOKENS = 1 << 18


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


class ModelRunner:
    def __init__(self, server_args, config, model_dir: str | None):
        self.server_args = server_args
        self.config = config
        self.device = resolve_device(server_args.device)
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        self.context_len = server_args.context_length or int(getattr(config, "max_position_embeddings", 2048))
        self.vocab_size = config.vocab_size
        self._load_model(model_dir)
        self._init_memory_pools()
        self._init_attention_backend()

    # Set-up ------------------------------------------------------------------------------------------------------
    def _load_model(self, model_dir: str | None) -> None:
        from ..model_loader.loader import iterate_weights

        torch.manual_seed(self.server_args.random_seed)
        model_cls = get_model_class(self.config)
        with torch.device("cpu"):
            model = model_cls(self.config)
        if self.server_args.load_format == "dummy":
            model.init_dummy_weights(self.server_args.random_seed)
        else:
            model.load_weights(iterate_weights(model_dir))
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        # The rope frequencies stay fp32 (HF keeps inv_freq in fp32 too).
        self.model.model.rotary_emb.inv_freq = self.model.model.rotary_emb.inv_freq.float()

    def _init_memory_pools(self) -> None:
        sa = self.server_args
        cfg = self.config
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = head_dim_of(cfg)
        per_token = MHATokenToKVPool.bytes_per_token(num_kv_heads, head_dim, cfg.num_hidden_layers, self.dtype)
        if sa.max_total_tokens:
            total = sa.max_total_tokens
        elif self.device == "cpu":
            total = min(CPU_KV_BUDGET_BYTES // per_token, MAX_DEFAULT_POOL_TOKENS)
        else:
            free, total_mem = torch.cuda.mem_get_info()
            budget = free - total_mem * (1 - sa.mem_fraction_static)
            total = int(budget // per_token)
            if total <= 0:
                raise RuntimeError("not enough GPU memory for the KV pool; raise --mem-fraction-static")
        total = max(sa.page_size, total // sa.page_size * sa.page_size)
        self.max_total_num_tokens = total
        self.req_to_token_pool = ReqToTokenPool(sa.max_running_requests, self.context_len + 8, self.device)
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
            from ..layers.attention.torch_native import TorchNativeAttnBackend

            self.attn_backend = TorchNativeAttnBackend()
        elif name == "triton":
            from ..layers.attention.triton_backend import TritonAttnBackend

            self.attn_backend = TritonAttnBackend(self)
        else:
            from ..layers.attention.flashinfer_backend import FlashInferAttnBackend

            self.attn_backend = FlashInferAttnBackend(self)

    # Forward ------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs the batch; returns float32 logits for the rows in ``fb.logits_indices``."""
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        if fb.logits_indices is None or len(fb.logits_indices) == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        return self.model.compute_logits(hidden[fb.logits_indices])
