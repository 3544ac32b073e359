"""Triton attention backend: paged extend (prefix + causal new tokens) and split-KV paged decode, fp16/bf16
(fp32 too, with exact dot products), any page size (the kernels read token-granular ``req_to_token``).

Per batch, ``init_forward_metadata`` does only host-side work plus (extend) one small host-to-device copy; the
decode path reads ``req_pool_indices`` / ``seq_lens`` straight from the batch's device tensors and uses scratch
buffers allocated once, so a decode step can be captured in a CUDA graph (see cuda_graph_runner.py).

Sliding-window layers (``layer.sliding_window``) pass the window to both kernels, which skip and mask the keys
outside it. In a cascade decode batch they run the plain split kernel instead: the shared prefix may lie partly
or wholly outside a request's window, and the simplest correct choice is not to split it off for them (global
layers of the same batch still use the cascade). Attention softcapping (``layer.logit_cap``) is not implemented
in these kernels.
"""

from __future__ import annotations


import torch

from ....utils import to_device_async
from ..kernel_options import DEFAULT_OPTIONS
from .base import AttentionBackend, device_table
from .triton_ops.decode_attention import decode_attention_fwd, num_prefix_programs_per_split, shared_prefix_len
from .triton_ops.extend_attention import extend_attention_fwd
from .triton_ops.fused_ops import store_kv

MAX_KV_SPLITS = 32
# Decode folds the merge of the splits into stage 1 (decode_attention.py: the last split to finish merges)
# unless the batch's KernelOptions.attention_merge is "stage2" (--attention-merge; the bench compares both).
# The stage-1 programs per SM that decode aims for when it splits sequences (num_kv_splits) are a tuned
# per-device value (KernelConfigs.target_programs_per_sm), fixed when the backend is built (it sizes scratch).
# Cascade decode (a prefix shared by the whole batch read once per tile, not once per request) from this batch
# size up; below it the extra launch per layer costs more than the shared reads save.
CASCADE_MIN_BS = 8
MAX_PREFIX_SPLITS = 8


def num_kv_splits(bs: int, heads_per_req: int, num_sms: int, target_programs_per_sm: float) -> int:
    """Splits along the sequence in decode so that bs * heads_per_req * splits fills the GPU (a constant per
    batch size, so a CUDA graph captured for bs serves every sequence length)."""
    return max(1, min(MAX_KV_SPLITS, -(-int(target_programs_per_sm * num_sms) // (bs * heads_per_req))))


def prefix_splits_for(bs: int, num_heads: int, num_kv_heads: int, num_sms: int, configs) -> int:
    """Splits of the shared prefix in a cascade decode batch of bs requests: about
    ``configs.prefix_programs_per_sm`` programs of the prefix kernel per SM, at least 2 (one pass over a long
    prefix per program starves the memory pipeline, measured)."""
    progs = num_prefix_programs_per_split(bs, num_heads, num_kv_heads, configs)
    return max(2, min(MAX_PREFIX_SPLITS, round(configs.prefix_programs_per_sm * num_sms / progs)))


class TritonAttnBackend(AttentionBackend):
    # The model may write K/V into the pool itself (fused with rotary) and call forward(..., save_kv=False);
    # decode runs in CUDA graphs (cuda_graph_runner.py).
    supports_fused_kv_store = True
    supports_cuda_graph = True

    def __init__(self, model_runner):
        self.device = torch.device(model_runner.device)
        self.num_heads = model_runner.num_heads  # this rank's heads (tensor parallelism splits them)
        self.num_kv_heads = model_runner.num_kv_heads
        self.head_dim = model_runner.token_to_kv_pool.head_dim
        self.configs = model_runner.kernel_options.configs  # launch configs; split counts fixed from here on
        props = torch.cuda.get_device_properties(self.device)
        self.num_sms = props.multi_processor_count
        # Programs per (request, split) in decode stage 1: one per KV head (its query heads are the rows).
        self.heads_per_req = self.num_kv_heads
        max_bs = int(model_runner.server_args.max_running_requests)
        # bs * splits <= bs + target programs / heads_per_req for every bs (see num_kv_splits).
        rows = max_bs + self._target_programs() // self.heads_per_req + 1
        self.use_cascade = not model_runner.server_args.disable_cascade_attention
        if self.use_cascade:
            rows += max_bs * MAX_PREFIX_SPLITS
        rows = max(rows, MAX_KV_SPLITS)
        self.mid_o = torch.empty(rows * self.num_heads * self.head_dim, dtype=torch.float32, device=self.device)
        self.mid_lse = torch.empty(rows * self.num_heads, dtype=torch.float32, device=self.device)
        # Per (request, head) split counters of the fused merge; every launch leaves them zero.
        self.merge_counters = torch.zeros(max_bs * self.num_heads, dtype=torch.int32, device=self.device)
        self.decode_splits = 1
        self.prefix_splits = 0  # > 0: this decode batch runs in cascade mode
        self.prefix_len = torch.zeros(1, dtype=torch.int32, device=self.device)  # read by the kernels (graphs too)
        self.num_cascade_steps = 0  # decode steps run in cascade mode
        self.positions = torch.arange(model_runner.req_to_token_pool.max_context_len, device=self.device)
        self.forward_metadata = None

    def _target_programs(self) -> int:
        return int(self.configs.target_programs_per_sm * self.num_sms)

    def num_kv_splits(self, bs: int) -> int:
        return num_kv_splits(bs, self.heads_per_req, self.num_sms, self.configs.target_programs_per_sm)

    def num_prefix_splits(self, bs: int, shares_prefix: bool = True) -> int:
        """Splits of the shared prefix in cascade decode (0: no cascade at this batch size, or for a batch whose
        requests share no prefix long enough to pay for it, ``ForwardBatch.shares_prefix``: the plain kernel merges
        its splits itself, while cascade mode costs a prefix kernel per layer, and a stage-2 kernel when the
        per-request part is split too)."""
        if not self.use_cascade or bs < CASCADE_MIN_BS or not shares_prefix:
            return 0
        return prefix_splits_for(bs, self.num_heads, self.num_kv_heads, self.num_sms, self.configs)

    def _scratch(self, bs: int, splits: int):
        n = bs * self.num_heads * splits
        assert n * self.head_dim <= self.mid_o.numel(), "decode batch larger than max_running_requests"
        mid_o = self.mid_o[: n * self.head_dim].view(bs, self.num_heads, splits, self.head_dim)
        mid_lse = self.mid_lse[:n].view(bs, self.num_heads, splits)
        return mid_o, mid_lse

    def _set_decode_shape(self, bs: int, shares_prefix: bool) -> None:
        self.decode_splits = self.num_kv_splits(bs)
        self.prefix_splits = self.num_prefix_splits(bs, shares_prefix)
        self.forward_metadata = None

    def decode_graph_variants(self, bs: int) -> tuple[bool, ...]:
        """The ``shares_prefix`` values whose decode graphs differ at batch size bs (cascade or not)."""
        return (False, True) if self.num_prefix_splits(bs) else (False,)

    def update_shared_prefix(self, req_to_token_pool, req_pool_indices, seq_lens_cpu, padded_bs: int,
                             shares_prefix: bool = True) -> None:
        """Cascade batches: find on the device how many leading KV slots all requests share (no host sync)."""
        if self.num_prefix_splits(padded_bs, shares_prefix):
            self.num_cascade_steps += 1
            shared_prefix_len(device_table(req_to_token_pool), req_pool_indices, min(seq_lens_cpu), self.positions,
                              self.prefix_len)

    # Metadata ------------------------------------------------------------------------------------------------
    def init_forward_metadata(self, fb) -> None:
        if fb.forward_mode.is_decode():
            self._set_decode_shape(fb.batch_size, fb.shares_prefix)
            self.update_shared_prefix(fb.req_to_token_pool, fb.req_pool_indices, fb.seq_lens_cpu, fb.batch_size,
                                      fb.shares_prefix)
            return
        prefix = fb.extend_prefix_lens_cpu
        extend = fb.extend_seq_lens_cpu
        starts, acc = [], 0
        for e in extend:
            starts.append(acc)
            acc += e
        # Rows padded to 16 bytes: Triton specialises a kernel on whether each pointer is 16-byte aligned, so row
        # views at batch-size-dependent offsets would compile a new extend kernel mid-run for some batch sizes.
        n = len(extend)
        width = -(-n // 4) * 4
        meta = torch.zeros((3, width), dtype=torch.int32)
        meta[:, :n] = torch.tensor([prefix, extend, starts], dtype=torch.int32)
        meta = to_device_async(meta, self.device)  # through pinned memory: no wait for the GPU's queue
        self.forward_metadata = (meta[0, :n], meta[1, :n], meta[2, :n], max(extend) if extend else 0)

    def init_forward_metadata_capture(self, bs: int, shares_prefix: bool = True) -> None:
        """Decode metadata for a CUDA graph of (padded) batch size bs; in cascade mode the shared prefix length
        is a device tensor the graph reads, refreshed before each replay (update_shared_prefix)."""
        self._set_decode_shape(bs, shares_prefix)
        self.prefix_len.zero_()

    # Attention -----------------------------------------------------------------------------------------------
    def _save(self, k, v, layer, fb) -> None:
        pool = fb.token_to_kv_pool
        store_kv(k, v, fb.out_cache_loc, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                 pdl=(fb.kernel_options or DEFAULT_OPTIONS).pdl)

    @staticmethod
    def _check(layer) -> None:
        if layer.logit_cap is not None:
            raise NotImplementedError("the triton attention backend has no attention logit softcapping; use "
                                      "--attention-backend torch_native or flashinfer for this model")

    def forward_extend(self, q, k, v, layer, fb, save_kv: bool = True):
        self._check(layer)
        if save_kv:
            self._save(k, v, layer, fb)
        pool = fb.token_to_kv_pool
        prefix_lens, extend_lens, extend_start, max_extend = self.forward_metadata
        T = q.shape[0]
        qv = q.view(T, layer.num_heads, layer.head_dim)
        o = torch.empty((T, layer.num_heads, layer.head_dim), dtype=q.dtype, device=q.device)
        extend_attention_fwd(qv, o, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                             device_table(fb.req_to_token_pool), fb.req_pool_indices, prefix_lens, extend_lens,
                             extend_start, max_extend, layer.scaling, sliding_window=layer.sliding_window)
        return o.view(T, layer.num_heads * layer.head_dim)

    def forward_decode(self, q, k, v, layer, fb, save_kv: bool = True):
        self._check(layer)
        if save_kv:
            self._save(k, v, layer, fb)
        pool = fb.token_to_kv_pool
        opts = fb.kernel_options or DEFAULT_OPTIONS
        bs = q.shape[0]
        splits, prefix_splits = self.decode_splits, self.prefix_splits
        mid_o, mid_lse = self._scratch(bs, splits + prefix_splits)
        if layer.sliding_window is not None:
            prefix_splits = 0  # no cascade for windowed layers (module docstring); the same scratch layout
        qv = q.view(bs, layer.num_heads, layer.head_dim)
        o = torch.empty((bs, layer.num_heads, layer.head_dim), dtype=q.dtype, device=q.device)
        decode_attention_fwd(qv, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), o,
                             device_table(fb.req_to_token_pool), fb.req_pool_indices, fb.seq_lens, mid_o, mid_lse,
                             splits, layer.scaling, prefix_len=self.prefix_len, prefix_splits=prefix_splits,
                             merge_counters=self.merge_counters if opts.attention_merge == "fused" else None,
                             configs=opts.configs if fb.kernel_options is not None else self.configs, pdl=opts.pdl,
                             sliding_window=layer.sliding_window)
        return o.view(bs, layer.num_heads * layer.head_dim)
