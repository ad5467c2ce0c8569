"""What one attention layer keeps per token in the paged KV cache (vLLM's `KVCacheSpec`).

Each attention layer declares its spec; the model runner derives everything else
from the specs: the bytes one block costs across all layers (and so how many
blocks the budget buys), and each layer's cache tensor, whose layout its
attention backend chooses (`AttentionBackend.kv_cache_shape`). A new kind of
cache (an MLA latent, an indexer key cache) is one more subclass here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    block_size: int  # tokens per block
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer's cache takes."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    """A key and a value vector per token and KV head (sliding windows keep every token too)."""

    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one compressed latent per token,
    `[c_kv | k_pe]` (kv_lora_rank + qk_rope_head_dim values, 576 at DeepSeek-V3's size),
    shared by every head and every TP rank, never the expanded per-head keys and values.

    A DeepSeek sparse attention (DSA) layer also keeps its lightning indexer's key per
    token (`index_head_dim` values; 0: no indexer). The two live in separate tensors of
    one block id space, so a block of this layer costs both.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int = 0

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_page_bytes(self) -> int:
        return self.block_size * self.latent_dim * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.latent_page_bytes + self.block_size * self.index_head_dim * self.dtype.itemsize
