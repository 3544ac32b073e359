"""Reference attention over the paged KV pool with torch SDPA. Exact on CPU; the GPU kernels are checked
against it. On the CPU (``native_kernels``), float32 decode steps and prefill batches whose requests each add at
most ``NATIVE_EXTEND_MAX`` tokens (a question after a cached prefix) run ``native/paged_attention.c`` instead,
which reads K and V in place from the pool rather than gathering a copy per layer and request (same arithmetic,
fp32). Longer prompts keep SDPA, whose blocked kernel beats one dot product per (query, key).

Sliding-window layers (``layer.sliding_window`` W) mask every key outside the last W positions up to the query
(HF's rule, see layers/radix_attention.py); layers with a ``logit_cap`` run HF's eager arithmetic (scores scaled,
softcapped, masked, softmax in fp32), which SDPA cannot express.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import native
from .base import AttentionBackend

# Longest extend (new tokens of one request) the native kernel takes; longer ones go to SDPA.
NATIVE_EXTEND_MAX = 64


def extend_mask(prefix_len: int, extend_len: int, window: int | None, device) -> torch.Tensor:
    """[extend_len, prefix_len + extend_len] bool: query j sits at position prefix_len + j and sees keys
    0 .. prefix_len + j, or with a window W only those after position prefix_len + j - W."""
    q_pos = torch.arange(prefix_len, prefix_len + extend_len, device=device)[:, None]
    k_pos = torch.arange(prefix_len + extend_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer) -> torch.Tensor:
    """q [b, H, E, D] over k, v [b, Hkv, L, D]; ``mask`` broadcast to [b, H, E, L] (None: causal, E == L)."""
    if layer.logit_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scaling,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scaling
    cap = layer.logit_cap
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, native_kernels: bool = False):
        kernels = native.kernels() if native_kernels else None
        self.native_attention = kernels.paged_attention if kernels is not None else None
        # the model's native rotary kernel stores the new K/V (RadixAttention.forward_qkv)
        self.supports_fused_kv_store = kernels is not None

    def init_forward_metadata(self, fb) -> None:
        self.kv_slots = []  # per request: KV slots of all its tokens (prefix + new)
        self.native_tokens = None  # (token_req, token_len) when the native kernel runs this batch
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices]
        if self.native_attention is not None and rows.device.type == "cpu":
            if fb.forward_mode.is_decode():
                self._native_metadata(rows, fb.seq_lens_cpu, [1] * len(fb.seq_lens_cpu))
                return
            if max(fb.extend_seq_lens_cpu, default=0) <= NATIVE_EXTEND_MAX:
                self._native_metadata(rows, fb.seq_lens_cpu, fb.extend_seq_lens_cpu)
                return
        if fb.forward_mode.is_decode():
            # Batched decode: pad every request's slot list to the longest, mask the padding out.
            max_len = max(fb.seq_lens_cpu)
            self.decode_seq_lens = torch.tensor(fb.seq_lens_cpu, device=rows.device)
            self.decode_pos = torch.arange(max_len, device=rows.device)
            self.decode_valid = self.decode_pos[None, :] < self.decode_seq_lens[:, None]  # [bs, max_len]
            self.decode_slots = torch.where(self.decode_valid, rows[:, :max_len], 0)
            self.decode_masks = {None: self.decode_valid}  # per sliding window, built by the first layer using it
        else:
            self.kv_slots = [rows[i, :n] for i, n in enumerate(fb.seq_lens_cpu)]

    def _native_metadata(self, rows, seq_lens: list[int], new_lens: list[int]) -> None:
        """Each new token's request and visible length: the request's last ``new`` positions, causally."""
        self.native_rows = rows.contiguous()  # [bs, max context]: each request's slots, read in place
        token_req = [b for b, n in enumerate(new_lens) for _ in range(n)]
        token_len = [total - n + 1 + i for total, n in zip(seq_lens, new_lens) for i in range(n)]
        self.native_tokens = (torch.tensor(token_req, dtype=torch.int64), torch.tensor(token_len, dtype=torch.int64))

    def forward_extend(self, q, k, v, layer, fb, save_kv: bool = True):
        pool = fb.token_to_kv_pool
        if save_kv:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
                               v.view(-1, layer.num_kv_heads, layer.head_dim))
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        if self.native_tokens is not None:
            return self._native_forward(q, k_buf, v_buf, layer)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        start = 0
        for i, (prefix_len, extend_len) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            slots = self.kv_slots[i]
            qi = q[start : start + extend_len].transpose(0, 1).unsqueeze(0)  # [1, H, E, D]
            ki = k_buf[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
            vi = v_buf[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            mask = None  # plain causal (no prefix, no window)
            if prefix_len > 0 or layer.sliding_window is not None:
                mask = extend_mask(prefix_len, extend_len, layer.sliding_window, q.device)
            out[start : start + extend_len] = attend(qi, ki, vi, mask, layer).squeeze(0).transpose(0, 1)
            start += extend_len
        return out.reshape(-1, layer.num_heads * layer.head_dim)

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        """[bs, max_len]: the valid slots, or with a window W only each request's last W."""
        if window not in self.decode_masks:
            self.decode_masks[window] = self.decode_valid & (self.decode_pos[None, :]
                                                             >= self.decode_seq_lens[:, None] - window)
        return self.decode_masks[window]

    def forward_decode(self, q, k, v, layer, fb, save_kv: bool = True):
        pool = fb.token_to_kv_pool
        if save_kv:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
                               v.view(-1, layer.num_kv_heads, layer.head_dim))
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        if self.native_tokens is not None:
            return self._native_forward(q, k_buf, v_buf, layer)
        q = q.view(-1, layer.num_heads, 1, layer.head_dim)  # [bs, H, 1, D]
        keys = k_buf[self.decode_slots].transpose(1, 2).to(q.dtype)  # [bs, Hkv, L, D]
        values = v_buf[self.decode_slots].transpose(1, 2).to(q.dtype)
        mask = self._decode_mask(layer.sliding_window)[:, None, None, :]
        out = attend(q, keys, values, mask, layer)
        return out.reshape(-1, layer.num_heads * layer.head_dim)

    def _native_forward(self, q, k_buf, v_buf, layer):
        if q.dtype != torch.float32 or k_buf.dtype != torch.float32:
            raise TypeError("the native attention runs float32 only (the CPU's dtype)")
        q = q.contiguous()
        out = torch.empty_like(q)
        rows, (token_req, token_len) = self.native_rows, self.native_tokens
        self.native_attention(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), rows.data_ptr(), rows.shape[1],
                              token_req.data_ptr(), token_len.data_ptr(), token_req.numel(), layer.num_heads,
                              layer.num_kv_heads, layer.head_dim, layer.scaling, layer.logit_cap or 0.0,
                              layer.sliding_window or 0, out.data_ptr(), torch.get_num_threads())
        return out.reshape(-1, layer.num_heads * layer.head_dim)
