"""The finish rate behind the seat wait (``scheduler.FinishRate``): requests finished per step
second over a window of recent steps, not a per-step mean that collapses between the bursts in
which a batch admitted together finishes (that mean told a full engine a 33 s wait for a seat
that freed in 0.5 s, and the TTFT budget's Retry-After with it)."""

from __future__ import annotations

import pytest
from prefixgate.engine.scheduler import (
    FINISH_WINDOW_MAX_S,
    FINISH_WINDOW_MIN,
    FINISH_WINDOW_S,
    FinishRate,
    estimate_ttft,
)

STEP_S = 0.03


def _bursts(rate: FinishRate, cycles: int, quiet_steps: int = 31, burst: int = 8) -> float:
    """``cycles`` of ``quiet_steps`` finish-free steps then one that finishes ``burst``
    requests (8 seats admitted together, 32 tokens each); returns the true rate."""
    for _ in range(cycles):
        for _ in range(quiet_steps):
            rate.add(STEP_S, 0)
        rate.add(STEP_S, burst)
    return burst / ((quiet_steps + 1) * STEP_S)


def test_none_before_the_first_finish():
    rate = FinishRate()
    assert rate.per_s() is None
    for _ in range(100):
        rate.add(STEP_S, 0)
    assert rate.per_s() is None
    rate.add(STEP_S, 1)
    assert rate.per_s() == pytest.approx(1 / (101 * STEP_S))


@pytest.mark.parametrize("quiet_after", [0, 15, 31])
def test_bursty_finishes_keep_their_rate_between_bursts(quiet_after):
    rate = FinishRate()
    true = _bursts(rate, cycles=12)
    for _ in range(quiet_after):  # the finish-free steps of the next cycle
        rate.add(STEP_S, 0)
    # a per-step mean with weight 0.2 would read 0.8**31 = 0.1 % of the rate here
    assert rate.per_s() == pytest.approx(true, rel=0.2)
    # and the seat wait it gives a full engine stays a fraction of a second
    stats = {
        "prefill_tokens_per_s": 2000.0,
        "decode_tokens_per_s": 8 / STEP_S,
        "num_running": 8,
        "num_waiting": 8,
        "queued_prefill_tokens": 80,
        "finished_per_s": rate.per_s(),
    }
    assert estimate_ttft(stats, 8, 512, 10) < 1.25 * 9 / true + 0.1


def test_the_window_follows_a_change_of_rate():
    rate = FinishRate()
    _bursts(rate, cycles=40, burst=8)  # 29.6/s for about 38 s of steps
    slow = _bursts(rate, cycles=int(FINISH_WINDOW_MAX_S / 0.96) + 2, burst=2)  # then 2.1/s
    assert rate.per_s() == pytest.approx(slow, rel=0.2)


def test_the_window_spans_its_seconds_and_finishes():
    rate = FinishRate()
    for _ in range(int(3 * FINISH_WINDOW_MAX_S / STEP_S)):
        rate.add(STEP_S, 1)  # one finish a step: the seconds bound the window
    assert rate._seconds == pytest.approx(FINISH_WINDOW_S, abs=2 * STEP_S)
    assert rate.per_s() == pytest.approx(1 / STEP_S)
    rate = FinishRate()
    for _ in range(int(3 * FINISH_WINDOW_MAX_S / STEP_S)):
        rate.add(STEP_S, 0)
    rate.add(STEP_S, 1)
    assert rate._seconds <= FINISH_WINDOW_MAX_S + STEP_S  # bounded between rare finishes
    assert rate._finished < FINISH_WINDOW_MIN
    assert rate.per_s() == pytest.approx(1 / rate._seconds, rel=0.01)
