"""SamplingParams refuse bad values with the right error (types, non-finite numbers, seed
range); bad params of one request fail no bystander; a tiny top_p keeps the top token
(aidreams-260k)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("prefixgate.engine.async_engine")

NAN, INF = float("nan"), float("inf")

from prefixgate.engine import LLM, AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from support.outputs import whole  # noqa: E402


@pytest.mark.parametrize(
    "kw", [{"skip_special_tokens": None}, {"skip_special_tokens": "no"}, {"ignore_eos": "yes"}]
)
def test_sampling_params_bool_fields_type_checked(kw):
    # skip_special_tokens=None passed and reached tokenizers.decode inside the engine step,
    # failing every request of that step (see test_bad_params_do_not_fail_bystanders).
    with pytest.raises(TypeError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": NAN},
        {"temperature": INF},
        {"repetition_penalty": NAN},
        {"repetition_penalty": INF},
    ],
)
def test_sampling_params_refuse_non_finite(kw):
    # NaN passed every range check (NaN < 0 is False) and inf had no upper bound.
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_sampling_params_seed_range(seed):
    # Out of torch's range, the seed failed late in add_request ("Overflow when unpacking
    # long long"); the edges of the range are valid seeds.
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_bad_params_do_not_fail_bystanders(pool_whole):
    async def main():
        engine = AsyncEngine(EngineConfig(num_kv_blocks=64))
        good = SamplingParams(max_tokens=6, temperature=0)

        async def run(rid, params):
            outs = [out async for out in engine.generate("hello", params, rid)]
            return whole(outs).text

        try:
            ref = await run("ref", good)
            bad = SamplingParams(max_tokens=6)
            bad.skip_special_tokens = None  # broken after construction: re-validated on submit
            res = await asyncio.gather(
                run("a", good), run("bad", bad), run("b", good), return_exceptions=True
            )
            assert isinstance(res[1], TypeError)
            assert res[0] == ref and res[2] == ref, res  # bystanders undisturbed
            pool_whole(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_tiny_top_p_keeps_the_most_likely_token(pool_whole):
    # top_p=1e-50 (valid: > 0) became 0.0 in a float32 tensor, so "mass before >= top_p" was
    # true for every token, the most likely one included: every logit -inf, garbage text
    # ('μμμμ' on aidreams where greedy says 'pes of vectors').
    import torch
    from prefixgate.engine.sampler import apply_top_p

    scores = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.2, 0.3]])
    for p in (1e-50, 1e-300, 5e-324, 1e-9):
        out = apply_top_p(scores, [p, 1.0])
        assert torch.isfinite(out[0]).tolist() == [False, True, False, False], (p, out)
        assert torch.equal(out[1], scores[1])
    llm = LLM(num_kv_blocks=64)
    greedy = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0))
    tiny = llm.generate(["hello"], SamplingParams(max_tokens=8, top_p=1e-50, seed=3))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    pool_whole(llm)
