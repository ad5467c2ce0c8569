"""Block pool and KV cache manager: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

from minivllm.engine.block_pool import BlockPool
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.request import Request
from minivllm.sampling_params import SamplingParams


def _request(req_id: str, tokens: list[int], **params: object) -> Request:
    return Request(req_id, tokens, SamplingParams(**params), frozenset(), 0.0)


def test_pool_allocates_in_order_and_frees_to_the_back():
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    pool.free(reversed(a))
    pool.check_integrity()
    # free queue now: 2, 3, 1, 0 -> the next allocation takes 2 then 3 then 1
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 1]
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.allocate(2)


def test_without_caching_the_most_recently_freed_blocks_are_reused_first():
    pool = BlockPool(6, enable_caching=False)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    pool.free(reversed(a))  # 1, then 0
    pool.check_integrity()
    # the blocks just freed (warm pages) come back before the never-touched 2..5
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    pool.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_references():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    a = _request("a", tokens)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert [b.block_id for b in kv.allocate_slots(a, 10)] == [0, 1, 2]
    kv.pool.check_integrity()
    b = _request("b", tokens[:8] + [99, 98, 97])
    hits, num = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num == 8
    new = kv.allocate_slots(b, 3, hits)
    assert [blk.block_id for blk in new] == [3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    kv.pool.check_integrity()
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [1, 1, 0, 1]
    kv.free(b)
    kv.pool.check_integrity()
    assert kv.pool.num_free_blocks == 8


def test_cached_blocks_are_evicted_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = _request("a", [1, 2, 3, 4, 5])  # blocks 0, 1 full (cached), block 2 partial
    kv.allocate_slots(a, 5)
    kv.free(a)  # freed tail first: queue = 3, 2, 1, 0
    assert list(kv.pool.free_queue) == [3, 2, 1, 0]
    assert len(kv.pool.cached_blocks) == 2
    c = _request("c", [7, 7, 7, 7, 7])
    assert kv.get_computed_blocks(c) == ([], 0)
    # takes 3, 2, then 1: block 1 (a's second block) is evicted before block 0
    assert [b.block_id for b in kv.allocate_slots(c, 5)] == [3, 2, 1]
    kv.pool.check_integrity()
    # a's first block survives and still hits; its second is gone
    hits, num = kv.get_computed_blocks(_request("d", [1, 2, 3, 4, 5]))
    assert [b.block_id for b in hits] == [0] and num == 2


def test_a_full_prompt_hit_still_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = _request("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    hits, num = kv.get_computed_blocks(_request("b", [1, 2, 3, 4]))
    assert [b.block_id for b in hits] == [0] and num == 2


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=2, enable_caching=False)
    a = _request("a", [1, 2, 3])
    assert kv.allocate_slots(a, 3) is not None
    b = _request("b", [4, 5])
    assert kv.allocate_slots(b, 2) is None
    kv.pool.check_integrity()
    assert kv.pool.num_free_blocks == 0


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = _request("a", [1, 2, 3, 4, 5])
    a.cache_salt = "tenant-1"
    kv.allocate_slots(a, 5)
    b = _request("b", [1, 2, 3, 4, 5])
    b.cache_salt = "tenant-2"
    assert kv.get_computed_blocks(b) == ([], 0)
    c = _request("c", [1, 2, 3, 4, 5])
    c.cache_salt = "tenant-1"
    assert kv.get_computed_blocks(c)[1] == 4
