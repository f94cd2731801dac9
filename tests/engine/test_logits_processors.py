"""The one ordered logits pipeline (``engine/logits_processors.py``) and its conflict rules:
the grammar wins over ``min_tokens``, stop ids follow the grammar, ``logit_bias`` never
unmasks, no row is ever left without a finite logit, stop strings apply only after
``min_tokens``. Unit tests on a scripted grammar, then each rule on aidreams-260k."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema
import pytest
import torch
from prefixgate.engine import LLM, EngineRequest, SamplingParams
from prefixgate.engine.logits_processors import (
    STEP_ORDER,
    LogitsPipeline,
    SamplingState,
)
from prefixgate.engine.sampler import Sampler
from prefixgate.engine.sampling_params import StructuredOutputsParams as SO

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

EOS = 0
NEG_INF = float("-inf")


@dataclass
class ScriptedGrammar:
    """A grammar state whose next allowed tokens are given (``stop_ids_are_text`` as the
    real ``StructuredOutputRequest``)."""

    allowed: set[int]
    stop_ids_are_text: bool = False


class ScriptedManager:
    """``StructuredOutputManager.apply_bitmask``'s contract on ``ScriptedGrammar``s."""

    stop_token_ids = [EOS]

    def apply_bitmask(self, logits, rows, grammars):
        for row, g in zip(rows, grammars, strict=True):
            keep = torch.zeros(logits.shape[1], dtype=torch.bool)
            keep[sorted(g.allowed)] = True
            logits[row, ~keep] = NEG_INF


def _state(grammar=None, output=(), **kw) -> SamplingState:
    params = SamplingParams(temperature=0.0, **kw)
    return SamplingState(params, [5], list(output), None, frozenset({EOS}), grammar)


def _run(states, logits=None):
    logits = (
        torch.arange(8, dtype=torch.float32).repeat(len(states), 1) if logits is None else logits
    )
    return LogitsPipeline(ScriptedManager())(logits, states)


def test_steps_run_in_the_declared_order():
    assert [s.name for s in LogitsPipeline().steps] == list(STEP_ORDER)
    assert STEP_ORDER[0] == "grammar" and STEP_ORDER.index("min_tokens") < STEP_ORDER.index(
        "logit_bias"
    )


def test_grammar_that_allows_only_eos_wins_over_min_tokens():
    out = _run([_state(ScriptedGrammar({EOS}), min_tokens=4, max_tokens=8)])
    assert out.scores[0, EOS] == 0.0 and torch.isinf(out.scores[0, 1:]).all()
    # without the grammar's conflict min_tokens bans EOS as before
    out = _run([_state(ScriptedGrammar({EOS, 3}), min_tokens=4, max_tokens=8)])
    assert out.scores[0].tolist() == [NEG_INF, NEG_INF, NEG_INF, 3.0] + [NEG_INF] * 4


def test_logit_bias_never_unmasks_what_the_grammar_or_min_tokens_forbid():
    states = [
        _state(ScriptedGrammar({2, 3}), logit_bias={6: 100.0, 2: 10.0}),
        _state(min_tokens=2, max_tokens=4, logit_bias={EOS: 100.0}),
    ]
    out = _run(states)
    assert out.scores[0].tolist() == [NEG_INF, NEG_INF, 12.0, 3.0] + [NEG_INF] * 4
    assert out.scores[1, EOS] == NEG_INF and out.scores[1, 7] == 7.0
    assert (
        Sampler(pipeline=LogitsPipeline(ScriptedManager()))
        .sample(torch.arange(8.0).repeat(2, 1), states)[0]
        .token_id
        == 2
    )


def test_stop_ids_follow_the_grammar():
    # the grammar allows 4 and 6 as text but cannot end: the stop id 6 is masked
    cannot_end = ScriptedGrammar({4, 6})
    out = _run([_state(cannot_end, stop_token_ids=[6])])
    assert torch.isfinite(out.scores[0]).tolist() == [i == 4 for i in range(8)]
    assert not cannot_end.stop_ids_are_text
    # where it may end (EOS allowed) the stop id is allowed at its model logit
    out = _run([_state(ScriptedGrammar({EOS, 4}), stop_token_ids=[6])])
    assert out.scores[0, 6] == 6.0 and out.scores[0, EOS] == 0.0
    # its only token is the stop id, where it cannot end: the grammar wins, it is text
    only = ScriptedGrammar({6})
    out = _run([_state(only, stop_token_ids=[6])])
    assert out.scores[0, 6] == 6.0 and only.stop_ids_are_text


def test_no_row_is_ever_left_without_a_finite_logit():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        allowed = {
            int(t)
            for t in torch.randint(
                0, 8, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen
            )
        }
        stops = [int(t) for t in torch.randint(1, 8, (2,), generator=gen)]
        grammar = ScriptedGrammar(allowed) if bool(torch.rand(1, generator=gen) < 0.7) else None
        bias = {int(torch.randint(0, 8, (1,), generator=gen)): -100.0}
        st = _state(grammar, min_tokens=3, max_tokens=5, stop_token_ids=stops, logit_bias=bias)
        row = _run([st]).scores[0]
        assert torch.isfinite(row).any(), (allowed, stops, grammar)
        if grammar is not None:  # the grammar's mask holds; where it may end, stop ids are ends
            ends = set(stops) if EOS in allowed else set()
            assert {i for i in range(8) if row[i] > NEG_INF} <= allowed | ends


def test_allowed_ids_yield_to_the_grammar_and_bad_words_to_allowed_ids():
    out = _run([_state(ScriptedGrammar({2, 3}), allowed_token_ids=[3, 5])])
    assert torch.isfinite(out.scores[0]).tolist() == [i == 3 for i in range(8)]
    out = _run([_state(ScriptedGrammar({2}), allowed_token_ids=[5])])  # disjoint: grammar wins
    assert torch.isfinite(out.scores[0]).tolist() == [i == 2 for i in range(8)]
    st = _state(allowed_token_ids=[4], output=[6])
    st.sampling_params.bad_words_token_ids = [[4], [6, 7]]
    out = _run([st])  # banning 4 would empty the row: the earlier allowed_token_ids stands
    assert torch.isfinite(out.scores[0]).tolist() == [i == 4 for i in range(8)]
    st = _state(output=[1, 6])
    st.sampling_params.bad_words_token_ids = [[4], [6, 7], [1, 7], [9]]
    out = _run([st])  # 4 (one token) and 7 (after 6) banned; [1, 7] does not end the output
    assert torch.isinf(out.scores[0]).tolist() == [i in (4, 7) for i in range(8)]


def _reference_row(row: torch.Tensor, st: SamplingState) -> None:
    """The formulas one row at a time, in the declared order (min_tokens, bias, CTRL, OpenAI)."""
    p, vocab = st.sampling_params, row.shape[0]
    if len(st.output_token_ids) < p.min_tokens:
        for t in (*st.eos_token_ids, *p.stop_token_ids):
            row[t] = NEG_INF
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    for t in set(st.prompt_token_ids) | set(st.output_token_ids):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    counts = torch.bincount(
        torch.tensor(list(st.output_token_ids), dtype=torch.int64), minlength=vocab
    )
    row -= counts.float() * p.frequency_penalty + (counts > 0).float() * p.presence_penalty


def test_batched_steps_equal_the_per_row_formulas_bitwise():
    gen = torch.Generator().manual_seed(1)
    vocab, batch = 300, 12

    def draw(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    for _ in range(10):
        logits = torch.randn(batch, vocab, generator=gen) * 5
        states = []
        for _ in range(batch):
            u = torch.rand(4, generator=gen).tolist()
            params = SamplingParams(
                repetition_penalty=u[0] + 0.5,
                frequency_penalty=u[1] * 2 - 1,
                presence_penalty=u[2] - 0.5,
                logit_bias={draw(1)[0]: 7.5},
                min_tokens=3,
                max_tokens=9,
                stop_token_ids=draw(1),
            )
            out = draw(int(u[3] * 6))
            states.append(SamplingState(params, draw(20), out, None, frozenset({EOS})))
        ref = logits.clone()
        for i, st in enumerate(states):
            _reference_row(ref[i], st)
        assert torch.equal(LogitsPipeline()(logits, states).scores, ref)


def test_logprobs_are_read_after_the_grammar_before_the_rest():
    st = _state(ScriptedGrammar({2, 3}), logit_bias={2: 50.0}, logprobs=2)
    out = _run([st])
    assert out.logprob_logits[0].tolist() == [NEG_INF, NEG_INF, 2.0, 3.0] + [NEG_INF] * 4
    assert out.scores[0, 2] == 52.0


# -- on the real tiny model ---------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(aidreams_path):
    return LLM(aidreams_path, num_kv_blocks=128)


def _one(llm, prompt="Tell me", **kw):
    return llm.generate([prompt], SamplingParams(temperature=0.0, **kw))[0].outputs[0]


def _json_biased_stop(llm, token: int):
    """A greedy answer of up to 30 tokens constrained to ``SCHEMA``, with ``token`` a stop id
    biased by +100 (so the model takes it wherever the grammar lets it)."""
    return _one(
        llm,
        max_tokens=30,
        stop_token_ids=[token],
        logit_bias={token: 100},
        structured_outputs=SO(json=SCHEMA),
    )


def test_min_tokens_with_a_complete_grammar_ends_there(llm, pool_whole):
    """Was: every logit -inf, id 0 sampled, the request failed (a 500 at the gateway)."""
    eos = next(iter(llm.engine.eos_token_ids))
    out = _one(llm, max_tokens=20, min_tokens=5, structured_outputs=SO(choice=["x"]))
    assert out.text == "x" and out.finish_reason == "stop" and out.token_ids[-1] == eos
    out = _one(llm, max_tokens=40, min_tokens=30, structured_outputs=SO(json=SCHEMA))
    assert out.finish_reason == "stop" and len(out.token_ids) < 30
    jsonschema.validate(json.loads(out.text), SCHEMA)
    pool_whole(llm)


def test_min_tokens_still_holds_while_the_grammar_may_go_on(llm, pool_whole):
    eos = next(iter(llm.engine.eos_token_ids))
    p = {"max_tokens": 20, "min_tokens": 5, "logit_bias": {eos: 100}}
    out = _one(llm, structured_outputs=SO(regex="a+"), **p)
    assert re.fullmatch("a+", out.text) and out.finish_reason == "stop"
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    pool_whole(llm)


def test_stop_ids_cannot_cut_a_constrained_answer(llm, pool_whole):
    """Was: a stop id the grammar allows as text ended a JSON answer mid-object with "stop"."""
    free = _one(llm, max_tokens=30, structured_outputs=SO(json=SCHEMA))
    jsonschema.validate(json.loads(free.text), SCHEMA)
    for mid in free.token_ids[1:-2]:  # every token of the answer but its first and last
        out = _json_biased_stop(llm, mid)
        assert out.finish_reason == "stop", (mid, out)
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert mid not in out.token_ids[:-1] or mid in free.token_ids[:1]
    pool_whole(llm)


def test_a_stop_id_the_grammar_needs_as_text_is_text(llm, pool_whole):
    """``{`` (one token) opens every JSON answer: as a stop id it is the grammar's text there."""
    brace = _one(llm, max_tokens=30, structured_outputs=SO(json=SCHEMA)).token_ids[0]
    out = _one(llm, max_tokens=30, stop_token_ids=[brace], structured_outputs=SO(json=SCHEMA))
    assert out.finish_reason == "stop" and out.text.startswith("{")
    jsonschema.validate(json.loads(out.text), SCHEMA)
    # where the grammar may end, it is a stop id again (biased so the model takes it)
    out = _json_biased_stop(llm, brace)
    assert out.finish_reason == "stop" and out.token_ids[-1] == brace
    jsonschema.validate(json.loads(out.text), SCHEMA)
    pool_whole(llm)


def test_logit_bias_cannot_unmask_a_forbidden_token(llm, pool_whole):
    z = llm.engine.tokenizer.encode("z", add_special_tokens=False)[-1]
    for seed in range(4):
        params = SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=10,
            logit_bias={z: 100},
            structured_outputs=SO(choice=["x", "yy"]),
        )
        out = llm.generate(["Pick"], params)[0].outputs[0]
        assert out.text in ("x", "yy") and out.finish_reason == "stop" and z not in out.token_ids
    pool_whole(llm)


def test_stop_strings_apply_only_after_min_tokens(llm, pool_whole):
    """vLLM's semantics: a stop string ending in the first ``min_tokens`` tokens' text is
    text; the next one after them ends the request. Sampling is unchanged (greedy ids are a
    prefix of the free run's)."""
    free = _one(llm, max_tokens=20, ignore_eos=True)
    stop = "a"
    assert (
        _one(llm, max_tokens=20, ignore_eos=True, stop=[stop]).text
        == free.text[: free.text.index(stop)]
    )
    head = _one(llm, max_tokens=3, ignore_eos=True).text  # the first 3 tokens' text
    assert stop in head and stop in free.text[len(head) :], (head, free.text)
    out = _one(llm, max_tokens=20, ignore_eos=True, stop=[stop], min_tokens=3)
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop, len(head))]
    assert len(out.token_ids) > 3 and out.token_ids == free.token_ids[: len(out.token_ids)]
    pool_whole(llm)


def test_allowed_token_ids_and_bad_words(llm, pool_whole):
    free = _one(llm, max_tokens=12, ignore_eos=True)
    allowed = sorted(set(free.token_ids[1:4]))
    out = _one(llm, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed)
    # a bad word: none of its token sequences appears in the output
    word = free.text.split()[1]
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[word])
    prep = llm.engine.prepare_request(EngineRequest("probe", "Tell me", p))
    seqs = prep.sampling_params.bad_words_token_ids
    assert seqs and all(seq for seq in seqs)
    out = _one(llm, max_tokens=12, ignore_eos=True, bad_words=[word])
    ids = out.token_ids
    for seq in seqs:
        n = len(seq)
        assert all(ids[k : k + n] != seq for k in range(len(ids))), (seq, ids)
    assert ids != free.token_ids
    # allowed ids the grammar forbids: the grammar wins (no row is left empty)
    z = llm.engine.tokenizer.encode("z", add_special_tokens=False)[-1]
    out = _one(llm, max_tokens=10, allowed_token_ids=[z], structured_outputs=SO(choice=["x", "yy"]))
    assert out.text in ("x", "yy") and out.finish_reason == "stop"
    pool_whole(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"allowed_token_ids": [True]},
        {"allowed_token_ids": "1"},
        {"bad_words": [""]},
        {"bad_words": [" "]},
        {"bad_words": "word"},
        {"bad_words": [3]},
    ],
)
def test_bad_allowed_ids_and_bad_words_refused(kwargs):
    with pytest.raises((ValueError, TypeError), match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_allowed_ids_outside_the_vocabulary_refused(llm, pool_whole):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        _one(llm, allowed_token_ids=[1, 10**6])
    pool_whole(llm)


def test_rules_hold_under_preemption(aidreams_path, pool_whole):
    """So few KV blocks that requests are preempted and recomputed: constrained outputs with
    min_tokens, stop ids and logit_bias equal those of an ample cache and validate."""
    prompts = ["Tell me a story about the sea"] * 10
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=40,
            min_tokens=i,
            stop_token_ids=[455],
            logit_bias={455: 5},
            structured_outputs=SO(json=SCHEMA),
        )
        for i in range(6)
    ] + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4
    ample = LLM(aidreams_path, block_size=16, num_kv_blocks=256, max_num_seqs=16)
    want = [o.outputs[0] for o in ample.generate(prompts, params)]
    small = LLM(aidreams_path, block_size=16, num_kv_blocks=10, max_num_seqs=16)
    got = [o.outputs[0] for o in small.generate(prompts, params)]
    assert small.stats()["num_preemptions"] > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for c in got[:6]:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    pool_whole(small)
    pool_whole(ample)
