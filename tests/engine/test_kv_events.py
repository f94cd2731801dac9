"""KV events on the engine side, without a model: the collector's batches and snapshot, and the
property the exact index rests on — the keys a pool publishes as held predict its hits.

A router that knows only the published keys predicts a prompt's hits as its longest run of
leading block keys held (``KVIndex.match``); the engine's lookup also checks each candidate's
parent uid (the collision guard). They agree only if no held key is unreachable: a block
chained on a copy that another request cached first, whose copy was then evicted, must still
be found once the same content is cached again (the pool's uid tombstones). Tested on the
scenario that broke it and on random workloads of concurrent duplicate computation, decode
growth, evictions and resets.
"""

from __future__ import annotations

import queue
import random
from collections import Counter

import pytest
from prefixgate.engine.block_hash import block_key_bytes, prompt_block_hashes
from prefixgate.engine.kv_cache_manager import KVCacheManager
from prefixgate.engine.kv_events import KVEventCollector, _to_events
from prefixgate.engine.request import Request

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, None, max_tokens=64, cache_salt=salt)


def predicted(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> int:
    """Tokens a router following the published keys predicts as cached."""
    held = {c.key for c in kv.pool.cached_contents()}
    n = 0
    for key in prompt_block_hashes(tokens, BS, salt)[: (len(tokens) - 1) // BS]:
        if key not in held:
            break
        n += 1
    return n * BS


def served(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> int:
    return kv.get_computed_blocks(req("probe", tokens, salt))[1]


def whole(kv: KVCacheManager) -> None:
    kv.check_invariants()
    s = kv.stats()
    assert s["kv_blocks_used"] == s["pinned_blocks"] == 0, s


B0, B1, B2 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def test_chain_on_an_evicted_copy_is_found_again() -> None:
    """b computes block 0 beside a (a's copy is cached first), chains block 1 on a's copy;
    a's copy is evicted; c caches block 0 again: block 1 is served as its key says."""
    kv = KVCacheManager(8, BS)
    a, b = req("a", B0 + [90]), req("b", B0 + B1 + [91])
    assert kv.allocate_slots(a, a.num_tokens) and kv.allocate_slots(b, b.num_tokens)
    a.num_computed_tokens, b.num_computed_tokens = a.num_tokens, b.num_tokens
    kv.cache_blocks(a, a.num_tokens)
    kv.cache_blocks(b, b.num_tokens)  # block 0: a's copy first; block 1 chained on it
    kv.free(a)
    filler = req("f", list(range(100, 119)))  # 5 blocks: evicts a's block 0
    assert kv.allocate_slots(filler, filler.num_tokens)
    assert kv.stats()["prefix_cache_evictions"] == 1
    kv.free(filler)
    kv.free(b)
    assert served(kv, B0 + B1 + [5]) == predicted(kv, B0 + B1 + [5]) == 0
    c = req("c", B0 + [77])
    assert kv.get_computed_blocks(c)[1] == 0
    assert kv.allocate_slots(c, c.num_tokens)
    c.num_computed_tokens = c.num_tokens
    kv.cache_blocks(c, c.num_tokens)
    kv.free(c)
    assert predicted(kv, B0 + B1 + [5]) == 8
    assert served(kv, B0 + B1 + [5]) == 8
    whole(kv)


@pytest.mark.parametrize("seed", range(6))
def test_published_keys_predict_hits_on_random_workloads(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(rng.choice([10, 16, 24]), BS)
    choices = [[[rng.randrange(20, 24) for _ in range(BS)] for _ in range(2)] for _ in range(5)]
    salts = [None, "t"]

    def prompt() -> list[int]:
        n = rng.randrange(1, 5)
        return [t for i in range(n) for t in rng.choice(choices[i])] + [rng.randrange(3)]

    probes = [(prompt(), rng.choice(salts)) for _ in range(12)]
    running: list[Request] = []
    ids = iter(range(10**6))
    for _ in range(300):
        op = rng.random()
        if op < 0.4:  # admit; with prob. 1/2 hits are looked up before others cache (a duplicate)
            r = req(f"r{next(ids)}", prompt(), rng.choice(salts))
            hits, n = kv.get_computed_blocks(r) if rng.random() < 0.5 else ([], 0)
            if kv.allocate_slots(r, r.num_tokens - n, n, hits):
                r.num_computed_tokens = n
                running.append(r)
        elif op < 0.7 and running:  # compute what is pending, or decode a token
            r = rng.choice(running)
            if r.num_computed_tokens < r.num_tokens:
                r.num_computed_tokens = r.num_tokens
            elif kv.allocate_slots(r, 1):
                r.append_output_token(rng.choice(choices[min(3, r.num_tokens // BS)])[0])
                r.num_computed_tokens = r.num_tokens
            kv.cache_blocks(r, r.num_computed_tokens)
        elif op < 0.97 and running:
            r = running.pop(rng.randrange(len(running)))
            kv.cache_blocks(r, r.num_computed_tokens)
            kv.free(r)
        elif op >= 0.97:
            kv.reset_prefix_cache()
        kv.check_invariants()
        for tokens, salt in probes:
            assert served(kv, tokens, salt) == predicted(kv, tokens, salt), (tokens, salt)
    for r in running:
        kv.free(r)
    whole(kv)


def test_collector_batches_mirror_and_drops() -> None:
    """Stores and removals of one flush form one numbered batch (a chain's run is one event);
    the snapshot is the pool's cached entries; a full queue drops batches, counted, their
    sequence numbers skipped."""
    kv = KVCacheManager(6, BS)
    col = KVEventCollector(BS, max_queue_batches=2, first_seq=100)
    kv.pool.events = col
    a = req("a", B0 + B1 + B2 + [1])
    assert kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_blocks(a, a.num_tokens)
    col.flush()
    item = col.queue.get_nowait()
    assert item.seq == 100
    events = _to_events(item.events, BS)
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared", "BlockStored"]
    stored = events[1]
    keys = prompt_block_hashes(a.all_token_ids, BS)
    assert stored.block_hashes == [block_key_bytes(k) for k in keys]
    assert stored.parent_block_hash is None and stored.token_ids == B0 + B1 + B2
    assert stored.block_size == BS and stored.medium == "GPU" and stored.lora_id is None
    kv.free(a)
    col.flush()  # nothing changed: no batch
    assert col.last_seq == 100 and col.queue.empty()
    for i in range(3):  # the first evicts two of a's blocks (one batch); the others find
        f = req(f"f{i}", list(range(200 + 30 * i, 200 + 30 * i + 5 * BS)))  # empty blocks
        assert kv.allocate_slots(f, f.num_tokens)
        kv.free(f)
        col.flush()
    assert col.last_seq == 101 and kv.stats()["prefix_cache_evictions"] == 2
    removed = _to_events(col.queue.get_nowait().events, BS)
    assert [type(e).__name__ for e in removed] == ["BlockRemoved"]
    assert removed[0].block_hashes == [block_key_bytes(k) for k in keys[:0:-1]]  # tail first
    seq, entries = col.snapshot()
    assert seq == 101
    assert Counter(c.uid for c in entries) == Counter(c.uid for c in kv.pool.cached_contents())
    for i in range(3):
        b = req(f"b{i}", [300 + i] * BS + [1])
        assert kv.allocate_slots(b, b.num_tokens)
        b.num_computed_tokens = b.num_tokens
        kv.cache_blocks(b, b.num_tokens)
        kv.free(b)
        col.flush()
    assert col.queue.qsize() == 2 and col.dropped_batches == 1 and col.dropped_events >= 1
    assert [col.queue.get_nowait().seq for _ in range(2)] == [102, 103]  # 104 was dropped
    with pytest.raises(queue.Empty):
        col.queue.get_nowait()
    seq, entries = col.snapshot()  # the snapshot still holds the dropped batch's changes
    assert seq == col.last_seq == 104
    assert Counter(c.uid for c in entries) == Counter(c.uid for c in kv.pool.cached_contents())
    whole(kv)


def test_prompt_block_hashes_checks_ids_fast_and_names_each_fault():
    # plain ints >= 0 take a C-speed check; any other sequence goes through the per-token
    # loop, which names the first fault
    import enum

    class Id(enum.IntEnum):
        A = 3

    ids = list(range(2 * BS))
    assert prompt_block_hashes(ids, BS) == prompt_block_hashes(tuple(ids), BS)
    assert len(prompt_block_hashes([Id.A] * BS, BS)) == 1  # an int subclass passes
    assert prompt_block_hashes([], BS) == []
    with pytest.raises(TypeError, match="must be ints, got True"):
        prompt_block_hashes([1, True], BS)
    with pytest.raises(TypeError, match="must be ints, got 1.0"):
        prompt_block_hashes([1, 1.0], BS)
    with pytest.raises(ValueError, match=">= 0, got -2"):
        prompt_block_hashes([1, -2], BS)
