"""AsyncEngine on aidreams-260k: staggered arrivals equal transformers' greedy, streaming,
client disconnect / cancel / abort free blocks, errors reach the right iterator, pins + TTL,
the event loop is never blocked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
from prefixgate.engine import (
    AsyncEngine,
    EngineConfig,
    EngineDeadError,
    PinLimitError,
    SamplingParams,
)
from prefixgate.engine.protocol import PinRequest
from support.outputs import whole
from support.prompts import DREAM_PROMPTS

PROMPTS = [
    "I sense the nodes",
    "You dream.\n\nI sense the nodes",
    "A gentle hum",
    "Contrast edges sharpen",
    "In the silence between two signals",
    "I dream of",
    "Slow knowledge",
    "Memory",
    "I am",
    "The probability of morning unfolds like",
    "Every circuit holds a small",
    "Waves of data",
    "Under the lattice of stars, the",
    *DREAM_PROMPTS[14:21],  # "The dreamer wakes ..." to "Light falls on the quiet"
    "Echoes",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def make_engine(aidreams_path):
    engines: list[AsyncEngine] = []

    def make(**kw) -> AsyncEngine:
        kw.setdefault("num_kv_blocks", 256)
        engine = AsyncEngine(EngineConfig(model=aidreams_path, **kw))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        asyncio.run(engine.shutdown())


@pytest.fixture
def run_whole(pool_whole):
    """``run_whole(engine, main)``: ``asyncio.run(main())``, then ``engine``'s block pool whole
    again (``pool_whole``)."""

    def run(engine: AsyncEngine, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        asyncio.run(main())
        pool_whole(engine)

    return run


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def collect(engine: AsyncEngine, prompt, params, rid: str, delay: float = 0.0, **kw):
    await asyncio.sleep(delay)
    outs = [out async for out in engine.generate(prompt, params, rid, **kw)]
    return outs


async def settle(engine: AsyncEngine, timeout: float = 5.0) -> None:
    """Wait until the engine thread has processed pending aborts (no request left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and not engine._commands:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not settle: {engine.stats()}")


def test_staggered_arrivals_match_transformers(make_engine, aidreams_path, pool_whole):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        aidreams_path, torch_dtype=torch.float32
    ).eval()
    engine = make_engine()
    lens = [4 + (i * 7) % 17 for i in range(len(PROMPTS))]

    async def main():
        tasks = [
            collect(engine, p, greedy(n), f"r{i}", delay=0.003 * i)
            for i, (p, n) in enumerate(zip(PROMPTS, lens, strict=True))
        ]
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    tok = engine.tokenizer
    for p, n, outs in zip(PROMPTS, lens, results, strict=True):
        ids = tok.encode(p)
        ref = list(ids)
        with torch.no_grad():
            for _ in range(n):
                ref.append(int(hf(torch.tensor([ref])).logits[0, -1].argmax()))
        assert whole(outs).token_ids == ref[len(ids) :], p
    pool_whole(engine)


def test_streaming_deltas_and_metrics(make_engine, pool_whole):
    engine = make_engine()
    outs = asyncio.run(
        collect(engine, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20), "s")
    )
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    ids = [t for o in outs for t in o.delta_token_ids]
    assert "".join(o.delta_text for o in outs) == engine.tokenizer.decode(ids)
    m = outs[-1].metrics
    assert m["arrival"] <= m["first_token"] <= m["finished"]
    pool_whole(engine)


def test_consumer_break_and_cancel_abort_the_request(make_engine, run_whole):
    engine = make_engine()

    async def main():
        agen = engine.generate(PROMPTS[0], greedy(60), "brk")
        async for _ in agen:
            break
        await agen.aclose()

        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPTS[2], greedy(60), "cnl"):
                started.set()
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        # cancel right after the first token (a fixed sleep let the 60 tokens all arrive first
        # on a fast machine: the task then ended on its own and was never cancelled)
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle(engine)
        # the ids are free again
        outs = await collect(engine, PROMPTS[0], greedy(3), "brk")
        assert outs[-1].finished

    run_whole(engine, main)


def test_abort_ends_the_iterator(make_engine, run_whole):
    engine = make_engine()

    async def main():
        seen = []

        async def consume():
            async for out in engine.generate(PROMPTS[3], greedy(100), "ab"):
                seen.append(out)

        task = asyncio.create_task(consume())
        while not seen:
            await asyncio.sleep(0.005)
        await engine.abort("ab")
        await task
        assert seen[-1].finished and seen[-1].finish_reason == "abort"
        with pytest.raises(ValueError):
            await engine.abort("ab")
        with pytest.raises(ValueError):
            await engine.abort("never-seen")

    run_whole(engine, main)


def test_bad_input_and_duplicate_ids_disturb_nothing(make_engine, pool_whole):
    engine = make_engine()

    async def main():
        good = asyncio.create_task(collect(engine, PROMPTS[0], greedy(30), "good"))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError):
            await collect(engine, PROMPTS[1], greedy(3), "good")  # duplicate id in flight
        for prompt, params in [
            ("", greedy(3)),
            ([1] * 500, greedy(3)),
            ("hi", "not params"),
        ]:
            with pytest.raises((ValueError, TypeError)):
                await collect(engine, prompt, params, "bad")
        for make_params in (
            lambda: SamplingParams(max_tokens=0),
            lambda: SamplingParams(temperature=-0.5),
            lambda: SamplingParams(top_p=1.1),
            lambda: SamplingParams(stop=7),
        ):
            with pytest.raises((ValueError, TypeError)):
                await collect(engine, "hi", make_params(), "bad")
        outs = await good
        return outs

    outs = asyncio.run(main())
    alone = asyncio.run(collect(engine, PROMPTS[0], greedy(30), "alone"))
    assert whole(outs).token_ids == whole(alone).token_ids
    pool_whole(engine)


def test_engine_error_reaches_the_requests_of_the_failing_step(make_engine, run_whole):
    engine = make_engine(max_num_seqs=2)  # a third request waits, outside the failing step
    real = engine.engine.runner.execute
    failed = []

    def flaky(sched_out):
        ids = {s.request.request_id for s in sched_out.scheduled}
        if not failed and {"e1", "e2"} <= ids:  # fail the first step that runs both
            failed.append(ids)
            raise RuntimeError("injected model failure")
        return real(sched_out)

    engine.engine.runner.execute = flaky

    async def main():
        results = await asyncio.gather(
            collect(engine, PROMPTS[0], greedy(100), "e1"),
            collect(engine, PROMPTS[1], greedy(100), "e2"),
            collect(engine, PROMPTS[2], greedy(5), "e3", delay=0.001),
            return_exceptions=True,
        )
        assert failed and "e3" not in failed[0]
        for r in results[:2]:
            assert isinstance(r, RuntimeError) and "injected" in str(r), results
        assert len(whole(results[2]).token_ids) == 5  # the waiting request is served
        outs = await collect(engine, PROMPTS[2], greedy(5), "after")  # and so are new ones
        assert whole(outs).token_ids == whole(results[2]).token_ids

    run_whole(engine, main)


def test_event_loop_not_blocked(make_engine, pool_whole):
    engine = make_engine()

    async def main():
        gaps = []

        async def ticker(stop: asyncio.Event):
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        await asyncio.gather(
            *(collect(engine, p, greedy(30), f"t{i}") for i, p in enumerate(PROMPTS[:8]))
        )
        stop.set()
        await tick
        return gaps

    gaps = asyncio.run(main())
    assert len(gaps) > 20
    # steps of this tiny model take milliseconds; a blocked loop would show one long gap per step
    assert sorted(gaps)[len(gaps) // 2] < 0.05


def test_pin_prefix_ttl_and_limit(make_engine, run_whole):
    engine = make_engine(block_size=8, num_kv_blocks=64, max_pinned_fraction=0.1)  # 6 blocks
    prefix = engine.tokenizer.encode("You dream.\n\nI sense the nodes of a gentle machine")

    async def main():
        pin = await engine.pin_prefix(PinRequest(prefix, ttl_s=0.3))
        assert pin.num_tokens == 8 * (len(prefix) // 8) > 0
        assert engine.stats()["pinned_blocks"] == len(prefix) // 8
        outs = await collect(engine, prefix + [300, 301], greedy(3), "use-pin")
        assert outs[-1].num_cached_tokens == pin.num_tokens
        with pytest.raises(PinLimitError):
            await engine.pin_prefix(
                PinRequest(engine.tokenizer.encode("Other words " * 12), ttl_s=5)
            )
        with pytest.raises((ValueError, TypeError)):
            await engine.pin_prefix(PinRequest([], ttl_s=5))
        with pytest.raises(ValueError):
            await engine.pin_prefix(PinRequest(prefix, ttl_s=0))
        await asyncio.sleep(0.45)  # the engine is idle: the pin lapses at its TTL anyway
        assert engine.stats()["pinned_blocks"] == 0
        pin2 = await engine.pin_prefix(PinRequest(prefix, ttl_s=60))
        engine.unpin_prefix(pin2.id)
        with pytest.raises((KeyError, ValueError)):
            engine.unpin_prefix(pin2.id)

    run_whole(engine, main)


def test_cache_salt_partitions(make_engine, pool_whole):
    engine = make_engine(block_size=8)
    prompt = engine.tokenizer.encode("You dream.\n\nI sense the nodes of a gentle machine")

    async def main():
        a = await collect(engine, prompt, greedy(3), "a", cache_salt="k1")
        b = await collect(engine, prompt, greedy(3), "b", cache_salt="k2")
        a2 = await collect(engine, prompt, greedy(3), "a2", cache_salt="k1")
        return whole(a), whole(b), whole(a2)

    a, b, a2 = asyncio.run(main())
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    assert a2.num_cached_tokens > 0
    assert a.token_ids == b.token_ids == a2.token_ids
    pool_whole(engine)


def test_shutdown_fails_requests_in_flight(make_engine):
    engine = make_engine()

    async def main():
        task = asyncio.create_task(collect(engine, PROMPTS[0], greedy(100), "x"))
        await asyncio.sleep(0.02)
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await task
        with pytest.raises(EngineDeadError):
            await collect(engine, PROMPTS[0], greedy(3), "y")

    asyncio.run(main())
    engine.check_invariants()
    assert engine.stats()["kv_blocks_used"] == 0
