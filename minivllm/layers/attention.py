"""Attention over the paged KV cache for mixed batches (torch SDPA; runs on CPU and CUDA).

The cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`;
token t lives at flat slot `block_id * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.forward_context import AttentionMetadata, get_attention_metadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache = torch.empty(0)  # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H*D], k and v: [T, Hkv*D] -> [T, H*D]."""
        meta = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = self.kv_cache[0], self.kv_cache[1]
        flat_k = key_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = value_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.decode_req_indices:
            self._decode(q, key_cache, value_cache, meta, out)
        for i in meta.prefill_req_indices:
            self._prefill(i, q, k, v, flat_k, flat_v, meta, out)
        return out.view(-1, self.num_heads * self.head_dim)

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        num = meta.decode_block_tables.shape[0]
        keys = key_cache[meta.decode_block_tables].view(num, -1, self.num_kv_heads, self.head_dim)
        values = value_cache[meta.decode_block_tables].view(
            num, -1, self.num_kv_heads, self.head_dim
        )
        key_pos = torch.arange(keys.shape[1], device=q.device)
        seq_lens = meta.decode_seq_lens.unsqueeze(1)
        mask = key_pos < seq_lens
        if self.sliding_window is not None:
            mask &= key_pos >= seq_lens - self.sliding_window
        query = q[meta.decode_token_indices].unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            query,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=True,
        )
        out[meta.decode_token_indices] = o.squeeze(2)

    def _prefill(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        start, end = meta.cu_seqlens_q[i], meta.cu_seqlens_q[i + 1]
        seq_len, query_len = meta.seq_lens[i], end - start
        num_context = seq_len - query_len
        if num_context == 0:
            keys, values = k[start:end], v[start:end]
        else:
            slots = self._context_slots(meta.block_tables[i], seq_len, flat_k.device)
            keys, values = flat_k[slots], flat_v[slots]
        mask = None
        if num_context or self.sliding_window is not None:
            q_pos = torch.arange(num_context, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        out[start:end] = o.transpose(0, 1)

    def _context_slots(
        self, block_ids: list[int], seq_len: int, device: torch.device
    ) -> torch.Tensor:
        block_size = self.kv_cache.shape[2]
        blocks = torch.tensor(block_ids, device=device)
        offsets = torch.arange(block_size, device=device)
        return (blocks.unsqueeze(1) * block_size + offsets).flatten()[:seq_len]
