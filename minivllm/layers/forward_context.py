"""The attention metadata of the forward in progress, owned by the model runner."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of a mixed batch reads and writes the paged KV cache.

    Tokens of request i are rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`; after this
    step request i has `seq_lens[i]` tokens in the cache, the first
    `seq_lens[i] - query_len` of them computed in earlier steps.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each token
    cu_seqlens_q: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    block_tables: list[list[int]]  # per request, its block ids
    # Requests computing exactly one token, batched into one attention call.
    decode_req_indices: list[int]
    decode_token_indices: torch.Tensor  # [num_decodes]
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # [num_decodes]
    prefill_req_indices: list[int]


_current: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward contexts do not nest")
    _current = metadata
    try:
        yield
    finally:
        _current = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention ran outside the model runner's forward context")
    return _current
