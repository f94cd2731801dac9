"""``EngineRequest``: the one per-request value, built once by the caller and carried to the
engine's ``Request`` (engine/protocol.py); bad fields are TypeErrors naming the field."""

from __future__ import annotations

import asyncio

import pytest
from prefixgate.engine import EngineRequest, SamplingParams
from prefixgate.engine.config import EngineConfig
from support.outputs import whole

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": 7}, "request_id"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": b"hi"}, "prompt"),
        ({"sampling_params": {"max_tokens": 3}}, "sampling params"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"tenant": ["a"]}, "tenant"),
        ({"priority": True}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"arrival_time": "now"}, "arrival_time"),
    ],
)
def test_bad_fields_are_type_errors_naming_the_field(kwargs, field):
    base = {"request_id": "r", "prompt": [1, 2]}
    with pytest.raises(TypeError, match=field):
        EngineRequest(**{**base, **kwargs})


def test_defaults():
    r = EngineRequest("r", "hi")
    assert r.sampling_params == SamplingParams() and r.priority == 0
    assert r.cache_salt is None and r.tenant is None and r.arrival_time is None
    assert EngineRequest("r", "hi", None).sampling_params == SamplingParams()  # type: ignore[arg-type]


def test_the_engine_request_reaches_the_request(aidreams_path, pool_whole):
    from prefixgate.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=aidreams_path, num_kv_blocks=64))
    er = EngineRequest("r1", "Hello", GREEDY, "salt", "team-a", 3, 12.5)
    eng.add_request(er)
    req = eng.scheduler.requests["r1"]
    assert req.engine_request is er
    assert (req.cache_salt, req.tenant, req.priority, req.arrival_time) == (
        "salt",
        "team-a",
        3,
        12.5,
    )
    # vLLM's loose form builds the same value
    eng.add_request("r2", "Hello", GREEDY, cache_salt="s2", tenant="b", priority=1)
    er2 = eng.scheduler.requests["r2"].engine_request
    assert (er2.request_id, er2.prompt, er2.cache_salt, er2.tenant, er2.priority) == (
        "r2",
        "Hello",
        "s2",
        "b",
        1,
    )
    with pytest.raises(ValueError, match="already in flight"):
        eng.add_request(EngineRequest("r1", "Hello", GREEDY))
    while eng.scheduler.requests:
        eng.step()
    pool_whole(eng)


def test_async_engine_generate_takes_the_request(aidreams_path, pool_whole):
    from prefixgate.engine import AsyncEngine

    async def go():
        engine = AsyncEngine(EngineConfig(model=aidreams_path, num_kv_blocks=64))
        try:
            er = EngineRequest("a1", "Hello", GREEDY, tenant="t", priority=0)
            outs = [o async for o in engine.generate(er)]
            loose = [o async for o in engine.generate("Hello", GREEDY, "a2")]
            assert whole(outs).token_ids == whole(loose).token_ids
            assert outs[-1].request_id == "a1" and outs[-1].finished
            with pytest.raises(TypeError, match="no other argument"):
                async for _ in engine.generate(er, GREEDY):
                    pass
            pool_whole(engine)
        finally:
            await engine.shutdown()

    asyncio.run(go())
