"""Attention over the paged KV cache: the layer, cache specs, and backends chosen per engine."""

from minivllm.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.layers.attention.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec
from minivllm.layers.attention.layer import Attention, AttentionLayerBase

__all__ = [
    "Attention",
    "AttentionLayerBase",
    "AttentionBackend",
    "CommonAttentionMetadata",
    "FullAttentionSpec",
    "KVCacheSpec",
    "MLAAttentionSpec",
]
