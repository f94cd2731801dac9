"""Displacement on the real aidreams-260k model: greedy tokens are unchanged by it.

A heavy tenant (or low-priority work) floods a 4-seat engine; light (or urgent) requests join
mid-run and displace running ones (preempted, recomputed later). Every request's greedy tokens
must equal those of an unpreempted run (all requests together with seats and blocks for
everyone), and the pool ends whole.
"""

from __future__ import annotations

import pytest
from prefixgate.engine import LLM, SamplingParams
from support.prompts import DREAM_PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

HEAVY = [p for p in DREAM_PROMPTS[:12] if p not in ("You dream.\n\nI sense the nodes", "Memory")]
LIGHT = ["Memory", "I am", "Night", "Echoes"]
HEAVY_TOKENS, LIGHT_TOKENS = 24, 6


@pytest.fixture(scope="module")
def unpreempted(aidreams_path):
    llm = LLM(aidreams_path, block_size=16, max_num_seqs=64, num_kv_blocks=512)
    prompts = HEAVY + LIGHT
    params = [SamplingParams(temperature=0.0, max_tokens=HEAVY_TOKENS, ignore_eos=True)] * len(
        HEAVY
    ) + [SamplingParams(temperature=0.0, max_tokens=LIGHT_TOKENS, ignore_eos=True)] * len(LIGHT)
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] == 0
    return {p: o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)}


@pytest.mark.parametrize(
    ("policy", "num_kv_blocks"), [("fair", 256), ("priority", 256), ("priority", 14)]
)
def test_displacement_leaves_greedy_tokens_unchanged(
    aidreams_path, unpreempted, policy, num_kv_blocks, pool_whole
):
    llm = LLM(
        aidreams_path,
        block_size=16,
        max_num_seqs=4,
        num_kv_blocks=num_kv_blocks,
        scheduling_policy=policy,
    )
    engine = llm.engine
    for i, p in enumerate(HEAVY):
        engine.add_request(
            f"h{i}",
            p,
            SamplingParams(temperature=0.0, max_tokens=HEAVY_TOKENS, ignore_eos=True),
            tenant="heavy",
            priority=5,
        )
    final: dict[str, list[int]] = {}
    steps = 0
    light = list(enumerate(LIGHT))
    while engine.has_unfinished_requests() or light:
        if light and steps % 6 == 3:
            i, p = light.pop(0)
            engine.add_request(
                f"l{i}",
                p,
                SamplingParams(temperature=0.0, max_tokens=LIGHT_TOKENS, ignore_eos=True),
                tenant="light",
                priority=0,
            )
        for out in engine.step():
            final.setdefault(out.request_id, []).extend(out.delta_token_ids)
        steps += 1
        assert steps < 2000
    stats = llm.stats()
    assert stats["num_displacements"] > 0, stats
    for i, p in enumerate(HEAVY):
        assert final[f"h{i}"] == unpreempted[p], p
    for i, p in enumerate(LIGHT):
        assert final[f"l{i}"] == unpreempted[p], p
    pool_whole(llm)


def test_a_pin_is_charged_to_its_tenant(aidreams_path, pool_whole):
    llm = LLM(aidreams_path, block_size=16, scheduling_policy="fair")
    ids = llm.tokenizer.encode(" ".join(HEAVY[:4]))
    pin = llm.pin_prefix(ids, ttl_s=60, tenant="heavy")
    kv = llm.engine.kv_cache_manager
    assert pin.tenant == "heavy" and pin.num_tokens >= 16
    assert kv.pinned_blocks_by_tenant() == {"heavy": pin.num_tokens // 16}
    other = llm.pin_prefix(ids, ttl_s=60)  # the same blocks, charged to nobody
    assert other.tenant is None and kv.pinned_blocks_by_tenant() == {"heavy": pin.num_tokens // 16}
    # the pin's prefill was charged to the tenant too
    assert llm.stats()["tenants"]["heavy"]["served_input_tokens"] == len(ids)
    for p in (pin, other):
        llm.unpin_prefix(p.id)
    pool_whole(llm)


def test_the_engine_predicts_a_first_token_wait_from_measured_rates(aidreams_path, pool_whole):
    llm = LLM(aidreams_path, block_size=16, max_num_seqs=4)
    engine = llm.engine
    assert engine.predict_ttft(8) is None  # nothing measured
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(HEAVY, [params] * len(HEAVY))
    s = llm.stats()
    assert s["prefill_tokens_per_s"] > 0 and s["decode_tokens_per_s"] > 0
    idle = engine.predict_ttft(8)
    assert idle is not None and idle > 0
    for i, p in enumerate(HEAVY):  # queued work makes the predicted wait longer
        engine.add_request(f"q{i}", p, params)
    assert engine.predict_ttft(8) > idle
    with pytest.raises(ValueError):
        engine.predict_ttft(0)
    while engine.has_unfinished_requests():
        engine.step()
    pool_whole(llm)


def test_the_async_engine_predicts_from_its_stats_snapshot(aidreams_path, pool_whole):
    import asyncio

    from prefixgate.engine import AsyncEngine, EngineConfig
    from prefixgate.engine.load_model import estimate_ttft

    engine = AsyncEngine(EngineConfig(model=aidreams_path, num_kv_blocks=256))
    try:
        assert engine.predict_ttft(8) is None
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

        async def run() -> None:
            async def one(i: int, p: str) -> None:
                async for _ in engine.generate(p, params, f"r{i}"):
                    pass

            await asyncio.gather(*(one(i, p) for i, p in enumerate(HEAVY)))

        asyncio.run(run())
        s = engine.stats()
        cfg = engine.engine.config
        want = estimate_ttft(s, cfg.max_num_seqs, cfg.max_num_batched_tokens, 8)
        assert want is not None and want > 0
        assert engine.predict_ttft(8) == pytest.approx(want)
        pool_whole(engine)
    finally:
        asyncio.run(engine.shutdown())
