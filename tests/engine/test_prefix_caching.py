"""Prefix caching end to end on the real trained aidreams-260k model (issue 3).

Greedy token ids with ``enable_prefix_caching`` on must equal those with it off, for every
shape of reuse: a prefix of exactly k blocks, k blocks + a partial block, the whole prompt
repeated, a cached prefix followed by a stop string, preemption, eviction pressure and chunked
prefill of the uncached part. Token-id prompts (vocab 512, context 128) keep it fast.
"""

from __future__ import annotations

import random

import pytest
import torch
from prefixgate.engine import LLM, SamplingParams

BOS = 1
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """A tiny model on a shared 2-core machine runs ~20x faster on one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def generate_rounds(path: str, rounds: list[list[list[int]]], caching: bool, **cfg) -> tuple[list, LLM]:
    """Run each round of prompts (concurrently) one after the other on one engine."""
    llm = LLM(path, enable_prefix_caching=caching, block_size=8, **cfg)
    outs = []
    for prompts in rounds:
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
    return outs, llm


def on_off(path: str, rounds, pool_whole, **cfg) -> LLM:
    cold, llm_off = generate_rounds(path, rounds, False, **cfg)
    warm, llm_on = generate_rounds(path, rounds, True, **cfg)
    assert warm == cold
    pool_whole(llm_off)
    pool_whole(llm_on)
    assert llm_off.stats()["prefix_cache_hits"] == 0
    return llm_on


def test_k_blocks_partial_and_repeat(aidreams_path, pool_whole) -> None:
    rng = random.Random(0)
    prefix = [BOS] + ids(rng, 31)  # exactly 4 blocks of 8
    rounds = [
        [prefix + ids(rng, 5)],  # warm the cache
        [prefix, prefix + ids(rng, 8), prefix + ids(rng, 3)],  # k blocks / k+1 blocks / k + partial
        [prefix, prefix],  # whole prompt repeated
    ]
    llm = on_off(aidreams_path, rounds, pool_whole)
    s = llm.stats()
    assert s["prefix_cache_hits"] >= 3 * 24 + 32
    assert s["prefix_cache_hit_rate"] > 0.5


def test_cached_prefix_then_stop_string(aidreams_path, pool_whole) -> None:
    llm = LLM(aidreams_path, block_size=8)
    prompt = "You dream.\n\nI sense the nodes of a gentle machine and"
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    stop = free[6:10]
    assert stop.strip()
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    texts = {}
    for caching in (False, True):
        eng = LLM(aidreams_path, block_size=8, enable_prefix_caching=caching)
        first = eng.generate([prompt], params)[0]
        second = eng.generate([prompt], params)[0]  # served from the cache when on
        assert first.outputs[0].text == second.outputs[0].text == free[: free.index(stop)]
        assert second.outputs[0].finish_reason == "stop"
        assert second.num_cached_tokens == (8 * ((len(second.prompt_token_ids) - 1) // 8) if caching else 0)
        texts[caching] = second.outputs[0].token_ids
        pool_whole(eng)
    assert texts[True] == texts[False]


def test_preemption_eviction_and_chunking(aidreams_path, pool_whole) -> None:
    rng = random.Random(1)
    prefixes = [[BOS] + ids(rng, 23) for _ in range(3)]  # 3 blocks each
    prompts = [p + ids(rng, rng.randrange(1, 20)) for p in prefixes for _ in range(4)]
    rng.shuffle(prompts)
    rounds = [prompts[:8], prompts[8:], prompts[:3]]
    # 16 blocks of 8 tokens: 8 concurrent requests of up to 53 tokens cannot all fit
    llm = on_off(aidreams_path, rounds, pool_whole, num_kv_blocks=16, max_num_batched_tokens=24)
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_evictions"] > 0 and s["prefix_cache_hits"] > 0


def test_16_concurrent_share_uncached_prefix_once(aidreams_path, pool_whole) -> None:
    rng = random.Random(2)
    prefix = [BOS] + ids(rng, 63)  # 64 tokens, 8 blocks, not cached yet
    suffixes = [ids(rng, rng.randrange(2, 9)) for _ in range(16)]
    prompts = [prefix + s for s in suffixes]
    results = {}
    for caching in (False, True):
        llm = LLM(aidreams_path, block_size=8, enable_prefix_caching=caching)
        outs = llm.generate(prompts, GREEDY)
        results[caching] = [o.outputs[0].token_ids for o in outs]
        s = llm.stats()
        if caching:
            assert s["prompt_tokens_prefilled"] == 64 + sum(len(x) for x in suffixes)
            assert sorted(o.num_cached_tokens for o in outs) == [0] + [64] * 15
        else:
            assert s["prompt_tokens_prefilled"] == sum(len(p) for p in prompts)
        pool_whole(llm)
    assert results[True] == results[False]


def test_cache_salt_isolation(aidreams_path, pool_whole) -> None:
    rng = random.Random(3)
    prompt = [BOS] + ids(rng, 40)
    llm = LLM(aidreams_path, block_size=8)
    a = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    b = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    a2 = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    n = llm.generate([prompt], GREEDY)[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, a2.num_cached_tokens, n.num_cached_tokens) == (0, 0, 40, 0)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == a2.outputs[0].token_ids == n.outputs[0].token_ids
    pool_whole(llm)


def test_forced_collision_not_served(aidreams_path, pool_whole) -> None:
    rng = random.Random(4)
    prompts = [[BOS] + ids(rng, 30) for _ in range(3)]
    ref = LLM(aidreams_path, block_size=8, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    llm = LLM(aidreams_path, block_size=8)
    llm.engine.kv_cache_manager.hash_fn = lambda data: 7  # every block key collides
    got = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    assert llm.stats()["prefix_cache_hits"] == 0
    pool_whole(llm)
