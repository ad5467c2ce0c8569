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

from dataclasses import dataclass, field

import torch

from minivllm.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.layers.attention.dsa import (
    absorb_query,
    gather_rows,
    indexer_topk,
    mla_prefill,
    selection_mask,
    sparse_mla_decode,
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
    # All decode requests as one batch: their query rows, each row's request among
    # them and position, and their context rows (zero-padded to the longest).
    decode_req_indices: list[int] = field(default_factory=list)
    decode_token_rows: torch.Tensor | None = None  # [N] rows of q
    decode_row_req: torch.Tensor | None = None  # [N] index into decode_req_indices
    decode_positions: torch.Tensor | None = None  # [N]
    decode_context_rows: torch.Tensor | None = None  # [num decode requests, max seq_len]


class SparseMLABackend(AttentionBackend):
    name = "sparse_mla"
    spec_types = (MLAAttentionSpec,)
    # HiSparse's runner side (`hisparse/runtime.py`) when the host tier is on: block
    # tables may then name host pages, and decodes read them through hot buffers
    hisparse = None

    def __init__(self, decode_query_len: int = 1, kernels=None) -> None:
        super().__init__(decode_query_len)
        # the last full layer's selections this step, for layers that share them
        # (GLM-MoE-DSA): "decode", or a prefill request's index -> [N, k] token indices
        self._selections: dict[object, torch.Tensor] = {}  # cleared at each step's metadata
        # compiled ops (bf16 CPU) where this engine has them, else the references
        op = kernels.op if kernels is not None else (lambda name: None)
        self.topk_op = op("dsa_indexer_topk")
        self.decode_op = op("sparse_mla_decode")

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
        self._selections.clear()  # a new step (or the draft's forward): nothing to share yet
        req_ids = common.req_ids or [str(i) for i in range(common.num_reqs)]
        meta = SparseMLAMetadata(common.slot_mapping, req_ids, [], [], [], [], [])
        device = common.slot_mapping.device
        offsets = torch.arange(common.block_size, device=device)
        token_rows, row_req, positions = [], [], []
        for i in range(common.num_reqs):
            start, end = common.query_start_loc[i], common.query_start_loc[i + 1]
            seq_len = common.seq_lens[i]
            blocks = common.block_table[i, : common.num_blocks[i]]
            slots = (blocks.unsqueeze(1) * common.block_size + offsets).flatten()
            meta.query_ranges.append((start, end))
            meta.seq_lens.append(seq_len)
            meta.context_slots.append(slots[:seq_len])
            decode = end - start <= self.decode_query_len
            meta.is_decode.append(decode)
            if not decode:
                meta.prefill_req_indices.append(i)
                continue
            for j in range(end - start):
                token_rows.append(start + j)
                row_req.append(len(meta.decode_req_indices))
                positions.append(seq_len - (end - start) + j)
            meta.decode_req_indices.append(i)
        if meta.decode_req_indices:
            width = max(meta.seq_lens[i] for i in meta.decode_req_indices)
            rows = torch.zeros(len(meta.decode_req_indices), width, dtype=torch.long, device=device)
            for n, i in enumerate(meta.decode_req_indices):
                rows[n, : meta.seq_lens[i]] = meta.context_slots[i]
            meta.decode_context_rows = rows
            meta.decode_token_rows = torch.tensor(token_rows, dtype=torch.long, device=device)
            meta.decode_row_req = torch.tensor(row_req, dtype=torch.long, device=device)
            meta.decode_positions = torch.tensor(positions, dtype=torch.long, device=device)
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
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        if meta.decode_req_indices:
            self._decode(layer, q, index_q, index_w, kv_cache, meta, out)
        for i in meta.prefill_req_indices:
            self._prefill(layer, i, q, index_q, index_w, kv_cache, meta, out)
        return out

    def _host(self, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.hisparse is None:
            return None, None
        return self.hisparse.host_latent(layer.layer_idx), self.hisparse.host_index(layer.layer_idx)

    def _select(self, layer, key: object, *args) -> torch.Tensor:
        """`_choose`'s selection, kept for the layers after this one that share it."""
        if layer.shared_index:
            if key not in self._selections:
                raise RuntimeError("a shared-index MLA layer ran before any full indexer layer")
            return self._selections[key]
        self._selections[key] = indices = self._choose(layer, *args)
        return indices

    def _choose(
        self,
        layer,
        index_q: torch.Tensor | None,
        index_w: torch.Tensor | None,
        context_rows: torch.Tensor,
        row_req: torch.Tensor,
        positions: torch.Tensor,
        index_rows: torch.Tensor,
        host_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """Token indices each query row attends to ([N, k], ascending, -1-padded)."""
        if not layer.is_sparse or int(positions.max()) < layer.index_topk:
            # every row sees at most index_topk tokens: all of them, no scoring
            width = int(positions.max()) + 1
            ar = torch.arange(width, device=positions.device)
            return torch.where(ar <= positions.unsqueeze(1), ar, -1)
        args = (index_q, index_w, context_rows, row_req, positions, index_rows)
        if self.topk_op is not None and index_q.dtype == torch.bfloat16:
            host = host_index if host_index is not None else index_rows[:0]
            return self.topk_op(*args, host, layer.index_topk, layer.index_scale)
        return indexer_topk(*args, host_index, layer.index_topk, layer.index_scale)

    def _decode(self, layer, q, index_q, index_w, kv_cache, meta, out) -> None:
        """Every decode row of the step at once, in the absorbed form over its selection."""
        latent_rows = kv_cache[0].view(-1, kv_cache[0].shape[-1])
        index_rows = kv_cache[1].flatten(0, 1)
        rows_q = meta.decode_token_rows
        sparse = layer.is_sparse
        sparse = sparse and not layer.shared_index
        indices = self._select(
            layer,
            "decode",
            index_q[rows_q] if sparse else None,
            index_w[rows_q] if sparse else None,
            meta.decode_context_rows,
            meta.decode_row_req,
            meta.decode_positions,
            index_rows,
            self._host(layer)[1],
        )
        context = meta.decode_context_rows[meta.decode_row_req]  # [N, width]
        rows = torch.where(indices >= 0, context.gather(1, indices.clamp(min=0)), -1)
        if self.hisparse is not None:
            for n, i in enumerate(meta.decode_req_indices):
                mine = (meta.decode_row_req == n).nonzero().flatten()
                rows[mine] = self.hisparse.resolve(
                    layer.layer_idx, meta.req_ids[i], indices[mine], meta.context_slots[i]
                )
        w_uk, w_uv = layer.absorbed_weights()
        q_abs = absorb_query(q[rows_q], w_uk)
        if self.decode_op is not None and q_abs.dtype == torch.bfloat16:
            out_lat = self.decode_op(q_abs, latent_rows, rows, layer.kv_lora_rank, layer.scale)
        else:
            out_lat = sparse_mla_decode(q_abs, latent_rows, rows, layer.kv_lora_rank, layer.scale)
        out[rows_q] = torch.einsum("qhc,hvc->qhv", out_lat, w_uv)

    def _prefill(self, layer, i, q, index_q, index_w, kv_cache, meta, out) -> None:
        """One request's prefill chunk over its context and selection: in the MHA form
        (`kv_b_proj` expands the context latents; the plain-PyTorch path, as transformers
        computes), or with the compiled ops in the absorbed form over the selected rows."""
        latent_rows = kv_cache[0].view(-1, kv_cache[0].shape[-1])
        index_rows = kv_cache[1].flatten(0, 1)
        host_latent, host_index = self._host(layer)
        (start, end), seq_len, slots = meta.query_ranges[i], meta.seq_lens[i], meta.context_slots[i]
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        sparse = layer.is_sparse and not layer.shared_index
        indices = self._select(
            layer,
            i,
            index_q[start:end] if sparse else None,
            index_w[start:end] if sparse else None,
            slots.unsqueeze(0),
            torch.zeros(end - start, dtype=torch.long, device=q.device),
            positions,
            index_rows,
            host_index,
        )
        if self.hisparse is not None:
            self.hisparse.count_staged(slots)
        context = gather_rows(latent_rows, host_latent, slots)  # [seq_len, kv_lora + rope]
        if self.decode_op is not None and q.dtype == torch.bfloat16:
            # the compiled path attends in the absorbed form over each query's selection
            # (index_topk rows, not the whole context: the sparse prefill)
            w_uk, w_uv = layer.absorbed_weights()
            q_abs = absorb_query(q[start:end], w_uk)
            out_lat = self.decode_op(q_abs, context, indices, layer.kv_lora_rank, layer.scale)
            out[start:end] = torch.einsum("qhc,hvc->qhv", out_lat, w_uv)
            return
        out[start:end] = mla_prefill(
            q[start:end],
            context,
            layer.kv_b_proj,
            selection_mask(indices, seq_len),
            layer.scale,
            layer.kv_lora_rank,
            layer.v_head_dim,
        )
