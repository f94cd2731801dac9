"""logit_bias, min_tokens and stop_token_ids: applied by the sampler on aidreams-260k, ids
checked against the vocabulary before anything is queued."""

from __future__ import annotations

import pytest
import torch
from prefixgate.engine import LLM, SamplingParams
from prefixgate.engine.sampler import Sampler, SamplingState

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def llm(aidreams_path):
    return LLM(aidreams_path, num_kv_blocks=128)


def test_logit_bias_forces_and_bans_tokens(llm, pool_whole):
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    free = llm.generate(["A gentle hum"], base)[0].outputs[0].token_ids
    forced = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={"300": 100}
    )  # JSON's string keys accepted
    assert llm.generate(["A gentle hum"], forced)[0].outputs[0].token_ids == [300] * 6
    banned = SamplingParams(
        temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logit_bias={free[0]: -100}
    )
    assert llm.generate(["A gentle hum"], banned)[0].outputs[0].token_ids[0] != free[0]
    pool_whole(llm)


def test_min_tokens_masks_eos_and_stop_ids_until_reached(llm, pool_whole):
    eos = next(iter(llm.engine.eos_token_ids))
    p = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, logit_bias={eos: 100})
    out = llm.generate(["Hi"], p)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    p = SamplingParams(
        temperature=0.0, max_tokens=20, min_tokens=3, stop_token_ids=[300], logit_bias={300: 100}
    )
    out = llm.generate(["Hi"], p)[0].outputs[0]
    assert out.token_ids[3] == 300 and len(out.token_ids) == 4 and out.finish_reason == "stop"
    pool_whole(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logit_bias": {5: 101}},
        {"logit_bias": {5: -100.5}},
        {"logit_bias": {5: float("nan")}},
        {"logit_bias": {"x": 1}},
        # keys int() would read as some other id than the one written: refused, not guessed
        {"logit_bias": {" 5": 1}},
        {"logit_bias": {"+5": 1}},
        {"logit_bias": {"5_0": 1}},
        {"logit_bias": {"\u0665": 1}},  # Arabic-Indic digit five
        {"logit_bias": {"05": 1}},
        {"logit_bias": {"5.0": 1}},
        {"logit_bias": {5.7: 1}},
        {"logit_bias": {True: 1}},
        {"logit_bias": {-1: 1}},
        {"logit_bias": [1, 2]},
        {"min_tokens": -1},
        {"min_tokens": 9, "max_tokens": 8},
        {"min_tokens": 1.5},
        {"stop_token_ids": [-1]},
    ],
)
def test_bad_values_refused(kwargs):
    with pytest.raises((ValueError, TypeError)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"logit_bias": {512: 1}}, {"stop_token_ids": [2, 512]}, {"logit_bias": {10**9: 1}}]
)
def test_ids_outside_vocabulary_refused_by_field(llm, kwargs, pool_whole):
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=field):
        llm.generate(["Hi"], SamplingParams(**kwargs))
    pool_whole(llm)


def test_logit_bias_keys_are_ints_or_their_decimal_digits():
    assert SamplingParams(logit_bias={"42": 1, 7: -2, "0": 3}).logit_bias == {
        42: 1.0,
        7: -2.0,
        0: 3.0,
    }


def test_sampler_bias_rows_independent():
    """A biased row does not change an unbiased one in the same batch."""
    logits = torch.randn(2, 50)
    plain = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias={7: 100})
    out = Sampler().sample(logits, [SamplingState(biased, [1], []), SamplingState(plain, [1], [])])
    assert out[0].token_id == 7 and out[1].token_id == int(logits[1].argmax())
