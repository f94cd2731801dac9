"""The engine's Python API with bad input: bad prompts leave the block pool whole, a cancelled
pin_prefix leaks no pin, EngineConfig names the field of a wrong type or range."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.engine import LLM, AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from prefixgate.engine.protocol import PinRequest  # noqa: E402


def test_llm_bad_prompts_leave_the_pool_whole(pool_whole):
    llm = LLM(num_kv_blocks=64)
    sp = SamplingParams(max_tokens=3, temperature=0)
    ref = llm.generate(["hello"], sp)[0].outputs[0].text
    for prompts, exc in [
        ("", ValueError),
        ([[]], ValueError),
        ([[1, -1]], ValueError),
        ([[1, 10**9]], ValueError),
        ([[1, 2.0]], TypeError),
        ([[[1, 2]]], TypeError),
        (None, TypeError),
        (5, TypeError),
        (["hello", ""], ValueError),
        (["hello", [1, 10**6]], ValueError),
    ]:
        with pytest.raises(exc):
            llm.generate(prompts, sp)
        pool_whole(llm)
    with pytest.raises(TypeError):
        llm.generate(["a"], ["not params"])
    assert llm.generate(["hello"], sp)[0].outputs[0].text == ref
    pool_whole(llm)


def test_cancelled_pin_prefix_leaks_no_pin(pool_whole):
    # A caller cancelled while AsyncEngine.pin_prefix prefilled its prefix (a client gone,
    # a timeout) left the pin in place for the whole TTL, its id known to no one.
    async def main():
        engine = AsyncEngine(EngineConfig(num_kv_blocks=64))
        try:
            for i in range(3):
                task = asyncio.create_task(
                    engine.pin_prefix(PinRequest(list(range(3 + i, 40 + i)), 3600.0))
                )
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            # Wait until the cancelled pins have landed and been released: until then their
            # prefill (an internal request) holds blocks while pinned_blocks is still 0. Their
            # commands may still sit in the engine thread's queue (counted nowhere in stats),
            # so wait for all three prefills (3 x 37 prompt tokens) to have run first.
            for _ in range(1000):
                await asyncio.sleep(0.02)
                s = engine.stats()
                if (
                    s["prompt_tokens_prefilled"] >= 3 * 37
                    and s["pinned_blocks"] == 0
                    and s["num_running"] == 0
                    and s["kv_blocks_used"] == 0
                ):
                    break
            assert engine.stats()["pinned_blocks"] == 0, engine.stats()
            pool_whole(engine)
            pin = await engine.pin_prefix(PinRequest(list(range(3, 40)), 60.0))  # still pins
            assert pin.num_tokens == 32 and engine.stats()["pinned_blocks"] == 2
            engine.unpin_prefix(pin.id)
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize(
    "kw",
    [
        {"num_kv_blocks": "8"},
        {"kv_cache_memory": "lots"},
        {"block_size": 16.0},
        {"max_num_seqs": True},
        {"max_model_len": "128"},
        {"seed": "0"},
        {"enable_prefix_caching": "no"},
        {"max_pinned_fraction": "0.5"},
    ],
)
def test_engine_config_types_named(kw):
    # num_kv_blocks="8" gave "'<' not supported between instances of 'str' and 'int'".
    from prefixgate.engine import EngineConfig

    with pytest.raises(TypeError, match=next(iter(kw))):
        EngineConfig(**kw)


def test_engine_config_seed_range():
    from prefixgate.engine import EngineConfig

    with pytest.raises(ValueError, match="seed"):
        EngineConfig(seed=2**70)  # was torch's "Overflow when unpacking long long"


def test_prompt_ids_checked_at_c_speed_keep_every_fault_named():
    # plain ints within the vocabulary take a C-speed check; every other prompt goes through
    # the per-token loop, which names the first fault as before
    import enum

    from prefixgate.engine.input_processor import InputProcessor
    from prefixgate.engine.protocol import EngineRequest
    from prefixgate.engine.sampling_params import SamplingParams

    class Id(enum.IntEnum):
        A = 3

    ip = InputProcessor(None, vocab_size=10, max_model_len=64)

    def prepare(prompt):
        return ip.prepare(EngineRequest("r", prompt, SamplingParams(max_tokens=1)))

    assert prepare([0, 9, 5]).prompt_token_ids == [0, 9, 5]
    assert prepare([Id.A, 1]).prompt_token_ids == [3, 1]  # an int subclass passes
    with pytest.raises(TypeError, match="must be ints, got bool"):
        prepare([1, True])
    with pytest.raises(TypeError, match="must be ints, got float"):
        prepare([1, 2.0])
    with pytest.raises(ValueError, match="prompt token id 10 is outside"):
        prepare([1, 10, -1])
    with pytest.raises(ValueError, match="prompt token id -1 is outside"):
        prepare([-1, 2])
