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
