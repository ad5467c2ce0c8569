"""Paged attention in plain PyTorch ops (any device, any dtype): the reference backend.

The cache of one layer is head-major, `[2, num_kv_heads, num_blocks, block_size, head_dim]`:
token t of a request lives at flat slot `block_id * block_size + offset` of every
head. Gathering a request's blocks then yields `[heads, tokens, head_dim]`, the
layout the matmuls want, with no transpose copies.

Decodes (requests computing at most `decode_query_len` tokens) become one row per
query token, each with its own sequence length (its position + 1), so several
query tokens of one request are as cheap to batch as one. Every other request is
a prefill chunk: causal within the chunk, with a full view of its cached context.

The cache may store another dtype than the model computes in (`kv_cache_dtype`): writes
round into it (`to_cache_dtype`), reads widen back to the query's dtype, and a prefill
attends to its own keys and values rounded the same way, so every score sees the cached
numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.layers.attention.kv_cache_spec import FullAttentionSpec, KVCacheSpec


@dataclass(slots=True)
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    # One row per decode query token.
    decode_token_indices: torch.Tensor  # [num_decode_tokens]
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks of the decodes]
    decode_seq_lens: torch.Tensor  # [num_decode_tokens]: keys each row sees
    # Prefill chunks, one entry per request.
    prefill_req_indices: list[int]
    prefill_query_ranges: list[tuple[int, int]]  # token rows [start, end)
    prefill_seq_lens: list[int]
    prefill_block_tables: list[torch.Tensor]  # each request's block ids (a view)
    prefill_context_slots: list[torch.Tensor | None]  # cache slots 0..seq_len-1, if it has context

    @property
    def num_decode_tokens(self) -> int:
        return self.decode_token_indices.shape[0]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    spec_types = (FullAttentionSpec,)

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        if not isinstance(spec, FullAttentionSpec):
            raise TypeError(f"the {self.name} attention backend stores full K/V, not {spec}")
        return (2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_size)

    def build_metadata(self, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        device = common.slot_mapping.device
        decode_reqs, decode_rows, decode_lens = [], [], []
        prefill_reqs = []
        for i in range(common.num_reqs):
            num = common.query_len(i)
            if num > self.decode_query_len:
                prefill_reqs.append(i)
                continue
            decode_reqs.append(i)
            first_pos = common.seq_lens[i] - num
            for j in range(num):
                decode_rows.append(i)
                decode_lens.append(first_pos + j + 1)
        max_blocks = max((common.num_blocks[i] for i in decode_reqs), default=0)
        decode_tokens = [
            common.query_start_loc[i] + j for i in decode_reqs for j in range(common.query_len(i))
        ]
        rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        meta = PagedAttentionMetadata(
            slot_mapping=common.slot_mapping,
            decode_token_indices=torch.tensor(decode_tokens, dtype=torch.long, device=device),
            decode_block_tables=common.block_table[rows, :max_blocks],
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long, device=device),
            prefill_req_indices=prefill_reqs,
            prefill_query_ranges=[],
            prefill_seq_lens=[],
            prefill_block_tables=[],
            prefill_context_slots=[],
        )
        for i in prefill_reqs:
            start, end = common.query_start_loc[i], common.query_start_loc[i + 1]
            seq_len = common.seq_lens[i]
            blocks = common.block_table[i, : common.num_blocks[i]]
            meta.prefill_query_ranges.append((start, end))
            meta.prefill_seq_lens.append(seq_len)
            meta.prefill_block_tables.append(blocks)
            meta.prefill_context_slots.append(
                _slots(blocks, common.block_size, seq_len) if seq_len > end - start else None
            )
        return meta

    def forward(
        self,
        layer: object,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        self.write_kv_cache(kv_cache, k, v, metadata.slot_mapping)
        if metadata.prefill_req_indices and kv_cache.dtype != k.dtype:
            # prefill attends to this step's keys and values as the cache holds them, as
            # decode does: a prompt scores the same whether its context was just computed,
            # came from a prefix-cache hit or from an earlier chunk
            k = to_cache_dtype(k, kv_cache.dtype).to(k.dtype)
            v = to_cache_dtype(v, kv_cache.dtype).to(v.dtype)
        out = torch.empty_like(q)
        if metadata.num_decode_tokens:
            self.decode(layer, q, kv_cache, metadata, out)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        for n in range(len(metadata.prefill_req_indices)):
            self.prefill(layer, n, q, k, v, kv_cache, metadata, out)
        return out

    def write_kv_cache(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
        k, v = to_cache_dtype(k, kv_cache.dtype), to_cache_dtype(v, kv_cache.dtype)
        cache = _bits(kv_cache)
        cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slots, _bits(k).transpose(0, 1))
        cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slots, _bits(v).transpose(0, 1))

    def decode(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """All decode rows at once, over their zero-padded block tables.

        Grouped-query attention as two batched matmuls where each KV head
        serves `group` query heads; batch dims are (kv head, row).
        """
        num_heads, num_kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        num = meta.decode_block_tables.shape[0]
        shape = (num_kv_heads, num, -1, head_dim)
        cache = _bits(kv_cache)
        keys = _read(
            cache[0][:, meta.decode_block_tables].view(shape), kv_cache, q
        )  # [Hkv, B, L, D]
        values = _read(cache[1][:, meta.decode_block_tables].view(shape), kv_cache, q)
        key_pos = torch.arange(keys.shape[2], device=q.device)
        seq_lens = meta.decode_seq_lens.unsqueeze(1)
        mask = key_pos < seq_lens  # [B, L]
        if layer.sliding_window is not None:
            mask &= key_pos >= seq_lens - layer.sliding_window
        group = num_heads // num_kv_heads
        query = q[meta.decode_token_indices].view(num, num_kv_heads, group, head_dim)
        query = query.transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(query, keys.transpose(2, 3)).float() * layer.scale  # [Hkv, B, G, L]
        scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        # Padding slots were never written (the cache is not zeroed): clear them so
        # whatever bytes they hold cannot turn 0 * value into NaN.
        values.masked_fill_(~mask[None, :, :, None], 0)
        o = torch.matmul(probs, values)  # [Hkv, B, G, D]
        out[meta.decode_token_indices] = o.transpose(0, 1).reshape(num, num_heads, head_dim)

    def prefill(
        self,
        layer: object,
        n: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """The n-th prefill chunk: causal within the chunk, full view of its cached context.
        k, v: [Hkv, T, D], this step's keys and values."""
        start, end = meta.prefill_query_ranges[n]
        seq_len = meta.prefill_seq_lens[n]
        num_context = seq_len - (end - start)
        window = layer.sliding_window
        slots = meta.prefill_context_slots[n]
        if slots is None:
            keys, values = k[:, start:end], v[:, start:end]
        else:
            num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
            cache = _bits(kv_cache)
            keys = _read(cache[0].view(num_kv_heads, -1, head_dim)[:, slots], kv_cache, q)
            values = _read(cache[1].view(num_kv_heads, -1, head_dim)[:, slots], kv_cache, q)
        mask = None
        if num_context or window is not None:
            q_pos = torch.arange(num_context, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        # 4-D inputs: with 3-D ones SDPA falls back to its slow unfused math path on CPU
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=layer.scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache stores it: rounded to nearest, fp8 saturating at its largest finite
    value (as vLLM's cache kernels convert; a plain cast would make an overflow NaN)."""
    if x.dtype == dtype:
        return x
    if dtype.is_floating_point and dtype.itemsize == 1:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes: index_copy_ and gathers take no fp8 on CPU."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


def _read(gathered: torch.Tensor, kv_cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Gathered cache entries (as `_bits` viewed them) in the query's dtype."""
    return gathered.view(kv_cache.dtype).to(q.dtype)


def _slots(blocks: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    offsets = torch.arange(block_size, device=blocks.device)
    return (blocks.unsqueeze(1) * block_size + offsets).flatten()[:seq_len]
