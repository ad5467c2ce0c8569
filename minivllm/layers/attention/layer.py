"""The attention layers: each declares its KV cache spec, and hands the math to the step's backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.layers.attention.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from minivllm.layers.forward_context import get_forward_context
from minivllm.quantization.kv_cache import calibrate_kv_scales, scale_for_cache, unscale_output


class AttentionLayerBase(nn.Module):
    """What the model runner finds in a model: a layer that owns a slice of the paged
    KV cache. It declares the spec; the runner allocates the cache in the layout of the
    backend that serves that spec and binds it to `kv_cache` (a tensor, or a tuple of
    tensors for layers that keep more than one thing per token)."""

    kv_cache: Any

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        raise NotImplementedError


class Attention(AttentionLayerBase):
    """Multi-head (grouped-query) attention over the paged KV cache.

    The model runner binds `kv_cache` once it has allocated it (the backend chose
    its layout); the backend and its metadata for the step come from the forward
    context.
    """

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
        self.kv_cache = torch.empty(0)
        # an fp8 cache with a checkpoint's scales (quantization/kv_cache.py): [4, Hkv] and
        # [2, H] fp32, set once the cache's dtype is known; None: keys stored as they are
        self.kv_scales: torch.Tensor | None = None
        self.kv_head_scales: torch.Tensor | None = None
        self.calibrate_kv_scales = False  # calculate_kv_scales: set them on the next forward

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size, dtype, self.num_kv_heads, self.head_dim, self.sliding_window
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H*D], k and v: [T, Hkv*D] -> [T, H*D]."""
        backend, metadata = get_forward_context().attention
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.calibrate_kv_scales:
            calibrate_kv_scales(self, k, v)
        if self.kv_scales is not None:
            q, k, v = scale_for_cache(self, q, k, v)
        out = backend.forward(self, q, k, v, self.kv_cache, metadata)
        if self.kv_scales is not None:
            out = unscale_output(self, out.view(-1, self.num_heads, self.head_dim))
        return out.reshape(-1, self.num_heads * self.head_dim)
