"""A queued request holds its seat for its own size where that is known and shorter than the
mean service (``LoadModel.seat_schedule``'s ``waiting_seat_s`` / ``seat_after_waiting_s``,
``estimate_ttft``'s ``queued_holds_s``): short requests queued behind long running ones were
costed at the long answers' mean seat time, and their Retry-After overstated by seconds
(docs/admission.md "A queued request's own size")."""

from __future__ import annotations

import heapq
import random

import pytest
from prefixgate.engine.load_model import (
    estimate_ttft,
    nth_free_seat,
    own_hold_s,
    seat_queue,
    seats_after,
)

from tests.engine.test_finish_rate import _ClockedScheduler

STEP = 0.010


def _long_mean_then_two_long_runners(monkeypatch: pytest.MonkeyPatch) -> _ClockedScheduler:
    """2 seats; four 200-token answers make the mean service 2 s (200 steps of 10 ms); then
    two 1,000-token answers run 100 steps (900 left: ~9 s)."""
    clocked = _ClockedScheduler(monkeypatch, max_num_seqs=2, num_blocks=512)
    for i in range(4):
        clocked.add(f"mean{i}", max_tokens=200)
    while clocked.sched.has_unfinished_requests():
        clocked.step(STEP)
    clocked.add("long0", max_tokens=1000)
    clocked.add("long1", max_tokens=1000)
    for _ in range(100):
        clocked.step(STEP)
    return clocked


def test_short_requests_queued_behind_long_ones_are_costed_by_their_own_size(monkeypatch):
    clocked = _long_mean_then_two_long_runners(monkeypatch)
    sched = clocked.sched
    for i in range(6):  # six short requests wait: 8 tokens each, 80 ms of seat
        clocked.add(f"short{i}", max_tokens=8)
    stats = sched.stats()
    assert stats["seat_service_s"] == pytest.approx(2.0, rel=0.02)
    free = stats["seat_free_s"]
    assert free == [pytest.approx(9.0, rel=0.02)] * 2
    # each short one takes the first free seat and holds it 80 ms: three rounds on two seats
    starts = stats["waiting_seat_s"]
    assert starts == pytest.approx(
        [free[0], free[1], free[0] + 0.08, free[1] + 0.08, free[0] + 0.16, free[1] + 0.16], abs=1e-9
    )
    assert stats["seat_after_waiting_s"] == pytest.approx([free[0] + 0.24, free[1] + 0.24])
    # a newcomer behind them: a seat at ~9.24 s, not 9 + 3 x 2 s (the mean service)
    got = sched.predict_ttft(3)
    assert got == pytest.approx(free[0] + 0.24, abs=0.05), got
    mean_costed = nth_free_seat(free, stats["seat_service_s"], 6)
    assert mean_costed == pytest.approx(15.0, rel=0.02)
    assert got < mean_costed - 5.0
    # a view of fewer waiting (a departure among them): the seat that one takes
    ahead = {**stats, "num_waiting": 3}
    assert estimate_ttft(ahead, 2, clocked.config.max_num_batched_tokens, 3) == pytest.approx(
        free[1] + 0.08 + 2 / stats["decode_tokens_per_s"], abs=1e-6
    )
    sched.abort_requests(["long0", "long1"] + [f"short{i}" for i in range(6)])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_queued_requests_of_unknown_or_long_size_keep_the_mean_service(monkeypatch):
    clocked = _long_mean_then_two_long_runners(monkeypatch)
    sched = clocked.sched
    for i in range(6):  # no shorter than the mean: the mean service, as before
        clocked.add(f"big{i}", max_tokens=500)
    stats = sched.stats()
    assert stats["waiting_seat_s"] is None and stats["seat_after_waiting_s"] is None
    seat = nth_free_seat(stats["seat_free_s"], stats["seat_service_s"], 6)
    assert sched.predict_ttft(3) == pytest.approx(seat + 2 / stats["decode_tokens_per_s"])
    sched.abort_requests(["long0", "long1"] + [f"big{i}" for i in range(6)])


def test_a_caller_known_size_holds_its_seat_that_long(monkeypatch):
    # the gateway's requests not in the engine yet (``queued_holds_s``): one 8-token request
    # queued ahead of a newcomer adds its own 80 ms, not the mean's 2 s
    clocked = _long_mean_then_two_long_runners(monkeypatch)
    stats = clocked.sched.stats()
    budget = clocked.config.max_num_batched_tokens
    hold = own_hold_s(stats, budget, 3, 8)
    assert hold == pytest.approx(8 * STEP, rel=0.02)
    base = estimate_ttft({**stats, "num_waiting": 0}, 2, budget, 3)
    # two queued ahead, one a seat each when the runners end at ~9 s
    own = estimate_ttft({**stats, "num_waiting": 2}, 2, budget, 3, queued_holds_s=[hold] * 2)
    mean = estimate_ttft({**stats, "num_waiting": 2}, 2, budget, 3)
    assert base is not None and own is not None and mean is not None
    assert mean - base == pytest.approx(2.0, rel=0.02)  # before: the mean service
    assert own - base == pytest.approx(hold, rel=1e-6)
    # behind two of unknown size (the mean service) and two own-sized ones: those are seated
    # last, when the first two free their seats at ~11 s
    mixed = estimate_ttft({**stats, "num_waiting": 4}, 2, budget, 3, queued_holds_s=[hold] * 2)
    assert mixed == pytest.approx(mean + hold, rel=1e-6)
    assert own_hold_s(stats, budget, 3, None) is None
    with pytest.raises(ValueError, match="max_tokens"):
        own_hold_s(stats, budget, 3, 0)
    clocked.sched.abort_requests(["long0", "long1"])


def _heap_seats_after(free: list[float], service: float, n: int) -> list[float]:
    heap = list(free)
    heapq.heapify(heap)
    for _ in range(n):
        heapq.heapreplace(heap, heap[0] + service)
    return sorted(heap)


@pytest.mark.parametrize("seed", range(20))
def test_seats_after_is_the_queue_seated_one_by_one(seed):
    rng = random.Random(seed)
    free = [round(rng.uniform(0, 3), rng.choice([1, 6])) for _ in range(rng.randint(1, 8))]
    service = rng.choice([0.5, 1.0, 0.3])
    n = rng.randint(0, 40)
    assert seats_after(free, service, n) == pytest.approx(_heap_seats_after(free, service, n))
    # the same queue, every hold the mean service: the old seat
    starts, after = seat_queue(free, [service] * n)
    if n:
        assert starts[-1] == pytest.approx(nth_free_seat(free, service, n - 1))
    assert after == pytest.approx(_heap_seats_after(free, service, n))


def test_seated_stats_with_every_hold_the_mean_give_the_mean_seat():
    free, service = [0.7, 2.5], 1.0
    stats = {
        "prefill_tokens_per_s": 1000.0,
        "decode_tokens_per_s": 100.0,
        "num_running": 2,
        "queued_prefill_tokens": 0,
        "num_waiting": 7,
        "seat_free_s": free,
        "seat_service_s": service,
    }
    plain = estimate_ttft(stats, 2, 64, 3)
    starts, after = seat_queue(free, [service] * 4)
    seated = {**stats, "waiting_seat_s": starts, "seat_after_waiting_s": after}
    assert estimate_ttft(seated, 2, 64, 3) == pytest.approx(plain)
    for n in range(7):
        a = estimate_ttft({**stats, "num_waiting": n}, 2, 64, 3)
        b = estimate_ttft({**seated, "num_waiting": n}, 2, 64, 3)
        assert a == pytest.approx(b), n
    for lam in (0.1, 0.5):
        a = estimate_ttft(stats, 2, 64, 3, overtake_per_s=lam)
        b = estimate_ttft(seated, 2, 64, 3, overtake_per_s=lam)
        assert a == pytest.approx(b), lam
