"""HiSparse on the scheduler side: pages spill to the host pool instead of requests
being preempted (vLLM #53781's "hybrid" design, for minivllm's block pool).

KV stays resident while it fits. When a request cannot get the blocks it needs, full
pages of running requests move to the host pool, oldest first, from the request with
the most to give:

- never a request's last two pages, nor a page this step may write, nor a page shared
  through the prefix cache (ref_cnt > 1);
- spill before free: the copy is queued for the runner, which performs it at the start
  of the step, before the forward writes anything into the freed block;
- a request's first spill also leases its hot buffer, `hot_blocks` device blocks whose
  rows the runner's resolver fills with the host rows its top-k selections miss; so a
  request is spilled only when that still frees blocks.

A spilled page keeps its place in the request's block list as a `HostBlock` whose id is
`num_device_blocks + host block`: block tables, slots and flat row ids stay one number,
rows past the device cache naming host rows (`layers/attention/dsa.py: gather_rows`).

With `eager_host_mirror` each page is copied to the host as soon as it is full, so a
later spill only frees the device block. Host pages are not prefix-cacheable here (a
hit adopts device blocks only). When neither spilling nor anything else frees enough,
the scheduler preempts as it does without HiSparse.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minivllm.engine.block_pool import KVBlock
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.request import Request


@dataclass(slots=True, eq=False)
class HostBlock:
    """A page whose rows live only in the host pool."""

    block_id: int  # num_device_blocks + host_id
    host_id: int
    ref_cnt: int = 1
    block_hash: bytes | None = None


@dataclass(slots=True)
class HiSparseStepMetadata:
    """What the runner does for HiSparse before a step's forward (vLLM's connector metadata)."""

    copies: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    # request -> (page index, its new block id): pages that moved to the host
    page_updates: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    hot_blocks: dict[str, list[int]] = field(default_factory=dict)  # newly host-backed requests

    def __bool__(self) -> bool:
        return bool(self.copies or self.page_updates or self.hot_blocks)


class HiSparseKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        num_host_blocks: int,
        hot_blocks: int,
        eager_host_mirror: bool,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.num_device_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.hot_blocks, self.eager_host_mirror = hot_blocks, eager_host_mirror
        self.host_free: deque[int] = deque(range(num_host_blocks))
        self.hot: dict[str, list[KVBlock]] = {}
        self.mirrored: dict[str, dict[int, int]] = {}  # request -> page -> host block
        self.write_from: dict[str, int] = {}  # request -> first page this step may write
        self.pending = HiSparseStepMetadata()
        self.num_spills = 0

    @property
    def host_blocks_used(self) -> int:
        return self.num_host_blocks - len(self.host_free)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVBlock] | None:
        computed = new_computed_blocks or []
        rid = request.request_id
        # pages from here on are written this step: never spilled while it is planned
        self.write_from[rid] = request.num_computed_tokens // self.block_size + len(computed)
        args = (request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)
        blocks = super().allocate_slots(*args)
        if blocks is None and self._make_room(self._num_free_needed(*args)):
            blocks = super().allocate_slots(*args)
        if blocks is None:
            return None
        if self.eager_host_mirror:
            self._mirror_full_pages(request)
        return blocks

    def _num_free_needed(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None,
        num_lookahead_tokens: int,
    ) -> int:
        """Free blocks `allocate_slots` would need to succeed."""
        computed = new_computed_blocks or []
        num_needed = self._num_new_blocks(request, num_new_tokens, computed, num_lookahead_tokens)
        return num_needed + sum(1 for b in computed if b.ref_cnt == 0)

    def _spillable(self, rid: str) -> list[int]:
        blocks = self.req_blocks[rid]
        end = min(self.write_from.get(rid, 0), len(blocks) - 2)
        return [
            i
            for i in range(max(end, 0))
            if isinstance(blocks[i], KVBlock) and blocks[i].ref_cnt == 1
        ]

    def _make_room(self, free_needed: int) -> bool:
        """Spill pages until `free_needed` blocks are free; False when that cannot be done."""
        while self.pool.num_free_blocks < free_needed:
            best = None
            for rid in self.req_blocks:
                pages = self._spillable(rid)
                cost = 0 if rid in self.hot else self.hot_blocks
                if len(pages) - cost > 0 and (best is None or len(pages) - cost > best[0]):
                    best = (len(pages) - cost, rid, pages, cost)
            if best is None:
                return False
            gain, rid, pages, cost = best
            take = pages[: cost + min(gain, free_needed - self.pool.num_free_blocks)]
            mirrored = self.mirrored.get(rid, {})
            fresh = sum(1 for i in take if i not in mirrored)
            if fresh > len(self.host_free):  # the host pool is full too
                take = [i for i in take if i in mirrored] + [i for i in take if i not in mirrored][
                    : len(self.host_free)
                ]
                if len(take) <= cost:
                    return False
            for i in take:
                self._spill(rid, i)
            if cost:
                self.hot[rid] = self.pool.allocate(cost)
                self.pending.hot_blocks[rid] = [b.block_id for b in self.hot[rid]]
        return True

    def _spill(self, rid: str, page: int) -> None:
        blocks = self.req_blocks[rid]
        block = blocks[page]
        host_id = self.mirrored.get(rid, {}).pop(page, None)
        if host_id is None:
            host_id = self.host_free.popleft()
            self.pending.copies.append((block.block_id, host_id))
        blocks[page] = HostBlock(self.num_device_blocks + host_id, host_id)
        self.pool.free([block])  # reused only after the runner's copy (start of the step)
        self.pending.page_updates.setdefault(rid, []).append((page, blocks[page].block_id))
        self.num_spills += 1

    def _mirror_full_pages(self, request: Request) -> None:
        """Copy the request's completed pages to the host ahead of any spill."""
        rid = request.request_id
        blocks = self.req_blocks[rid]
        mirrored = self.mirrored.setdefault(rid, {})
        for i in range(min(request.num_computed_tokens // self.block_size, len(blocks))):
            if not self.host_free:
                return
            block = blocks[i]
            if i in mirrored or not isinstance(block, KVBlock):
                continue
            host_id = self.host_free.popleft()
            self.pending.copies.append((block.block_id, host_id))
            mirrored[i] = host_id

    def free(self, request: Request) -> None:
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.num_cached_blocks.pop(rid, None)
        self.write_from.pop(rid, None)
        self.pool.free(b for b in reversed(blocks) if isinstance(b, KVBlock))
        self.host_free.extend(b.host_id for b in blocks if isinstance(b, HostBlock))
        self.host_free.extend(self.mirrored.pop(rid, {}).values())
        self.pool.free(self.hot.pop(rid, []))

    def take_step_metadata(self) -> HiSparseStepMetadata | None:
        pending, self.pending = self.pending, HiSparseStepMetadata()
        return pending or None
