"""Attention over the paged KV cache: the layer, cache specs, and backends chosen per engine."""

from minivllm.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.layers.attention.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from minivllm.layers.attention.layer import Attention

__all__ = [
    "Attention",
    "AttentionBackend",
    "CommonAttentionMetadata",
    "FullAttentionSpec",
    "KVCacheSpec",
]
