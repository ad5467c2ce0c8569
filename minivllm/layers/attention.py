"""Attention over the paged KV cache for mixed batches (torch ops; runs on CPU and CUDA).

The cache of one layer is head-major, `[2, num_kv_heads, num_blocks, block_size, head_dim]`:
token t of a request lives at flat slot `block_id * block_size + offset` of every
head. Gathering a request's blocks then yields `[heads, tokens, head_dim]`, the
layout the matmuls want, with no transpose copies.
"""

from __future__ import annotations

from collections.abc import Callable

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
        # Optional fused decode and prefill kernels (bf16 CPU), set by the model runner.
        self.decode_kernel: Callable[..., torch.Tensor] | None = None
        self.prefill_kernel: Callable[..., torch.Tensor] | None = None
        self.cache_write_kernel: Callable[..., None] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H*D], k and v: [T, Hkv*D] -> [T, H*D]."""
        meta = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        flat_k = self.kv_cache[0].view(self.num_kv_heads, -1, self.head_dim)  # [Hkv, slots, D]
        flat_v = self.kv_cache[1].view(self.num_kv_heads, -1, self.head_dim)
        if self.cache_write_kernel is not None and k.dtype == self.kv_cache.dtype:
            self.cache_write_kernel(self.kv_cache, k, v, meta.slot_mapping)
        else:
            flat_k.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))  # [Hkv, T, D]
            flat_v.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        out = torch.empty_like(q)
        if meta.decode_req_indices:
            self._decode(q, meta, out)
        for i in meta.prefill_req_indices:
            self._prefill(i, q, k, v, flat_k, flat_v, meta, out)
        return out.view(-1, self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """All one-token queries at once, over their zero-padded block tables.

        Grouped-query attention as two batched matmuls where each KV head
        serves `group` query heads; batch dims are (kv head, request).
        """
        if self.decode_kernel is not None and q.dtype == torch.bfloat16:
            out[meta.decode_token_indices] = self.decode_kernel(
                q[meta.decode_token_indices],
                self.kv_cache[0],
                self.kv_cache[1],
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
                self.sliding_window or 0,
            )
            return
        num = meta.decode_block_tables.shape[0]
        shape = (self.num_kv_heads, num, -1, self.head_dim)
        keys = self.kv_cache[0][:, meta.decode_block_tables].view(shape)  # [Hkv, B, L, D]
        values = self.kv_cache[1][:, meta.decode_block_tables].view(shape)
        key_pos = torch.arange(keys.shape[2], device=q.device)
        seq_lens = meta.decode_seq_lens.unsqueeze(1)
        mask = key_pos < seq_lens  # [B, L]
        if self.sliding_window is not None:
            mask &= key_pos >= seq_lens - self.sliding_window
        group = self.num_heads // self.num_kv_heads
        query = q[meta.decode_token_indices].view(num, self.num_kv_heads, group, self.head_dim)
        query = query.transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(query, keys.transpose(2, 3)).float() * self.scale  # [Hkv, B, G, L]
        scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        # Padding slots were never written (the cache is not zeroed): clear them so
        # whatever bytes they hold cannot turn 0 * value into NaN.
        values.masked_fill_(~mask[None, :, :, None], 0)
        o = torch.matmul(probs, values)  # [Hkv, B, G, D]
        out[meta.decode_token_indices] = o.transpose(0, 1).reshape(
            num, self.num_heads, self.head_dim
        )

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
        """One request's chunk: causal within the chunk, full view of its cached context."""
        start, end = meta.cu_seqlens_q[i], meta.cu_seqlens_q[i + 1]
        seq_len, query_len = meta.seq_lens[i], end - start
        num_context = seq_len - query_len
        if self.prefill_kernel is not None and q.dtype == torch.bfloat16:
            # reads this chunk's keys and values back from the cache forward() just wrote
            out[start:end] = self.prefill_kernel(
                q[start:end],
                self.kv_cache[0],
                self.kv_cache[1],
                torch.tensor(meta.block_tables[i], device=q.device),
                num_context,
                self.scale,
                self.sliding_window or 0,
            )
            return
        if num_context == 0:
            keys, values = k[:, start:end], v[:, start:end]
        else:
            slots = self._context_slots(meta.block_tables[i], seq_len, flat_k.device)
            keys, values = flat_k[:, slots], flat_v[:, slots]
        mask = None
        if num_context or self.sliding_window is not None:
            q_pos = torch.arange(num_context, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
        # 4-D inputs: with 3-D ones SDPA falls back to its slow unfused math path on CPU
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)

    def _context_slots(
        self, block_ids: list[int], seq_len: int, device: torch.device
    ) -> torch.Tensor:
        block_size = self.kv_cache.shape[3]
        blocks = torch.tensor(block_ids, device=device)
        offsets = torch.arange(block_size, device=device)
        return (blocks.unsqueeze(1) * block_size + offsets).flatten()[:seq_len]
