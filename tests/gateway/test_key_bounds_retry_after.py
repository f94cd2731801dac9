"""A key over several of its limits at once: the 429 names each one and states the longest
wait of them (a client told only the first bound's wait came back to meet the next), and
nothing is taken from the limits that passed."""

from __future__ import annotations

import pytest
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.tenancy.keys import KeySpec, Principal


def test_concurrency_and_requests_per_minute_state_the_longer_wait():
    p = Principal(KeySpec(key="sk-a", name="a", max_concurrent=1, requests_per_minute=1))
    first = p.acquire(10)  # takes the slot and the minute's one request
    with pytest.raises(APIError) as e:
        p.acquire(10)
    err = e.value
    assert err.status == 429
    assert "max_concurrent=1" in err.message and "1 requests per minute" in err.message
    # the slot's estimate is about a second (no hold time measured yet); the bucket's next
    # request is 60 s away at 1 per minute: the longer one is stated
    assert 59.0 <= err.retry_after <= 60.0
    first.settle(10, 1)


def test_a_bucket_that_passed_gives_back_what_it_gave_when_another_refuses():
    p = Principal(KeySpec(key="sk-b", name="b", requests_per_minute=100, tokens_per_minute=600))
    rpm, tpm = p._rpm, p._tpm
    assert rpm is not None and tpm is not None
    charge = p.acquire(600)  # the minute's tokens, all of them
    requests_left = rpm.level
    with pytest.raises(APIError) as e:
        p.acquire(300)  # rpm passes, tpm refuses: 300 tokens at 10 per second
    assert "600 tokens per minute" in e.value.message
    assert "requests per minute" not in e.value.message
    assert 29.0 <= e.value.retry_after <= 30.0  # the exact time until 300 tokens are back
    assert rpm.level == pytest.approx(requests_left, abs=0.01)  # its request given back
    charge.refund()


def test_tokens_given_back_when_concurrency_refuses():
    p = Principal(KeySpec(key="sk-c", name="c", max_concurrent=1, tokens_per_minute=6000))
    tpm = p._tpm
    assert tpm is not None
    held = p.acquire(100)
    level = tpm.level
    with pytest.raises(APIError) as e:
        p.acquire(100)  # the bucket passes, the slot refuses
    assert "max_concurrent=1" in e.value.message and "tokens per minute" not in e.value.message
    assert tpm.level == pytest.approx(level, abs=1.0)  # (1.0: refill in between)
    held.settle(100, 1)


def test_a_holder_that_knows_its_progress_says_when_it_ends():
    # the hold time learned from the last request (8 s) against a holder that says it ends in
    # 2 s (its tokens left over its own token rate): the holder's word is stated, so a machine
    # that sped up since is followed; a holder that cannot tell yet falls back to the hold time
    from prefixgate.gateway.tenancy.slot_wait import SlotClock

    now = [50.0]
    clock = SlotClock(clock=lambda: now[0])
    t = clock.take()
    now[0] += 8.0
    clock.give(t)  # hold time 8 s
    held = clock.take()
    now[0] += 1.0
    assert clock.wait(1) == 7.0  # 8 s hold - 1 s held
    eta: list[float | None] = [None]
    clock.set_eta(held, lambda: eta[0])
    assert clock.wait(1) == 7.0  # cannot tell yet: the hold time
    eta[0] = 2.5
    assert clock.wait(1) == 2.5
    other = clock.take()  # a second holder, no progress known: 8 s
    assert clock.wait(1) == 2.5 and clock.wait(2) == 8.0
    clock.give(held)  # held 1 s: the hold time becomes 0.7 * 8 + 0.3 * 1 = 5.9 s
    clock.set_eta(held, lambda: 0.0)  # given back: no-op
    assert clock.wait(1) == pytest.approx(5.9)
    clock.give(other)


def test_a_generation_predicts_its_end_from_its_token_rate():
    # Exchange.eta_s: tokens left over the measured rate, the slowest choice; None before
    # ETA_MIN_TOKENS; capped by the engine's max_model_len
    from types import SimpleNamespace

    from prefixgate.engine.outputs import CompletionOutput
    from prefixgate.engine.protocol import EngineRequest
    from prefixgate.engine.sampling_params import SamplingParams
    from prefixgate.gateway.local.exchange import Exchange
    from prefixgate.gateway.local.serving import LOCAL

    ex = Exchange.__new__(Exchange)
    ex.request = {LOCAL: SimpleNamespace(engine=SimpleNamespace(max_model_len=1000))}
    ex.request = SimpleNamespace(app=ex.request)
    ex.prompt_ids = [1] * 10
    ex.requests = [
        EngineRequest("a", [1] * 10, SamplingParams(max_tokens=101)),
        EngineRequest("b", [1] * 10, SamplingParams(max_tokens=5000)),
    ]
    ex.outputs = [CompletionOutput(), CompletionOutput()]
    ex.t_first_tokens = [0.0, 0.0]
    ex.st = SimpleNamespace(admission=SimpleNamespace(tpot_s=0.0))
    assert ex.eta_s() is None  # nothing measured
    ex.st.admission.tpot_s = 0.01  # too young to measure: the recent generations' rate
    got = ex.eta_s()
    assert got is not None and abs(got - 990 * 0.01) < 1e-6
    ex.st.admission.tpot_s = 0.0
    import time

    t = time.monotonic()
    ex.outputs[0].token_ids[:], ex.t_first_tokens[0] = [7] * 11, t - 1.0  # 10 tokens/s
    ex.outputs[1].token_ids[:], ex.t_first_tokens[1] = [7] * 21, t - 1.0  # 20 tokens/s
    got = ex.eta_s()
    # choice 0: 90 left at 10/s = 9 s; choice 1: capped at 1000 - 10 = 990, 969 left at 20/s
    assert got is not None and 48.0 <= got <= 48.6
