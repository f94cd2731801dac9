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
