"""The attention-backend interface and the metadata every backend starts from.

A backend is chosen once per engine (`registry.select_attention_backend`) from
the config and the machine. It owns three things:

- the layout of each layer's cache tensor (`kv_cache_shape`, from the layer's spec);
- its per-step metadata, built once per step from `CommonAttentionMetadata`;
- the attention math of a layer (`forward`), called by `Attention` for every layer.

Requests that compute at most `decode_query_len` tokens in a step are "decodes":
a backend batches all their query tokens in one call. The default of 1 is the
usual decode; speculative decoding raises it to 1 + the number of draft tokens,
so verifying drafts is a batched decode, not a prefill per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.layers.attention.kv_cache_spec import KVCacheSpec


@dataclass(slots=True)
class CommonAttentionMetadata:
    """Where each token of a mixed batch reads and writes the paged KV cache.

    Tokens of request i are rows `query_start_loc[i]:query_start_loc[i+1]`; after
    this step request i has `seq_lens[i]` tokens in the cache, the first
    `seq_lens[i] - query_len` of them computed in earlier steps. Row i of
    `block_table` holds its `num_blocks[i]` block ids, then zero padding:

        block_table (block_size 4)    request 0: seq_len 6  -> [7, 2, 0]
                                      request 1: seq_len 11 -> [3, 9, 5]
        slot of token t of request i = block_table[i, t // 4] * 4 + t % 4
    """

    query_start_loc: list[int]  # [num_reqs + 1], vLLM's cu_seqlens_q
    seq_lens: list[int]  # [num_reqs]
    num_blocks: list[int]  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, max(num_blocks)] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each token
    block_size: int
    req_ids: list[str] | None = None  # the requests, in batch order

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


def build_common_metadata(
    slots: list[int],
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: str | torch.device,
    req_ids: list[str] | None = None,
) -> CommonAttentionMetadata:
    """The step's metadata from Python lists (block tables zero-padded to one width)."""
    num_blocks = [len(blocks) for blocks in block_tables]
    width = max(num_blocks, default=0)
    padded = [blocks + [0] * (width - len(blocks)) for blocks in block_tables]
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        num_blocks=num_blocks,
        block_table=torch.tensor(padded, dtype=torch.long, device=device).view(len(padded), width),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_size=block_size,
        req_ids=req_ids,
    )


class AttentionBackend(ABC):
    """One family of attention kernels over one cache layout. Subclasses set `name`."""

    name: str = ""
    spec_types: tuple[type[KVCacheSpec], ...] = ()  # the layer caches it knows how to serve

    def __init__(self, decode_query_len: int = 1) -> None:
        if decode_query_len < 1:
            raise ValueError(f"decode_query_len must be >= 1, got {decode_query_len}")
        self.decode_query_len = decode_query_len

    @abstractmethod
    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        """The shape of one layer's cache tensor holding `num_blocks` blocks."""

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, device: str) -> torch.Tensor:
        """Not zeroed (that alone took seconds for a few GB): attention reads only slots
        it has written, and masks the padding it gathers."""
        return torch.empty(self.kv_cache_shape(spec, num_blocks), dtype=spec.dtype, device=device)

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """This backend's metadata for one step, shared by every layer."""

    @abstractmethod
    def forward(
        self,
        layer: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Write this step's k, v into `kv_cache`, then attend. q: [T, H, D], k, v: [T, Hkv, D]
        -> [T, H, D]. `layer` carries the static parts: heads, scale, sliding window, spec."""
