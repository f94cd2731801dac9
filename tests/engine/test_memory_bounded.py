"""The engine keeps no Python object per request served: its stores are bounded.

Bisecting the local server's memory growth, what grew in Python was the prefix cache's index:
one ``BlockContent`` (and its index entry) per cached block, ~2 per request until the default
pool of 8,192 blocks was full of cached prefixes (~4,000 requests of the memory bench), then
flat: bounded by ``num_kv_blocks``. Python objects live in CPython's own arenas, invisible to
``mallinfo2``, so these are counted with ``gc``: on a small pool, after its cache is full,
hundreds more distinct requests leave the tracked-object count and every store of the block
pool where they were (a generous margin of one object per request).
"""

from __future__ import annotations

import gc

from conftest import assert_pool_whole
from prefixgate.engine.block_hash import BlockContent
from prefixgate.engine.llm import LLM
from prefixgate.engine.sampling_params import SamplingParams

NUM_BLOCKS = 64
BATCH = 32


def _prompts(start: int) -> list[list[int]]:
    """``BATCH`` distinct 40-token prompts (2 full blocks of 16 each, then a partial one)."""
    return [[3 + (i * 31 + j * 7) % 350 for j in range(40)] for i in range(start, start + BATCH)]


def _contents() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is BlockContent)


def test_distinct_requests_leave_no_objects_behind():
    llm = LLM(None, num_kv_blocks=NUM_BLOCKS, block_size=16, max_num_seqs=BATCH)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    served = 0
    for _ in range(4):  # warm: the pool's cache fills (64 blocks), every code path has run
        llm.generate(_prompts(served), params)
        served += BATCH
    pool = llm.engine.kv_cache_manager.pool
    gc.collect()
    objects_before = len(gc.get_objects())
    for _ in range(10):  # 320 more distinct requests, each caching 2 new blocks
        llm.generate(_prompts(served), params)
        served += BATCH
    gc.collect()
    growth = len(gc.get_objects()) - objects_before
    assert growth < 10 * BATCH, growth
    assert pool.num_evictions >= 10 * BATCH  # the cache did turn over
    assert _contents() <= NUM_BLOCKS + len(pool._tombs)
    assert len(pool._index) <= NUM_BLOCKS
    assert len(pool._tombs) <= NUM_BLOCKS and len(pool._uid_holders) <= 2 * NUM_BLOCKS
    assert_pool_whole(llm)
