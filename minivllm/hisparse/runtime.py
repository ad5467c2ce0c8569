"""HiSparse on the runner side: the host pool, the step's page copies, and each
host-backed request's hot buffers with the residency resolver (vLLM #53781, 2.4 of
shared/specs/fast-start-hisparse-quant-security.md).

The resolver turns a decode's top-k token selection into rows of the device cache the
attention kernel can read:

- the token's page is resident: its row in the paged cache;
- else the token is in the request's hot buffer for this layer: that row (a hit);
- else (a miss): the least recently used slot not needed this step takes the token's
  row, copied in from the host pool.

Hot buffers are rows of device blocks leased from the engine's own pool, so the
attention kernel reads one tensor with one kind of index. On CPU "device" and "host"
are both memory; the host pool may be a file on disk (`host_pool_file`), where the
distinction is real.

Tensor-parallel ranks of one node share one pool (a file in /dev/shm, or the user's
file): the MLA latent is replicated, so every rank would write the same bytes; each rank
performs the copies of a step itself, so none ever reads a row before writing it and no
cross-process synchronisation is needed (vLLM #56629 makes rank 0 the sole writer, with
CUDA IPC events to order the reads).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from minivllm.distributed.parallel_state import all_reduce_min, get_tp_rank
from minivllm.hisparse.config import HiSparseConfig
from minivllm.hisparse.coordinator import HiSparseStepMetadata
from minivllm.hisparse.host_pool import HostKVPool

if TYPE_CHECKING:
    from minivllm.layers.attention.mla import MLAAttention

logger = logging.getLogger("minivllm")


class HotBuffer:
    """One request's hot rows in one layer: the token each slot holds, and LRU order."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows  # [S] flat device rows
        self.token_of_slot = torch.full_like(rows, -1)
        self.last_use = torch.full_like(rows, -1)
        self.slot_of_token = torch.full((0,), -1, dtype=torch.long)

    def ensure(self, num_tokens: int) -> None:
        if self.slot_of_token.shape[0] < num_tokens:
            grown = torch.full((max(num_tokens, 2 * self.slot_of_token.shape[0]),), -1)
            grown[: self.slot_of_token.shape[0]] = self.slot_of_token
            self.slot_of_token = grown


def host_pool_blocks(config: HiSparseConfig, bytes_per_block: int) -> int:
    """Whole host blocks in `host_pool_gib` (a host block holds what a device block does)."""
    return int(config.host_pool_gib * 2**30) // bytes_per_block


class HiSparseRuntime:
    def __init__(
        self,
        config: HiSparseConfig,
        layers: list[MLAAttention],
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        buffer_rows: int,
        dtype: torch.dtype,
        shared_path: str | None,
        local_rank: int,
    ) -> None:
        self.layers, self.block_size = layers, block_size
        self.num_device_rows = num_device_blocks * block_size
        self.buffer_rows = buffer_rows
        for i, layer in enumerate(layers):
            layer.layer_idx = i
        spec = layers[0].get_kv_cache_spec(block_size, dtype)
        path = config.host_pool_file or shared_path
        self.pool = HostKVPool(
            len(layers),
            num_host_blocks,
            block_size,
            spec.latent_dim,
            [layer.get_kv_cache_spec(block_size, dtype).index_head_dim for layer in layers],
            dtype,
            path,
        )
        all_reduce_min(0)  # every rank of the node has mapped the file
        if local_rank == 0:
            self.pool.unlink()  # no name left behind, even after a crash
        self.latent_row_bytes = spec.latent_dim * dtype.itemsize
        self.hot: dict[str, list[HotBuffer]] = {}
        self.step = 0
        self.counts = dict(lookups=0, hits=0, misses=0, host_to_device_bytes=0)
        if get_tp_rank() == 0:
            logger.info(
                "HiSparse: host pool of %d blocks (%.2f GiB, %s); hot buffers of %d rows",
                num_host_blocks,
                self.pool.nbytes / 2**30,
                f"mmap {path}" if path else "RAM",
                buffer_rows,
            )

    # -- per step ------------------------------------------------------------------

    def apply(self, meta: HiSparseStepMetadata | None, requests: dict) -> None:
        """Before the forward: page copies (spills and mirrors), block tables, new hot buffers."""
        self.step += 1
        if meta is None:
            return
        if meta.copies:
            size = self.block_size
            offsets = torch.arange(size)
            src = torch.tensor([d for d, _ in meta.copies]).unsqueeze(1) * size + offsets
            dst = torch.tensor([h for _, h in meta.copies]).unsqueeze(1) * size + offsets
            src, dst = src.flatten(), dst.flatten()
            for i, layer in enumerate(self.layers):
                latent, index = layer.kv_cache
                self.pool.latent(i).index_copy_(0, dst, latent.view(-1, latent.shape[-1])[src])
                self.pool.index(i).index_copy_(0, dst, index.flatten(0, 1)[src])
        for rid, updates in meta.page_updates.items():
            state = requests.get(rid)  # the runner's per-request state (its block ids)
            if state is None:
                continue  # removed in this step already
            for page, block_id in updates:
                state.block_ids[page] = block_id
        for rid, hot in meta.hot_blocks.items():
            rows = torch.tensor(hot).unsqueeze(1) * self.block_size + torch.arange(self.block_size)
            rows = rows.flatten()[: self.buffer_rows]
            self.hot[rid] = [HotBuffer(rows.clone()) for _ in self.layers]

    def remove(self, req_ids) -> None:
        for rid in req_ids:
            self.hot.pop(rid, None)

    def take_stats(self) -> dict[str, int] | None:
        if not any(self.counts.values()):
            return None
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts

    # -- what the attention backend calls -------------------------------------------

    def host_latent(self, layer: int) -> torch.Tensor:
        return self.pool.latent(layer)

    def host_index(self, layer: int) -> torch.Tensor:
        return self.pool.index(layer)

    def count_staged(self, rows: torch.Tensor) -> None:
        """A prefill read these context rows; those on the host were staged in (copied)."""
        num = int((rows >= self.num_device_rows).sum())
        self.counts["host_to_device_bytes"] += num * self.latent_row_bytes

    def resolve(
        self, layer: int, req_id: str, indices: torch.Tensor, token_rows: torch.Tensor
    ) -> torch.Tensor:
        """Device rows for the selected tokens `indices` ([Q, K], -1 = none) of request
        `req_id`, whose token t lives at (two-tier) row `token_rows[t]`."""
        rows = torch.where(indices >= 0, token_rows[indices.clamp(min=0)], -1)
        remote = rows >= self.num_device_rows
        if not bool(remote.any()):
            return rows
        buffers = self.hot.get(req_id)
        if buffers is None:
            raise RuntimeError(f"request {req_id} has host pages but no hot buffer")
        buf = buffers[layer]
        buf.ensure(token_rows.shape[0])
        need = indices[remote].unique()
        if need.numel() > buf.rows.numel():
            raise RuntimeError(
                f"{need.numel()} tokens to resolve exceed the {buf.rows.numel()}-row hot buffer"
            )
        slot = buf.slot_of_token[need]
        hit = slot >= 0
        buf.last_use[slot[hit]] = self.step
        miss = need[~hit]
        num_miss = miss.numel()
        if num_miss:
            # least recently used first; slots used this step sort last and are never taken
            victims = buf.last_use.argsort(stable=True)[:num_miss]
            old = buf.token_of_slot[victims]
            buf.slot_of_token[old[old >= 0]] = -1
            buf.token_of_slot[victims] = miss
            buf.slot_of_token[miss] = victims
            buf.last_use[victims] = self.step
            latent = self.layers[layer].kv_cache[0]
            latent = latent.view(-1, latent.shape[-1])
            latent[buf.rows[victims]] = self.pool.latent(layer)[
                token_rows[miss] - self.num_device_rows
            ]
        c = self.counts
        c["lookups"] += need.numel()
        c["hits"] += need.numel() - num_miss
        c["misses"] += num_miss
        c["host_to_device_bytes"] += num_miss * self.latent_row_bytes
        rows[remote] = buf.rows[buf.slot_of_token[indices[remote]]]
        return rows
