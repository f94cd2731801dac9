"""KV cache manager: hash chain, verified hits, collisions, salts, pins + TTL + cap, slots."""

from __future__ import annotations

import pytest
from prefixgate.engine.block_hash import hash_block_tokens, hash_request_blocks
from prefixgate.engine.errors import PinLimitError, PrefixCachingDisabledError
from prefixgate.engine.kv_cache_manager import KVCacheManager
from prefixgate.engine.request import Request

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, None, max_tokens=4, cache_salt=salt)


ADMITTED: list[tuple[KVCacheManager, Request]] = []


@pytest.fixture(autouse=True)
def pool_whole_after_each_test():
    """Every scenario ends with the pool whole: once the requests a test admitted are freed,
    no block is used except those its pins hold, and every block is in exactly one state."""
    ADMITTED.clear()
    yield
    managers = {id(kv): kv for kv, _ in ADMITTED}
    for kv, r in ADMITTED:
        kv.free(r)  # idempotent: a request the test freed already is skipped
    for kv in managers.values():
        kv.check_invariants()
        s = kv.stats()
        assert s["kv_blocks_used"] == s["pinned_blocks"], s
        assert s["kv_blocks_used"] + s["kv_blocks_free"] == s["kv_blocks_total"], s


def compute(kv: KVCacheManager, r: Request) -> int:
    """Admit ``r`` like the scheduler: reuse hits, allocate, 'compute' the prompt, cache blocks."""
    ADMITTED.append((kv, r))
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, n, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r, r.num_computed_tokens)
    kv.check_invariants()
    return n


def test_hash_chain_depends_on_parent_tokens_and_salt() -> None:
    a = hash_request_blocks(list(range(12)), BS, None, [])
    b = hash_request_blocks([99] + list(range(1, 12)), BS, None, [])
    c = hash_request_blocks(list(range(12)), BS, "tenant", [])
    assert len(a) == 3 and a == hash_request_blocks(list(range(12)), BS, None, [])
    assert all(x != y for x, y in zip(a, b, strict=True))  # first block differs → whole chain
    assert all(x != y for x, y in zip(a, c, strict=True))  # salt in block 0 → whole chain
    assert a[1] == hash_block_tokens(a[0], [4, 5, 6, 7])
    assert 0 <= a[0] < 2**128 and a[0].bit_length() > 64
    # incremental: only new full blocks are hashed
    hashes = hash_request_blocks(list(range(6)), BS, None, [])
    assert hash_request_blocks(list(range(12)), BS, None, hashes) == a


def test_hits_whole_blocks_and_last_token_always_computed() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(12))  # exactly 3 blocks
    assert compute(kv, req("a", prompt)) == 0
    kv.free(req("a", prompt))
    assert compute(kv, req("b", prompt)) == 8  # 2 of 3: the last block is recomputed
    assert compute(kv, req("c", prompt + [50, 51])) == 12  # 3 blocks + partial
    assert compute(kv, req("d", prompt[:10])) == 8
    assert compute(kv, req("e", [7] + prompt[1:])) == 0


def test_duplicate_block_is_not_cached_twice() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(8))
    a, b = req("a", prompt), req("b", prompt)
    compute(kv, a)
    compute(kv, b)  # recomputes block 1, identical to a's
    kv.free(a)
    kv.free(b)
    assert kv.stats()["kv_blocks_cached_free"] == 2
    kv.check_invariants()


def test_forced_collision_detected_and_not_served() -> None:
    kv = KVCacheManager(32, BS, hash_fn=lambda data: 0)  # every block key collides
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    compute(kv, req("a", x + y + [0]))
    compute(kv, req("c", z + y + [0]))
    assert compute(kv, req("w", [4, 3, 2, 1] + y + [0])) == 0  # key hit, tokens differ
    # block 1 (y) exists twice under the same key, after x and after z: the chain decides
    b = req("b", x + y + [0])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits[1].content.parent_uid == hits[0].content.uid
    assert compute(kv, req("s", x + y + [0], salt="t")) == 0  # salt differs
    assert kv.stats()["prefix_cache_evictions"] == 0


def test_salt_isolation() -> None:
    kv = KVCacheManager(32, BS)
    prompt = list(range(9))
    compute(kv, req("a", prompt, salt="k1"))
    assert compute(kv, req("b", prompt, salt="k2")) == 0
    assert compute(kv, req("c", prompt, salt=None)) == 0
    assert compute(kv, req("d", prompt, salt="k1")) == 8


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    compute(kv, req("a", prompt))
    kv.free(req("a", prompt))
    assert compute(kv, req("b", prompt)) == 0
    assert kv.stats()["kv_blocks_cached_free"] == 0
    with pytest.raises(PrefixCachingDisabledError):
        kv.pin(prompt)


def test_allocate_slots_all_or_nothing() -> None:
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    b = req("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8)
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    kv.check_invariants()
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 1)  # the 13th token opens block 4
    assert len(kv.get_block_ids("a")) == 4 and kv.num_free_blocks == 0
    kv.free(a)
    kv.check_invariants()


def test_hit_blocks_in_lru_count_against_free_space() -> None:
    kv = KVCacheManager(3, BS)
    a = req("a", list(range(9)))
    compute(kv, a)
    kv.free(a)  # 2 cached-free + 1 empty
    b = req("b", list(range(9)) + [1, 2, 3, 4])  # hits 2 blocks, needs 2 more: only 1 left
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert not kv.allocate_slots(b, b.num_tokens - n, n, hits)
    assert all(h.ref_cnt == 0 for h in hits)
    kv.check_invariants()


def test_eviction_drops_tail_first_so_head_still_hits() -> None:
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(13)))  # 3 full blocks + 1 token
    compute(kv, a)  # 4 blocks, 3 full and cached
    kv.free(a)
    other = req("o", [500, 501, 502])
    assert compute(kv, other) == 0  # takes the empty block
    other2 = req("o2", [600, 601, 602])
    compute(kv, other2)  # evicts a's tail block (tokens 8..11)
    assert kv.stats()["prefix_cache_evictions"] == 1
    assert kv.get_computed_blocks(req("z", list(range(13))))[1] == 8


def test_pins_ttl_and_cap() -> None:
    kv = KVCacheManager(8, BS, max_pinned_blocks=3)
    a = req("a", list(range(9)))
    compute(kv, a)
    kv.free(a)
    pin = kv.pin(list(range(9)), ttl_s=10.0, now=100.0)
    assert pin.num_tokens == 8 and len(pin.block_ids) == 2 and pin.expires_at == 110.0
    s = kv.stats()
    assert s["pinned_blocks"] == 2 and s["kv_blocks_used"] == 2
    # pinned blocks survive eviction pressure: fill the rest of the cache
    filler = req("f", list(range(1000, 1024)))
    assert kv.allocate_slots(filler, 24)
    assert kv.get_computed_blocks(req("q", list(range(9))))[1] == 8
    kv.free(filler)
    # same prefix pinned twice: no new blocks
    pin2 = kv.pin(list(range(8)), ttl_s=1.0, now=100.0)
    assert kv.stats()["pinned_blocks"] == 2
    b = req("b", list(range(200, 209)))
    compute(kv, b)
    with pytest.raises(PinLimitError):
        kv.pin(list(range(200, 209)))  # 2 more → 4 > 3
    kv.check_invariants()
    assert kv.expire_pins(now=101.0) == [pin2.id]
    assert kv.stats()["pinned_blocks"] == 2
    assert kv.expire_pins(now=110.0) == [pin.id]
    kv.free(b)
    s = kv.stats()
    assert s["pinned_blocks"] == 0 and s["kv_blocks_used"] == 0
    assert kv.get_computed_blocks(req("r", list(range(9))))[1] == 8  # back in the LRU, still cached
    with pytest.raises(KeyError):
        kv.unpin(pin.id)
    kv.check_invariants()


def test_pin_edge_cases() -> None:
    kv = KVCacheManager(8, BS)
    assert kv.pin([1, 2, 3, 4, 5]).num_tokens == 0  # nothing cached yet
    with pytest.raises(ValueError):
        kv.pin([1, 2, 3, 4], ttl_s=0)
    a = req("a", list(range(5)), salt="s")
    compute(kv, a)
    assert kv.pin(list(range(4))).num_tokens == 0  # other salt
    p = kv.pin(list(range(4)), cache_salt="s")
    assert p.num_tokens == 4 and p.expires_at is None
    kv.free(a)
    kv.unpin(p.id)
    kv.check_invariants()
    assert kv.stats()["kv_blocks_used"] == 0


def test_pending_marks_verified_and_released() -> None:
    kv = KVCacheManager(16, BS)
    owner = req("o", list(range(10)))
    assert kv.allocate_slots(owner, 10)
    kv.mark_pending(owner)
    same = req("s", list(range(10)) + [3])
    other = req("x", [1] + list(range(1, 10)))
    assert kv.pending_owner(same, 0) is owner and kv.pending_owner(same, 1) is owner
    assert kv.pending_owner(other, 0) is None
    assert kv.pending_owner(req("t", list(range(10)), salt="k"), 0) is None
    owner.num_computed_tokens = 4
    kv.cache_blocks(owner, 4)  # block 0 cached: its mark goes
    assert kv.pending_owner(same, 0) is None and kv.pending_owner(same, 1) is owner
    kv.check_invariants()
    kv.free(owner)  # preemption / abort releases the rest
    assert kv.pending_owner(same, 1) is None
    kv.check_invariants()


def test_invariants_catch_ref_drift() -> None:
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(5)))
    assert kv.allocate_slots(a, 5)
    kv.pool.blocks[kv.get_block_ids("a")[0]].ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(8, BS)
    a = req("a", list(range(9)))
    compute(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    assert compute(kv, req("b", list(range(9)))) == 0


# ---- through the real engine (aidreams-260k): caching must never change greedy tokens --------


@pytest.fixture
def one_thread():
    """A tiny model on a shared 2-core machine runs far faster on one intra-op thread."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_real_model_on_off_equal_under_preemption_eviction_chunking(
    aidreams_path, pool_whole, one_thread
) -> None:
    import random

    from prefixgate.engine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    rng = random.Random(1)
    prefixes = [[1] + [rng.randrange(3, 512) for _ in range(23)] for _ in range(3)]  # 3 blocks
    prompts = [
        p + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))]
        for p in prefixes
        for _ in range(4)
    ]
    rng.shuffle(prompts)
    results, stats = {}, {}
    for caching in (False, True):
        # 16 blocks of 8 tokens: 8 concurrent requests of up to 53 tokens cannot all fit
        llm = LLM(
            aidreams_path,
            block_size=8,
            num_kv_blocks=16,
            max_num_batched_tokens=24,
            enable_prefix_caching=caching,
        )
        results[caching] = [
            [o.outputs[0].token_ids for o in llm.generate(batch, greedy)]
            for batch in (prompts[:8], prompts[8:], prompts[:3])
        ]
        stats[caching] = llm.stats()
        pool_whole(llm)
    assert results[True] == results[False]
    s = stats[True]
    assert (
        s["num_preemptions"] > 0 and s["prefix_cache_evictions"] > 0 and s["prefix_cache_hits"] > 0
    )


def test_real_model_forced_collision_not_served(aidreams_path, pool_whole, one_thread) -> None:
    import random

    from prefixgate.engine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rng = random.Random(4)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(30)] for _ in range(3)]
    llm = LLM(aidreams_path, block_size=8)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    llm.engine.kv_cache_manager.reset_prefix_cache()
    llm.engine.kv_cache_manager.hash_fn = lambda data: 7  # every block key collides
    got = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    assert llm.stats()["prefix_cache_hits"] == 0
    pool_whole(llm)
