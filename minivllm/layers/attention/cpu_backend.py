"""Paged attention on CPUs through minivllm's compiled kernels.

The cache layout and the metadata are the torch backend's; only the hot pieces
differ: the cache write, batched decode attention (one pass over each row's blocks
with an online softmax) and causal prefill attention over the paged cache
(`kernels/paged_attention.cpp`, `kernels/prefill_attention.cpp`: bf16, AVX512-BF16).
The fp32 AVX2 family has decode attention only (`kernels/avx2_attention.cpp`); its
cache writes and prefills stay on the torch backend's path (index_copy_ and SDPA,
already fast there). The bf16 kernels take head sizes that are multiples of 32
(decode: up to 256), the AVX2 one multiples of 8; other shapes, and inputs in
another dtype than the kernels', keep the torch backend's path.

The KV cache may store another dtype than the engine computes in (`kv_cache_dtype`):
the AVX2 family's write and decode read fp32, bf16 and both fp8 caches (widened to fp32
as they load); the bf16 family's kernels read bf16 caches only, other caches take the
torch backend's path.
"""

from __future__ import annotations

import torch

from minivllm.kernels.registry import Kernels
from minivllm.layers.attention.torch_backend import PagedAttentionMetadata, TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: Kernels, decode_query_len: int = 1) -> None:
        super().__init__(decode_query_len)
        self.write_op = kernels.op("write_kv_cache")
        self.decode_op = kernels.op("paged_attention_decode")
        self.prefill_op = kernels.op("prefill_attention")
        if self.decode_op is None or kernels.key is None:
            raise ValueError(
                f"the cpu attention backend needs compiled CPU kernels; {kernels.name} has none"
            )
        self.dtype = kernels.key.dtype  # what the kernels read
        # the decode kernel's templates: bf16 in vectors of 32 lanes, fp32 in 8
        self.head_multiple = 32 if self.dtype == torch.bfloat16 else 8
        # the cache dtypes the write and decode kernels take
        self.cache_dtypes: frozenset[torch.dtype] = frozenset(
            {self.dtype}
            if self.dtype == torch.bfloat16
            else {torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
        )

    def supports_cache_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in self.cache_dtypes

    def supports_decode(self, head_dim: int) -> bool:
        return head_dim % self.head_multiple == 0 and head_dim <= 256

    def write_kv_cache(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if (
            self.write_op is None
            or k.dtype != self.dtype
            or kv_cache.dtype not in self.cache_dtypes
        ):
            super().write_kv_cache(kv_cache, k, v, slots)
            return
        self.write_op(kv_cache, k, v, slots)

    def decode(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        if (
            q.dtype != self.dtype
            or kv_cache.dtype not in self.cache_dtypes
            or not self.supports_decode(layer.head_dim)
        ):
            super().decode(layer, q, kv_cache, meta, out)
            return
        out[meta.decode_token_indices] = self.decode_op(
            q[meta.decode_token_indices],
            kv_cache[0],
            kv_cache[1],
            meta.decode_block_tables,
            meta.decode_seq_lens,
            layer.scale,
            layer.sliding_window or 0,
        )

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
        if (
            self.prefill_op is None
            or q.dtype != self.dtype
            or kv_cache.dtype != self.dtype
            or layer.head_dim % 32
        ):
            super().prefill(layer, n, q, k, v, kv_cache, meta, out)
            return
        start, end = meta.prefill_query_ranges[n]
        # reads this chunk's keys and values back from the cache forward() just wrote
        out[start:end] = self.prefill_op(
            q[start:end],
            kv_cache[0],
            kv_cache[1],
            meta.prefill_block_tables[n],
            meta.prefill_seq_lens[n] - (end - start),
            layer.scale,
            layer.sliding_window or 0,
        )
