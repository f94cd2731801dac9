"""Block pool: block states, free lists, LRU eviction order (tail first), invariants."""

from __future__ import annotations

import pytest
from prefixgate.engine.block_pool import BlockPool


def _cache(pool: BlockPool, block, key: int, parent_uid=None) -> int:
    return pool.cache(block, key, (key,), None, parent_uid).uid


def test_allocate_and_free_keep_total() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert [b.ref_cnt for b in blocks] == [1] * 5
    assert (pool.num_used, pool.num_free) == (5, 3)
    pool.check_invariants()
    pool.free(reversed(blocks))
    assert (pool.num_used, pool.num_free, pool.num_free_cached) == (0, 8, 0)
    pool.check_invariants()


def test_allocate_over_capacity_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert pool.num_free == 2


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_cached_block_survives_free_and_is_found() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    uid = _cache(pool, b, 7)
    pool.free([b])
    assert pool.num_free_cached == 1
    found = pool.lookup(7, (7,), None, None)
    assert found is b and found.content.uid == uid
    pool.touch([found])
    assert b.ref_cnt == 1 and pool.num_free_cached == 0
    pool.check_invariants()


def test_lookup_checks_content_not_just_key() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache(b, 0, (1, 2), "salt", None)
    assert pool.lookup(0, (1, 2), "salt", None) is b
    assert pool.lookup(0, (1, 3), "salt", None) is None  # same key, other tokens
    assert pool.lookup(0, (1, 2), "other", None) is None  # other salt
    assert pool.lookup(0, (1, 2), "salt", 99) is None  # other parent


def test_empty_blocks_used_before_evicting_cached() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    _cache(pool, a, 1)
    _cache(pool, b, 2)
    pool.free([b, a])
    fresh = pool.allocate(2)  # the two never-used blocks
    assert {x.block_id for x in fresh}.isdisjoint({a.block_id, b.block_id})
    assert pool.num_evictions == 0 and pool.num_free_cached == 2


def test_lru_evicts_tail_first() -> None:
    pool = BlockPool(3)
    seq = pool.allocate(3)
    for i, blk in enumerate(seq):
        _cache(pool, blk, 10 + i)
    pool.free(reversed(seq))  # tail first, as KVCacheManager.free does
    (first,) = pool.allocate(1)
    assert first is seq[2] and first.content is None  # the tail was evicted
    (second,) = pool.allocate(1)
    assert second is seq[1]
    assert pool.num_evictions == 2
    assert pool.lookup(10, (10,), None, None) is seq[0]  # head still cached
    pool.check_invariants()


def test_touch_refreshes_lru_position() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    _cache(pool, a, 1)
    _cache(pool, b, 2)
    pool.free([a, b])  # a is older
    pool.touch([a])
    pool.free([a])  # a is now the most recently freed
    (x,) = pool.allocate(1)
    assert x is b


def test_invariants_catch_corruption() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    b.ref_cnt = 0  # neither used nor in a free list
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    _cache(pool, b, 3)
    pool.free([b])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(3, (3,), None, None) is None
    pool.check_invariants()


@pytest.mark.parametrize("look_early", [False, True])
def test_blocks_made_on_first_use_go_out_in_the_order_of_a_full_free_list(look_early) -> None:
    # the pool makes a block when it is first taken; the order is the one a free list
    # starting as range(num_blocks) gives: never-taken ids first, then the ones freed, in turn
    pool = BlockPool(6)
    if look_early:  # every block made up front (the invariant checks read them all)
        assert [b.block_id for b in pool.blocks] == list(range(6))
    first = pool.allocate(2)
    pool.check_invariants()
    pool.free([first[0]])
    assert pool.num_free == 5
    pool.check_invariants()
    assert [b.block_id for b in pool.allocate(5)] == [2, 3, 4, 5, 0]
    assert pool.num_free == 0
    assert len(pool.blocks) == 6
    pool.check_invariants()
