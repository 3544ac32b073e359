"""Reference attention over the paged KV pool with torch SDPA. Exact on CPU; the GPU kernels are checked
against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend


class TorchNativeAttnBackend(AttentionBackend):
    def init_forward_metadata(self, fb) -> None:
        self.kv_slots = []  # per request: KV slots of all its tokens (prefix + new)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices]
        if fb.forward_mode.is_decode():
            # Batched decode: pad every request's slot list to the longest, mask the padding out.
            max_len = max(fb.seq_lens_cpu)
            seq_lens = torch.tensor(fb.seq_lens_cpu, device=rows.device)
            pos = torch.arange(max_len, device=rows.device)
            self.decode_valid = pos[None, :] < seq_lens[:, None]  # [bs, max_len]
            self.decode_slots = torch.where(self.decode_valid, rows[:, :max_len], 0)
        else:
            self.kv_slots = [rows[i, :n] for i, n in enumerate(fb.seq_lens_cpu)]

    def forward_extend(self, q, k, v, layer, fb, save_kv: bool = True):
        pool = fb.token_to_kv_pool
        if save_kv:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
                               v.view(-1, layer.num_kv_heads, layer.head_dim))
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        start = 0
        for i, (prefix_len, extend_len) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            slots = self.kv_slots[i]
            qi = q[start : start + extend_len].transpose(0, 1).unsqueeze(0)  # [1, H, E, D]
            ki = k_buf[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
            vi = v_buf[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            if prefix_len == 0:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scaling, enable_gqa=True)
            else:
                # Query j sits at position prefix_len + j and sees keys 0..prefix_len + j.
                mask = torch.ones(extend_len, prefix_len + extend_len, dtype=torch.bool, device=q.device)
                mask = mask.tril(diagonal=prefix_len)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
            out[start : start + extend_len] = oi.squeeze(0).transpose(0, 1)
            start += extend_len
        return out.reshape(-1, layer.num_heads * layer.head_dim)

    def forward_decode(self, q, k, v, layer, fb, save_kv: bool = True):
        pool = fb.token_to_kv_pool
        if save_kv:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
                               v.view(-1, layer.num_kv_heads, layer.head_dim))
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        q = q.view(-1, layer.num_heads, 1, layer.head_dim)  # [bs, H, 1, D]
        keys = k_buf[self.decode_slots].transpose(1, 2).to(q.dtype)  # [bs, Hkv, L, D]
        values = v_buf[self.decode_slots].transpose(1, 2).to(q.dtype)
        mask = self.decode_valid[:, None, None, :]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
        return out.reshape(-1, layer.num_heads * layer.head_dim)
