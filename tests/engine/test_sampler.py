"""Sampler: greedy, seeds, penalties (hand-computed), top-k/p/min-p masks, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prefixgate.engine.sampler import (
    Sampler,
    SamplingState,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    greedy_argmax,
    inverse_cdf,
)
from prefixgate.engine.sampling_params import SamplingParams


def state(gen: torch.Generator | None = None, prompt=(), output=(), **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), list(prompt), list(output), gen)


def seeded(seed: int, **kw) -> SamplingState:
    return state(torch.Generator().manual_seed(seed), temperature=1.0, **kw)


def test_all_greedy_batch_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler().sample(logits, [state(temperature=0.0) for _ in range(5)])
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()
    assert all(r.logprobs is None for r in out)


def test_greedy_rows_beside_random_rows_stay_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    batch = [state(temperature=0.0), seeded(1), state(temperature=0.0), state(temperature=0.7)]
    out = Sampler().sample(logits, batch)
    assert out[0].token_id == logits[0].argmax() and out[2].token_id == logits[2].argmax()


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(7)
    steps = [torch.randn(6, 64, generator=gen) for _ in range(20)]
    kw = dict(top_p=0.9, top_k=40)

    def run(batch_of: callable, row: int) -> list[int]:
        sampler, batch = Sampler(seed=123), batch_of()
        return [sampler.sample(logits[: len(batch)], batch)[row].token_id for logits in steps]

    alone = [Sampler().sample(s[3:4], [b])[0].token_id for b in [seeded(42, **kw)] for s in steps]
    # the same request (seed 42) at row 3, next to other seeded and unseeded requests; the
    # logits of its row are the same as alone (row 3 of each step)
    crowd = run(
        lambda: [
            seeded(1),
            state(temperature=1.0),
            state(temperature=0.0),
            seeded(42, **kw),
            state(temperature=0.5),
            seeded(9),
        ],
        3,
    )
    assert crowd == alone
    other_seed = [
        Sampler().sample(s[3:4], [b])[0].token_id for b in [seeded(43, **kw)] for s in steps
    ]
    assert other_seed != alone


def test_penalties_hand_computed():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5])
    st = state(
        prompt=[0, 0],
        output=[1, 3, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    apply_penalties(row, st)
    # repetition over prompt+output {0, 1, 3}: 2→1, -1→-2, 3→1.5; then OpenAI over output:
    # token 1 (count 1): -2 - 0.5 - 0.25; token 3 (count 2): 1.5 - 1.0 - 0.25.
    assert row.tolist() == pytest.approx([1.0, -2.75, 0.5, 0.25, -0.5])


def test_penalty_changes_greedy_choice_and_leaves_logits_untouched():
    logits = torch.tensor([[1.0, 0.9, 0.1]])
    before = logits.clone()
    batch = [state(output=[0], temperature=0.0, frequency_penalty=0.2)]
    assert Sampler().sample(logits, batch)[0].token_id == 1
    assert torch.equal(logits, before)


def test_top_k_mask():
    scores = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    out = apply_top_k(scores, [2, -1, 1])
    inf = float("-inf")
    assert out.tolist() == [[inf, 4.0, 3.0, inf], [1.0, 4.0, 3.0, 2.0], [inf, inf, inf, 3.0]]


def test_top_p_mask():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    scores = probs.log().repeat(3, 1)
    out = apply_top_p(scores, [0.8, 0.81, 1.0])
    kept = torch.isfinite(out).tolist()
    assert kept[0] == [True, True, False, False]  # mass before the third token is 0.8
    assert kept[1] == [True, True, True, False]
    assert kept[2] == [True] * 4
    assert torch.isfinite(apply_top_p(scores[:1], [1e-6])).tolist() == [[True, False, False, False]]


def test_min_p_mask():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs, [0.2])  # threshold 0.1
    assert out[0, 3] == 0 and out.sum().item() == pytest.approx(1.0)
    assert out[0, :3].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95])


def test_inverse_cdf_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(4, 1)
    picked = inverse_cdf(probs, torch.tensor([0.0, 0.49, 0.51, 0.999999]))
    assert picked.tolist() == [1, 1, 3, 3]


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().repeat(4000, 1)
    out = Sampler(seed=3).sample(logits, [state(temperature=1.0) for _ in range(4000)])
    counts = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=4) / 4000
    assert (counts - probs).abs().max().item() < 0.03


def test_top_k_and_temperature_restrict_choices():
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0, 0.5]]).repeat(300, 1)
    out = Sampler().sample(logits, [state(temperature=2.0, top_k=2) for _ in range(300)])
    assert {r.token_id for r in out} == {1, 2}


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    batch = [
        state(temperature=0.0, logprobs=2, output=[2], presence_penalty=2.0),
        state(temperature=0.0, logprobs=0),
    ]
    out = Sampler().sample(logits, batch)
    ref = torch.log_softmax(logits, -1)
    assert out[0].token_id == 1  # the penalty moved the choice off token 2 ...
    lp = out[0].logprobs
    assert lp.sampled.token_id == 1 and lp.sampled.logprob == pytest.approx(ref[0, 1].item())
    assert [x.token_id for x in lp.top] == [2, 1]  # ... but logprobs are of the raw logits
    assert [x.logprob for x in lp.top] == pytest.approx(ref[0, [2, 1]].tolist())
    assert out[1].logprobs.top == [] and out[1].logprobs.sampled.token_id == 3
    assert math.exp(out[1].logprobs.sampled.logprob) == pytest.approx(
        torch.softmax(logits[1], -1)[3].item()
    )


def test_logprobs_leave_out_masked_alternatives():
    """Was: a grammar allowing fewer tokens than ``top_logprobs`` gave -inf alternatives,
    sent as ``"logprob": null`` (invalid for OpenAI clients; the proxy answered 502)."""
    ninf = float("-inf")
    logits = torch.tensor([[ninf, 2.0, ninf, ninf], [1.0, 0.0, ninf, ninf]])
    batch = [state(temperature=0.0, logprobs=3), state(temperature=0.0, logprobs=3)]
    out = Sampler().sample(logits, batch)
    assert [x.token_id for x in out[0].logprobs.top] == [1]
    assert out[0].logprobs.top[0].logprob == pytest.approx(0.0)
    assert [x.token_id for x in out[1].logprobs.top] == [0, 1]
    assert all(math.isfinite(x.logprob) for r in out for x in r.logprobs.top)


def test_bad_shapes_raise():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [state()])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(5), [state()])
    assert Sampler().sample(torch.zeros(0, 5), []) == []


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 7, 1023, 1024, 2047, 2048, 2049, 3 * 1024 + 5, 5000]),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
    specials=st.lists(
        st.tuples(st.integers(0, 4), st.floats(0, 1), st.sampled_from(["nan", "inf", "-inf"])),
        max_size=4,
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_greedy_argmax_is_argmax(rows, vocab, seed, ties, specials, dtype):
    """The two-pass argmax gives ``argmax``'s index on every row: ties (the first maximum),
    NaN (the first NaN), +-inf, whole -inf rows, a vocabulary not a multiple of the block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if ties:  # few distinct values: equal maxima in several blocks
        x = (x * 2).round()
    for r, at, kind in specials:
        if r < rows:
            x[r, int(at * (vocab - 1))] = float(kind)
    if specials and specials[0][0] < rows and specials[0][2] == "-inf":
        x[specials[0][0]] = float("-inf")  # a whole row of -inf
    x = x.to(dtype)
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
