"""Prefix caching through the public APIs (LLM, AsyncEngine) on aidreams-260k.

Greedy tokens with ``enable_prefix_caching`` on equal those with it off for every shape of
reuse (a prefix of exactly k blocks, k blocks + a partial block, the whole prompt repeated, a
cached prefix then a stop string, preemption, eviction pressure, chunked prefill of the
uncached part); warm outputs also equal transformers itself; pinned prefixes survive eviction
and lapse at their TTL; 16 concurrent requests prefill a shared uncached prefix once; cache
salts partition the cache.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from prefixgate.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from support.outputs import whole

BOS = 1


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def run_rounds(path: str, rounds: list[list[list[int]]], caching: bool, **cfg) -> tuple[list, LLM]:
    """Each round's prompts run together; rounds run one after the other on one engine."""
    cfg.setdefault("block_size", 8)
    cfg.setdefault("num_kv_blocks", 128)
    llm = LLM(path, enable_prefix_caching=caching, **cfg)
    outs = [[o.outputs[0].token_ids for o in llm.generate(r, greedy(10))] for r in rounds]
    return outs, llm


def on_equals_off(path: str, rounds, pool_whole, **cfg) -> LLM:
    """Assert caching on == off for ``rounds``; returns the caching engine for more checks."""
    off, llm_off = run_rounds(path, rounds, False, **cfg)
    on, llm_on = run_rounds(path, rounds, True, **cfg)
    assert on == off
    assert llm_off.stats()["prefix_cache_hits"] == 0
    pool_whole(llm_off)
    pool_whole(llm_on)
    return llm_on


def test_on_off_k_blocks_partial_and_whole_prompt_repeated(aidreams_path, pool_whole):
    rng = random.Random(21)
    prefix = [BOS] + rand_ids(rng, 39)  # exactly 5 blocks of 8
    rounds = [
        [prefix + rand_ids(rng, 4)],  # warms the 5 prefix blocks
        [prefix + rand_ids(rng, 8), prefix + rand_ids(rng, 3)],  # k blocks + full / partial
        [prefix],  # the prefix alone: the cached run stops short so the last token is computed
        [prefix, prefix],  # the whole prompt repeated
    ]
    llm = on_equals_off(aidreams_path, rounds, pool_whole)
    s = llm.stats()
    assert s["prefix_cache_hits"] >= 2 * 40 + 32 + 32
    assert s["prefix_cache_hit_rate"] > 0.5


def test_on_off_cached_prefix_then_stop_string(aidreams_path, pool_whole):
    prompt = "You dream.\n\nI sense the nodes of a gentle machine and"
    probe = LLM(aidreams_path, block_size=8, num_kv_blocks=32)
    free = probe.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0].text
    stop = free[5:9]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=[stop])
    seen = {}
    for caching in (False, True):
        llm = LLM(aidreams_path, block_size=8, num_kv_blocks=32, enable_prefix_caching=caching)
        first, second = (llm.generate(prompt, params)[0] for _ in range(2))
        for out in (first, second):
            assert out.outputs[0].text == free[: free.index(stop)]
            assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert (second.num_cached_tokens > 0) == caching
        seen[caching] = (first.outputs[0].token_ids, second.outputs[0].token_ids)
        pool_whole(llm)
    assert seen[True] == seen[False]


def test_on_off_under_preemption_and_eviction_pressure(aidreams_path, pool_whole):
    rng = random.Random(22)
    prefixes = [[BOS] + rand_ids(rng, 23) for _ in range(4)]  # 3 blocks each
    prompts = [p + rand_ids(rng, rng.randrange(1, 24)) for p in prefixes for _ in range(4)]
    rng.shuffle(prompts)
    rounds = [prompts[:8], prompts[8:], prompts[:4], prompts[12:]]
    # 14 blocks of 8 tokens: 8 requests of up to 56 tokens cannot run at once
    llm = on_equals_off(aidreams_path, rounds, pool_whole, num_kv_blocks=14)
    s = llm.stats()
    assert s["num_preemptions"] > 0
    assert s["prefix_cache_evictions"] > 0
    assert s["prefix_cache_hits"] > 0


def test_on_off_chunked_prefill_of_the_uncached_part(aidreams_path, pool_whole):
    rng = random.Random(23)
    prefix = [BOS] + rand_ids(rng, 31)
    rounds = [[prefix + rand_ids(rng, 2)], [prefix + rand_ids(rng, 50), prefix + rand_ids(rng, 29)]]
    llm = on_equals_off(aidreams_path, rounds, pool_whole, max_num_batched_tokens=12)
    assert llm.stats()["prefix_cache_hits"] >= 2 * 32


def test_cache_salt_partitions_the_cache(aidreams_path, pool_whole):
    rng = random.Random(24)
    prompt = [BOS] + rand_ids(rng, 40)
    llm = LLM(aidreams_path, block_size=8, num_kv_blocks=64)
    a = llm.generate([prompt], greedy(6), cache_salt="tenant-a")[0]
    b = llm.generate([prompt], greedy(6), cache_salt="tenant-b")[0]
    none = llm.generate([prompt], greedy(6))[0]
    a2 = llm.generate([prompt], greedy(6), cache_salt="tenant-a")[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, none.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == 40
    assert (
        a.outputs[0].token_ids
        == b.outputs[0].token_ids
        == none.outputs[0].token_ids
        == a2.outputs[0].token_ids
    )
    pool_whole(llm)


def test_warm_outputs_equal_transformers_with_chunked_uncached_part(aidreams_path, pool_whole):
    """A 48-token cached prefix, then 60 uncached tokens prefilled in 16-token chunks."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        aidreams_path, torch_dtype=torch.float32
    ).eval()
    rng = random.Random(11)
    prefix = [BOS] + rand_ids(rng, 47)  # 3 blocks of 16
    prompts = [prefix + rand_ids(rng, 60), prefix + rand_ids(rng, 37), prefix + rand_ids(rng, 5)]
    llm = LLM(aidreams_path, block_size=16, max_num_batched_tokens=16, num_kv_blocks=64)
    llm.generate([prefix + [7]], greedy(1))  # warm the cache with the prefix
    steps_before = llm.engine.timing["steps"]
    outs = llm.generate(prompts, greedy(8))
    assert [o.num_cached_tokens for o in outs] == [48, 48, 48]
    # 60 + 37 + 5 uncached tokens at <= 16 per step: at least 7 prefill steps
    assert llm.engine.timing["steps"] - steps_before >= 7 + 7
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 8)
    pool_whole(llm)


def test_pinned_prefix_survives_eviction_and_lapses_at_ttl(aidreams_path, pool_whole):
    rng = random.Random(12)
    prefix = [BOS] + rand_ids(rng, 31)  # 4 blocks of 8
    llm = LLM(aidreams_path, block_size=8, num_kv_blocks=24, max_pinned_fraction=0.5)
    cold = llm.generate([prefix + [9, 10]], greedy(4))[0]
    pin = llm.pin_prefix(prefix, ttl_s=1.0)
    assert pin.num_tokens == 32 and llm.stats()["pinned_blocks"] == 4
    # eviction pressure: many distinct prompts cycle through the 20 unpinned blocks
    for _ in range(6):
        llm.generate([[BOS] + rand_ids(rng, 60)], greedy(4))
    assert llm.stats()["prefix_cache_evictions"] > 0
    warm = llm.generate([prefix + [9, 10]], greedy(4))[0]
    assert warm.num_cached_tokens == 32
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    pool_whole(llm, pinned_ok=True)
    time.sleep(max(0.0, pin.expires_at - time.monotonic()) + 0.05)
    assert llm.engine.expire_pins() == [pin.id]
    assert llm.stats()["pinned_blocks"] == 0
    pool_whole(llm)


def test_pin_prefix_text_and_errors(aidreams_path, pool_whole):
    llm = LLM(aidreams_path, block_size=8, num_kv_blocks=32)
    pin = llm.pin_prefix("You dream.\n\nI sense the nodes of a gentle machine", ttl_s=30)
    assert pin.num_tokens > 0
    llm.unpin_prefix(pin.id)
    with pytest.raises((KeyError, ValueError)):
        llm.unpin_prefix(pin.id)
    with pytest.raises(ValueError):
        llm.pin_prefix([BOS, 5, 6], ttl_s=30)  # shorter than one block
    off = LLM(aidreams_path, block_size=8, num_kv_blocks=32, enable_prefix_caching=False)
    with pytest.raises(ValueError):
        off.pin_prefix([BOS] + [5] * 20, ttl_s=30)
    pool_whole(llm)
    pool_whole(off)


@pytest.mark.parametrize("caching", [True, False])
def test_16_concurrent_async_requests_prefill_shared_prefix_once(
    aidreams_path, caching, pool_whole
):
    rng = random.Random(13)
    prefix = [BOS] + rand_ids(rng, 63)  # 64 tokens, 4 blocks of 16, not cached yet
    suffixes = [rand_ids(rng, rng.randrange(2, 12)) for _ in range(16)]
    engine = AsyncEngine(
        EngineConfig(model=aidreams_path, num_kv_blocks=128, enable_prefix_caching=caching)
    )

    async def main():
        async def one(i):
            return whole(
                [o async for o in engine.generate(prefix + suffixes[i], greedy(6), f"q{i}")]
            )

        outs = await asyncio.gather(*(one(i) for i in range(16)))
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    s = engine.stats()
    if caching:
        assert s["prompt_tokens_prefilled"] == 64 + sum(map(len, suffixes))
        assert sorted(o.num_cached_tokens for o in outs) == [0] + [64] * 15
    else:
        assert s["prompt_tokens_prefilled"] == 16 * 64 + sum(map(len, suffixes))
    ref = LLM(aidreams_path, num_kv_blocks=128, enable_prefix_caching=False)
    expected = ref.generate([prefix + x for x in suffixes], greedy(6))
    assert [o.token_ids for o in outs] == [e.outputs[0].token_ids for e in expected]
    pool_whole(engine)
