"""Per-request block tables over the block pool, with prefix-cache lookups."""

from __future__ import annotations

import hashlib
from array import array

from minivllm.engine.block_pool import BlockPool, KVBlock
from minivllm.engine.request import Request


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """sha256 over (parent digest, salt, token ids): a block's key names its whole prefix.

    A cryptographic hash makes a collision practically impossible, so a hit is
    trusted without re-reading the tokens.
    """
    digest = hashlib.sha256(parent_hash or b"\0" * 32)
    if salt is not None and parent_hash is None:
        digest.update(salt.encode())
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    """Gives each request the blocks its tokens need.

    Blocks layout of one request (block_size 4):

        tokens:   |<------- computed -------->|<-- new -->|
                  | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. ..|
        blocks:   |   block a   |   block b   |  block c   |
                   full: hashed   full: hashed  partial: not cached
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of them, tokens found

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request's tokens, in full blocks.

        At least one token is always left to compute: its logits pick the next token.
        Requests that want prompt logprobs skip the cache (the logprobs need the forward).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_computed = len(blocks) * self.block_size
        self.num_queries += request.num_tokens
        self.num_hits += num_computed
        return blocks, num_computed

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens, or None if the pool cannot give them.

        `new_computed_blocks` are prefix-cache hits being adopted by a request
        that has none yet; their tokens count as computed. `num_lookahead_tokens`
        more slots are reserved past them (a draft model's proposals). Only blocks
        full of the request's real tokens are registered in the prefix cache: draft
        tokens are not in `all_token_ids`, so they are never hashed.
        """
        computed = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_needed = self._num_new_blocks(request, num_new_tokens, computed, num_lookahead_tokens)
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        self.pool.touch(computed)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks.extend(computed)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, num_total)
        return new_blocks

    def _num_new_blocks(
        self,
        request: Request,
        num_new_tokens: int,
        computed: list[KVBlock],
        num_lookahead_tokens: int,
    ) -> int:
        """Blocks the request lacks for its computed, new and lookahead tokens."""
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        return -(-num_slots // self.block_size) - len(blocks) - len(computed)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix outlives its tail in the cache."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def take_step_metadata(self) -> object | None:
        """What the runner must do to the cache before this step's forward besides writing
        it (HiSparse's spills, `hisparse/coordinator.py`); None here."""
        return None

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._update_block_hashes(request)
        blocks = self.req_blocks[request.request_id]
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        size = self.block_size
        for i in range(len(hashes), request.num_tokens // size):
            parent = hashes[i - 1] if i else None
            tokens = request.all_token_ids[i * size : (i + 1) * size]
            hashes.append(hash_block_tokens(parent, tokens, request.cache_salt))
