"""The backend of MLA layers (`MLAAttentionSpec`): the latent cache, the indexer's key
cache, top-k selection and sparse attention, in plain PyTorch (`dsa.py`).

A layer's cache is two tensors over one block id space:

    latent  [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]   [c_kv | k_pe]
    index_k [num_blocks, block_size, index_head_dim]                      (sparse layers)

so token t of a request lives at flat row `block_id * block_size + offset` of both, and
prefix caching, preemption and the block pool work on them exactly as on full K/V.

Each request of the step is one call: its context rows are gathered once, the indexer
(when the request is longer than `index_topk`) scores them, and the queries attend over
the selection, in the MHA form for prefill chunks and the absorbed form for decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.layers.attention.dsa import (
    gather_rows,
    indexer_topk,
    mla_decode,
    mla_prefill,
    selection_mask,
)
from minivllm.layers.attention.kv_cache_spec import KVCacheSpec, MLAAttentionSpec


@dataclass(slots=True)
class SparseMLAMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    req_ids: list[str]
    query_ranges: list[tuple[int, int]]  # per request: its token rows [start, end)
    seq_lens: list[int]  # per request: tokens in the cache after this step
    context_slots: list[torch.Tensor]  # per request: flat rows of its tokens 0..seq_len-1
    is_decode: list[bool]  # per request: at most decode_query_len tokens this step
    prefill_req_indices: list[int]  # the others (the runner asks whether any exist)


class SparseMLABackend(AttentionBackend):
    name = "sparse_mla"
    spec_types = (MLAAttentionSpec,)
    # HiSparse's runner side (`hisparse/runtime.py`) when the host tier is on: block
    # tables may then name host pages, and decodes read them through hot buffers
    hisparse = None

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        if not isinstance(spec, MLAAttentionSpec):
            raise TypeError(f"the {self.name} attention backend stores MLA latents, not {spec}")
        return (num_blocks, spec.block_size, spec.latent_dim)

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        latent = torch.empty(self.kv_cache_shape(spec, num_blocks), dtype=spec.dtype, device=device)
        index = torch.empty(
            (num_blocks, spec.block_size, spec.index_head_dim), dtype=spec.dtype, device=device
        )
        return latent, index

    def build_metadata(self, common: CommonAttentionMetadata) -> SparseMLAMetadata:
        req_ids = common.req_ids or [str(i) for i in range(common.num_reqs)]
        meta = SparseMLAMetadata(common.slot_mapping, req_ids, [], [], [], [], [])
        offsets = torch.arange(common.block_size, device=common.slot_mapping.device)
        for i in range(common.num_reqs):
            start, end = common.query_start_loc[i], common.query_start_loc[i + 1]
            blocks = common.block_table[i, : common.num_blocks[i]]
            slots = (blocks.unsqueeze(1) * common.block_size + offsets).flatten()
            meta.query_ranges.append((start, end))
            meta.seq_lens.append(common.seq_lens[i])
            meta.context_slots.append(slots[: common.seq_lens[i]])
            decode = end - start <= self.decode_query_len
            meta.is_decode.append(decode)
            if not decode:
                meta.prefill_req_indices.append(i)
        return meta

    def write_cache(
        self,
        layer: object,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        index_k: torch.Tensor | None,
        slots: torch.Tensor,
    ) -> None:
        latent, index = kv_cache
        rows = latent.view(-1, latent.shape[-1])
        rows[slots, : c_kv.shape[1]] = c_kv.to(rows.dtype)
        rows[slots, c_kv.shape[1] :] = k_pe.to(rows.dtype)
        if index_k is not None:
            index.view(-1, index.shape[-1]).index_copy_(0, slots, index_k.to(index.dtype))

    def forward(
        self,
        layer,
        q: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        index_q: torch.Tensor | None,
        index_k: torch.Tensor | None,
        index_w: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: SparseMLAMetadata,
    ) -> torch.Tensor:
        """Write this step's latents (and indexer keys), then attend -> [T, H, v_head_dim]."""
        self.write_cache(layer, kv_cache, c_kv, k_pe, index_k, meta.slot_mapping)
        latent_rows = kv_cache[0].view(-1, kv_cache[0].shape[-1])
        index_rows = kv_cache[1].view(-1, kv_cache[1].shape[-1])
        tier = self.hisparse
        host_latent = host_index = None
        if tier is not None:
            host_latent, host_index = (
                tier.host_latent(layer.layer_idx),
                tier.host_index(layer.layer_idx),
            )
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        for i, (start, end) in enumerate(meta.query_ranges):
            seq_len, slots = meta.seq_lens[i], meta.context_slots[i]
            positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            sparse = layer.is_sparse
            indices = indexer_topk(
                index_q[start:end] if sparse else q[start:end],
                index_w[start:end] if sparse else None,
                slots.unsqueeze(0),
                torch.zeros(end - start, dtype=torch.long, device=q.device),
                positions,
                index_rows,
                host_index,
                layer.index_topk if sparse else seq_len,
                layer.index_scale,
            )
            if meta.is_decode[i]:
                if tier is None:
                    rows = torch.where(indices >= 0, slots[indices.clamp(min=0)], -1)
                else:
                    rows = tier.resolve(layer.layer_idx, meta.req_ids[i], indices, slots)
                w_uk, w_uv = layer.absorbed_weights()
                out[start:end] = mla_decode(
                    q[start:end], latent_rows, w_uk, w_uv, rows, layer.scale
                )
            else:
                if tier is not None:
                    tier.count_staged(slots)
                out[start:end] = mla_prefill(
                    q[start:end],
                    gather_rows(latent_rows, host_latent, slots),
                    layer.kv_b_proj,
                    selection_mask(indices, seq_len),
                    layer.scale,
                    layer.kv_lora_rank,
                    layer.v_head_dim,
                )
        return out
