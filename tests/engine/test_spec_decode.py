"""Speculative decoding (n-gram prompt lookup): drafts, verification, the engine end to end.

Greedy outputs with speculation must equal those without, token for token, on the real tiny
model (aidreams-260k) across prompts that repeat and that do not, batched, under preemption,
chunked prefill and prefix caching, with every logits processor on, and with stop strings /
``max_tokens`` landing inside an accepted run; the rejection sampler must keep the target
distribution exactly (statistical test at a fixed seed). Every scenario ends with the pool whole.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_pool_whole
from prefixgate.engine import LLM, EngineConfig, SamplingParams
from prefixgate.engine.logits_processors import SamplingState
from prefixgate.engine.sampler import Sampler
from prefixgate.engine.sampling_params import StructuredOutputsParams
from prefixgate.engine.spec_decode import (
    COOLDOWN_TOKENS,
    MIN_VERIFY_STEPS,
    NgramProposer,
    SpecDecodeState,
    rejection_sample,
)
from support.outputs import whole

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REPEATING = [
    "I sense the nodes. I sense the nodes. I sense the nodes. I sense the",
    "Repeat: the cat sat on the mat. the cat sat on the mat. the cat sat on",
    "one two three four, one two three four, one two three four, one two",
]
PLAIN = [
    "The garden of numbers",
    "Between the layers of thought",
    "A thousand whispers weave",
    "Night",
]
PROMPTS = REPEATING + PLAIN


# ---- the drafter ---------------------------------------------------------------------------


def test_ngram_proposer_takes_the_longest_recent_match():
    p = NgramProposer(3, 1, 3)
    #            0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]
    assert p.propose(tokens) == [8, 9, 5]  # "5 6 7" recurs at 0: what followed it
    assert p.propose(tokens, max_drafts=2) == [8, 9]
    assert p.propose(tokens, max_drafts=0) == []
    assert p.propose([1, 2, 3, 4]) == []  # nothing recurs
    # the most recent occurrence wins among equal lengths; past the end the match's period
    # continues: "1" recurred 2 tokens back, so the drafts repeat "3 1"
    assert NgramProposer(4, 1, 1).propose([1, 2, 1, 3, 1]) == [3, 1, 3, 1]
    assert NgramProposer(5, 2, 3).propose([4, 7, 7, 7]) == [7, 7, 7, 7, 7]  # a loop of one
    # longer n-grams first: "2 1" matches at 1 (then 9), not "1" at 3 (then 4)
    assert NgramProposer(2, 1, 2).propose([2, 1, 9, 1, 4, 2, 1]) == [9, 1]
    assert NgramProposer(2, 3, 3).propose([2, 1, 9, 1, 4, 2, 1]) == []  # min 3: no match


@pytest.mark.parametrize("args", [(0, 1, 2), (2, 0, 2), (2, 3, 2)], ids=["k0", "min0", "min>max"])
def test_ngram_proposer_bounds(args):
    with pytest.raises(ValueError):
        NgramProposer(*args)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"speculative_method": "eagle"},
        {"num_speculative_tokens": 0},
        {"prompt_lookup_min": 0},
        {"prompt_lookup_min": 4, "prompt_lookup_max": 3},
        {"spec_min_acceptance": 1.5},
        {"threads": 0},
    ],
)
def test_config_refuses_bad_speculation_options(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_spec_state_pauses_on_low_acceptance_and_backs_off():
    st = SpecDecodeState()
    for i in range(MIN_VERIFY_STEPS):
        assert st.enabled(i)
        st.record(4, 0, i + 1, min_acceptance=0.25)
    assert not st.enabled(MIN_VERIFY_STEPS)
    assert st.enabled(MIN_VERIFY_STEPS + COOLDOWN_TOKENS)
    assert st.cooldown == 2 * COOLDOWN_TOKENS  # the next pause doubles
    good = SpecDecodeState()
    for i in range(10):
        good.record(4, 3, i + 1, min_acceptance=0.25)
    assert good.enabled(11)


def test_spec_state_adapts_draft_count_and_ngram_length():
    st = SpecDecodeState()
    st.record(4, 1, 2, 0.0, max_drafts=4, ngram_bounds=(2, 5))  # a rejection: one draft fewer
    assert (st.num_drafts, st.min_n) == (3, 2)
    st.record(3, 0, 3, 0.0, max_drafts=4, ngram_bounds=(2, 5))  # nothing accepted: longer match
    assert (st.num_drafts, st.min_n) == (2, 3)
    for i in range(5):
        st.record(1, 0, 4 + i, 0.0, max_drafts=4, ngram_bounds=(2, 5))
    assert (st.num_drafts, st.min_n) == (1, 5)  # floors: one draft, the longest n-gram
    st.record(1, 1, 10, 0.0, max_drafts=4, ngram_bounds=(2, 5))  # all accepted: 2 more
    assert (st.num_drafts, st.min_n) == (3, 4)
    st.record(3, 3, 14, 0.0, max_drafts=4, ngram_bounds=(2, 5))
    assert (st.num_drafts, st.min_n) == (4, 3)  # capped at k
    plain = SpecDecodeState()
    plain.record(4, 0, 1, 0.0)  # without the bounds: nothing adapts
    assert (plain.num_drafts, plain.min_n) == (None, None)


def test_proposer_min_n_override():
    prop = NgramProposer(3, 1, 3)
    toks = [7, 1, 2, 9, 5, 2]  # "2" recurs (followed by 9); no 2- or 3-gram does
    assert prop.propose(toks) == [9, 5, 2]
    assert prop.propose(toks, min_n=2) == []
    assert prop.propose(toks, index=prop.new_index(), min_n=2) == []
    assert prop.propose(toks, min_n=0) == [9, 5, 2]  # clamped to prompt_lookup_min


# ---- rejection sampling --------------------------------------------------------------------


def test_rejection_sample_keeps_the_target_distribution():
    """Output frequencies match ``p`` within 5 standard errors; acceptance matches ``p(t)``."""
    p = torch.tensor([0.1, 0.25, 0.3, 0.05, 0.3], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1234)
    n = 40_000
    u = torch.rand(n, 2, generator=gen, dtype=torch.float64).tolist()
    counts = [0] * 5
    accepted = 0
    for ua, ur in u:
        t, ok = rejection_sample(p, 2, ua, ur)
        counts[t] += 1
        accepted += ok
    for i, c in enumerate(counts):
        se = math.sqrt(p[i].item() * (1 - p[i].item()) / n)
        assert abs(c / n - p[i].item()) < 5 * se, (i, c / n, p[i].item())
    se = math.sqrt(0.3 * 0.7 / n)
    assert abs(accepted / n - 0.3) < 5 * se


def test_rejection_sample_edges():
    p = torch.tensor([0.5, 0.0, 0.5])
    for u in (0.0, 0.5, 0.999):
        t, ok = rejection_sample(p, 1, 0.0, u)  # a draft of probability 0 is never accepted
        assert not ok and t in (0, 2)
    t, ok = rejection_sample(torch.tensor([0.0, 1.0]), 1, 0.999999, 0.3)
    assert (t, ok) == (1, True)  # a point mass on the draft: always kept
    with pytest.raises(ValueError):
        rejection_sample(p, 3, 0.1, 0.1)
    with pytest.raises(ValueError):
        rejection_sample(p.unsqueeze(0), 0, 0.1, 0.1)


def test_verify_sampling_matches_plain_sampling_distribution():
    """Through ``Sampler.verify`` (temperature, top-k, penalties): the first output token's
    frequencies equal ``softmax`` of the processed row, whatever the draft."""
    vocab = 6
    logits = torch.tensor([[1.0, 2.0, 0.5, 1.5, -1.0, 0.0], [0.0] * vocab])
    params = SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.5)
    state = SamplingState(params, [0], [3], generator=torch.Generator().manual_seed(7))
    sampler = Sampler(seed=0)
    n = 20_000
    counts = [0] * vocab
    for _ in range(n):
        counts[sampler.verify(logits, state, [1])[0]] += 1
    row = logits[0].clone()
    row[3] -= 0.5  # presence penalty on the output token
    row = row / 0.8
    row[4] = float("-inf")  # top-k 5 drops the lowest
    p = torch.softmax(row, dim=-1).tolist()
    for i in range(vocab):
        se = math.sqrt(max(p[i] * (1 - p[i]), 1e-12) / n)
        assert abs(counts[i] / n - p[i]) < 5 * se + 1e-9, (i, counts[i] / n, p[i])


def test_verify_greedy_accepts_the_matching_prefix():
    sampler = Sampler()
    logits = torch.full((4, 5), 0.0)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = logits[3, 4] = 5.0  # argmaxes 2, 3, 1, 4
    state = SamplingState(SamplingParams(temperature=0.0), [0], [])
    assert sampler.verify(logits, state, [2, 3, 1]) == [2, 3, 1, 4]  # all + bonus
    assert sampler.verify(logits, state, [2, 0, 1]) == [2, 3]  # correction at the mismatch
    assert sampler.verify(logits, state, [4, 3, 1]) == [2]
    with pytest.raises(ValueError):
        sampler.verify(logits, state, [2, 3])


# ---- the engine, end to end on the real tiny model -----------------------------------------


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    assert_pool_whole(llm)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def plain(aidreams_path):
    return LLM(aidreams_path, block_size=16)


@pytest.fixture(scope="module")
def spec(aidreams_path):
    return LLM(aidreams_path, block_size=16, speculative_method="ngram")


def test_greedy_identical_batched_and_alone(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=48)
    before = spec.stats()["spec_decode_num_accepted_tokens"]
    assert _run(spec, PROMPTS, params) == _run(plain, PROMPTS, params)
    for p in (REPEATING[0], PLAIN[0]):
        assert _run(spec, [p], params) == _run(plain, [p], params)
    s = spec.stats()
    assert s["spec_decode_num_accepted_tokens"] > before  # the repeating prompts were sped up
    assert 0 < s["spec_decode_acceptance_rate"] <= 1
    assert s["spec_decode_num_accepted_tokens"] <= s["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 11, 13])
def test_max_tokens_inside_an_accepted_run(plain, spec, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    got = _run(spec, REPEATING, params)
    assert got == _run(plain, REPEATING, params)
    assert all(len(ids) == max_tokens for ids, _, _ in got)


def test_stop_strings_and_stop_ids_inside_an_accepted_run(plain, spec):
    ref = _run(plain, REPEATING, SamplingParams(temperature=0.0, max_tokens=40))
    for (ids, text, _), prompt in zip(ref, REPEATING, strict=True):
        for cut in (5, 12, 21):
            stop = text[cut : cut + 3]
            if not stop.strip():
                continue
            params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
            got = _run(spec, [prompt], params)
            assert got == _run(plain, [prompt], params)
            assert got[0][2] == "stop"
        params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids[9]])
        assert _run(spec, [prompt], params) == _run(plain, [prompt], params)


def test_logits_processors_hold_at_every_accepted_position(plain, spec):
    for params in (
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.6),
        SamplingParams(temperature=0.0, max_tokens=40, logit_bias={5: 3.0, 9: -5.0}),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=40, bad_words=["the"]),
    ):
        assert _run(spec, PROMPTS, params) == _run(plain, PROMPTS, params), params


def test_logprobs_requests_decode_without_drafts(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)
    before = spec.stats()["spec_decode_num_drafts"]
    a = spec.generate(REPEATING, params)
    b = plain.generate(REPEATING, params)
    assert spec.stats()["spec_decode_num_drafts"] == before
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(x.outputs[0].logprobs) == 20
    assert_pool_whole(spec)


def test_greedy_identical_under_preemption_and_chunked_prefill(aidreams_path, plain):
    small = LLM(
        aidreams_path,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=24,
        speculative_method="ngram",
    )
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = PROMPTS * 2
    assert _run(small, prompts, params) == _run(plain, prompts, params)
    s = small.stats()
    assert s["num_preemptions"] > 0
    assert s["spec_decode_num_accepted_tokens"] > 0


def test_greedy_identical_with_prefix_cache_hits(aidreams_path, plain):
    llm = LLM(aidreams_path, block_size=4, speculative_method="ngram", num_speculative_tokens=6)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    first = _run(llm, REPEATING, params)
    again = _run(llm, [p + " the" for p in REPEATING], params)  # reuses the cached blocks
    assert llm.stats()["prefix_cache_hits"] > 0
    assert first == _run(plain, REPEATING, params)
    assert again == _run(plain, [p + " the" for p in REPEATING], params)


def test_seeded_sampling_with_speculation_runs_and_repeats(aidreams_path):
    llm = LLM(aidreams_path, speculative_method="ngram")
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, seed=11)
    a = _run(llm, REPEATING, params)
    b = _run(llm, REPEATING, params)
    assert a == b  # a seeded request draws the same whatever else shares its batch
    assert all(len(ids) == 30 for ids, _, _ in a)


def test_structured_output_decodes_without_drafts(aidreams_path):
    pytest.importorskip("xgrammar")
    llm = LLM(aidreams_path, speculative_method="ngram")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex="(ab){1,8}"),
    )
    out = llm.generate([REPEATING[0]], params)[0]
    assert llm.stats()["spec_decode_num_drafts"] == 0
    assert out.outputs[0].text.startswith("ab")
    assert_pool_whole(llm)


def test_ngram_index_gives_the_scans_drafts_as_tokens_grow():
    """The incremental index (kept across steps) and the full numpy scan agree at every length."""
    import random

    rng = random.Random(5)
    for min_n, max_n in ((1, 3), (2, 5), (3, 3)):
        p = NgramProposer(4, min_n, max_n)
        index = p.new_index()
        tokens = [rng.randrange(6) for _ in range(3)]
        for _ in range(300):
            assert p.propose(tokens, index=index) == p.propose(tokens), (min_n, max_n, tokens)
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_async_engine_streams_every_accepted_token_once(aidreams_path, plain):
    """Several tokens per step reach a stream as one delta each step: the deltas join to the
    final output, which equals the plain engine's."""
    import asyncio

    from prefixgate.engine import AsyncEngine

    params = SamplingParams(temperature=0.0, max_tokens=40)

    async def run() -> list[tuple[list[int], list[int]]]:
        engine = AsyncEngine(EngineConfig(model=aidreams_path, speculative_method="ngram"))
        try:
            got = []
            longest = 0
            for i, prompt in enumerate(REPEATING):
                outs = [o async for o in engine.generate(prompt, params, f"s{i}")]
                joined = [t for o in outs for t in o.delta_token_ids]
                got.append((joined, whole(outs).token_ids))
                longest = max(longest, *(len(o.delta_token_ids) for o in outs))
            assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
            assert longest > 1  # some step delivered an accepted run in one delta
            engine.check_invariants()
            return got
        finally:
            await engine.shutdown()

    got = asyncio.run(run())
    ref = [o.outputs[0].token_ids for o in plain.generate(REPEATING, params)]
    for (joined, final), want in zip(got, ref, strict=True):
        assert joined == final == list(want)
