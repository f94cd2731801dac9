"""The finish rate behind the seat wait (``load_model.FinishRate``): requests finished per step
second over a window of recent steps, not a per-step mean that collapses between the bursts in
which a batch admitted together finishes (that mean told a full engine a 33 s wait for a seat
that freed in 0.5 s, and the TTFT budget's Retry-After with it)."""

from __future__ import annotations

import pytest
from prefixgate.engine.load_model import (
    FINISH_WINDOW_MAX_S,
    FINISH_WINDOW_MIN,
    FINISH_WINDOW_S,
    FinishRate,
    estimate_ttft,
)

STEP_S = 0.03


class _ClockedScheduler:
    """A real ``Scheduler`` (block size 16) on a fake clock: ``now[0]`` is what its
    ``time.monotonic()`` answers; requests of 3 prompt tokens decode token 9 until
    ``max_tokens``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, max_num_seqs: int, num_blocks: int):
        from prefixgate.engine import scheduler as sched_module
        from prefixgate.engine.config import EngineConfig
        from prefixgate.engine.kv_cache_manager import KVCacheManager

        self.now = [100.0]
        monkeypatch.setattr(sched_module.time, "monotonic", lambda: self.now[0])
        self.config = EngineConfig(block_size=16, max_num_seqs=max_num_seqs)
        kv = KVCacheManager.from_config(self.config, num_blocks)
        self.sched = sched_module.Scheduler(self.config, kv, 4096)

    def add(self, request_id: str, max_tokens: int, ignore_eos: bool = True) -> None:
        from prefixgate.engine.request import Request
        from prefixgate.engine.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.sched.add_request(
            Request(request_id, [5, 6, 7], sp, eos_token_ids=[2], max_tokens=max_tokens)
        )

    def step(self, seconds: float = 0.0) -> None:
        """One engine step taking ``seconds`` of the fake clock."""
        out = self.sched.schedule()
        self.now[0] += seconds
        self.sched.update_from_output(
            out, {s.request.request_id: 9 for s in out.scheduled if s.samples}
        )


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


def test_the_rate_counts_the_gaps_between_steps(monkeypatch):
    # Through ``prefixgate serve`` the engine thread's steps leave gaps (its loop, the
    # gateway's own work on the same cores): a rate over model time alone drained the seat
    # wait faster than real time and returning clients met their budget again. Each step
    # here takes 10 ms of model time after a 30 ms gap: the rate is over the 40 ms.
    clocked = _ClockedScheduler(monkeypatch, max_num_seqs=4, num_blocks=64)
    sched = clocked.sched
    for i in range(400):  # one new request a step, each of 4 steps: 1 finish a step
        clocked.add(f"r{i}", max_tokens=4)
        clocked.step(0.010)
        clocked.now[0] += 0.030
    assert sched.load.finished_per_s == pytest.approx(1 / 0.040, rel=0.05)
    while sched.has_unfinished_requests():  # an idle engine's time is not counted
        clocked.step()
    clocked.now[0] += 3600.0
    clocked.add("r10000", max_tokens=4)
    for _ in range(4):
        clocked.step(0.010)
    assert sched.load.finished_per_s > 1 / 0.1


def test_the_nth_free_seat_of_seats_freeing_at_their_times():
    from prefixgate.engine.load_model import nth_free_seat

    assert [nth_free_seat([0.1, 0.3], 1.0, n) for n in range(4)] == pytest.approx(
        [0.1, 0.3, 1.1, 1.3]
    )
    # a seat held longer than one service: the other seat serves twice meanwhile
    assert [nth_free_seat([0.0, 2.5], 1.0, n) for n in range(6)] == pytest.approx(
        [0.0, 1.0, 2.0, 2.5, 3.0, 3.5]
    )
    for bad in (([], 1.0, 0), ([0.1], 0.0, 0), ([0.1], 1.0, -1)):
        with pytest.raises(ValueError):
            nth_free_seat(*bad)


def test_the_seat_wait_falls_with_every_step_not_only_when_a_batch_finishes(monkeypatch):
    # A batch admitted together finishes together: the fluid wait (ahead / finished_per_s)
    # stayed put between such finishes, and returning clients told it met their TTFT budget
    # again and again, 50-60 ms at a time (2x overload through ``prefixgate serve``). The
    # seat schedule (the running requests' own tokens left) falls with each step.
    clocked = _ClockedScheduler(monkeypatch, max_num_seqs=4, num_blocks=256)
    sched, config = clocked.sched, clocked.config
    ids = iter(range(10**6))

    def add() -> None:
        clocked.add(f"r{next(ids)}", max_tokens=8)

    def step() -> None:
        clocked.step(0.010)

    for _ in range(12):  # batches of 4 admitted together, 8 steps each
        for _ in range(4):
            add()
        for _ in range(8):
            step()
    stats = sched.stats()
    assert stats["seat_service_s"] == pytest.approx(8 * 0.010)
    for _ in range(8):  # 4 running, 4 waiting
        add()
    step()
    waits, fluid = [], []
    for _ in range(6):
        stats = sched.stats()
        assert stats["seat_free_s"] == sorted(stats["seat_free_s"])
        waits.append(sched.predict_ttft(3))
        fluid.append(
            estimate_ttft({**stats, "seat_free_s": None}, 4, config.max_num_batched_tokens, 3)
        )
        step()
    falls = [a - b for a, b in zip(waits, waits[1:], strict=False)]
    # about one step (10 ms) less each step (the finish rate's service ages a little)
    assert all(0.008 < f <= 0.010 + 1e-9 for f in falls), falls
    assert fluid[-1] >= fluid[0]  # the fluid wait did not fall (it rose as finishes aged)
    # the new request is behind 4 waiting: it takes a seat a whole service (8 steps) after
    # the running batch ends (7 of its 8 steps left when the first wait was read), then its
    # first token's own step (4 decodes at 400 tokens/s)
    assert waits[0] == pytest.approx(7 * 0.010 + 8 * 0.010 + 0.010, abs=0.005)
    while sched.has_unfinished_requests():
        step()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_request_past_the_mean_output_is_not_about_to_end(monkeypatch):
    # A new-user pass (sim runner, 2 seats): after 16-token requests, both seats held by
    # 1,000-token decodes (EOS possible), and a 50 ms budget was admitted on a predicted 16 ms
    # and waited 5 s: each runner's tokens left was the mean output less its own, at least
    # one, so a runner past the mean was one step from its end forever. Past the mean, its
    # length so far is the sign: about as long again (bounded by max_tokens).
    clocked = _ClockedScheduler(monkeypatch, max_num_seqs=2, num_blocks=256)
    sched = clocked.sched
    for i in range(8):  # the mean output: 16 tokens
        clocked.add(f"short{i}", max_tokens=16, ignore_eos=False)
    while sched.has_unfinished_requests():
        clocked.step(0.010)
    clocked.add("long0", max_tokens=1000, ignore_eos=False)
    clocked.add("long1", max_tokens=1000, ignore_eos=False)
    for _ in range(100):
        clocked.step(0.010)
    free = sched.stats()["seat_free_s"]
    assert free is not None and len(free) == 2
    # 100 tokens done of up to 1,000: about 100 more steps of 10 ms, not one
    assert all(0.9 <= f <= 1.1 for f in free), free
    assert sched.predict_ttft(3) >= 0.9
    # before the mean it is the mean's rest, as before: 8 tokens done of a 16 mean
    sched.abort_requests(["long0", "long1"])
    clocked.add("short-again", max_tokens=1000, ignore_eos=False)
    for _ in range(8):
        clocked.step(0.010)
    free = sched.stats()["seat_free_s"]
    assert free == [pytest.approx(8 * 0.010, abs=0.002)], free
    sched.abort_requests(["short-again"])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_request_past_the_short_outputs_is_expected_to_run_as_the_long_ones_did(monkeypatch):
    # A helper's case (serve --runner sim): 1,200-token answers after 32-token ones had their
    # seats predicted ~9 s early. With two kinds of answer, the mean output (about half way)
    # says nothing of a request that has run past the short kind: it is one of the long kind.
    # Its rest is the mean rest of the finished requests that ran longer than it has.
    clocked = _ClockedScheduler(monkeypatch, max_num_seqs=2, num_blocks=512)
    sched = clocked.sched
    for i in range(8):  # short answers of 16 tokens and long ones of 400, interleaved
        clocked.add(f"s{i}", max_tokens=16, ignore_eos=False)
        clocked.add(f"l{i}", max_tokens=400, ignore_eos=False)
        while sched.has_unfinished_requests():
            clocked.step(0.010)
    assert 16 < sched.load.mean_output_tokens < 400
    clocked.add("run", max_tokens=1000, ignore_eos=False)
    for _ in range(40):  # 40 tokens: past every short answer
        clocked.step(0.010)
    (free,) = sched.stats()["seat_free_s"]
    # 360 tokens left of the long kind's 400, ~3.6 s of 10 ms steps (the mean's rest said
    # about half of that)
    assert free == pytest.approx(360 * 0.010, rel=0.05), free
    for _ in range(8):  # 48 tokens: still 352 to go
        clocked.step(0.010)
    (free,) = sched.stats()["seat_free_s"]
    assert free == pytest.approx(352 * 0.010, rel=0.05), free
    sched.abort_requests(["run"])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_request_past_the_mean_of_few_long_outputs_is_not_about_to_end(monkeypatch):
    # A helper's pass (serve --runner sim, docs/admission.md "A running request's rest"): two
    # 1,000-token answers after many short ones, then two more. Fewer than OUTPUT_REST_MIN
    # finished requests ran longer than the running ones, so the mean's rest applied: the
    # EWMA mean (lifted by the two long ones, then lowered by short ones) less the tokens
    # sampled, a few tokens before the mean; a 50 ms budget was admitted on a predicted 75 ms
    # and waited 7.5 s. The few that ran longer lift that rest to theirs.
    clocked = _ClockedScheduler(monkeypatch, max_num_seqs=2, num_blocks=512)
    sched = clocked.sched

    def run(prefix: str, n: int, max_tokens: int) -> None:
        for i in range(n):
            clocked.add(f"{prefix}{i}", max_tokens=max_tokens, ignore_eos=False)
            while sched.has_unfinished_requests():
                clocked.step(0.010)

    run("s", 8, 16)
    run("l", 2, 400)  # two long answers: fewer than OUTPUT_REST_MIN
    run("t", 4, 16)
    mean = sched.load.mean_output_tokens
    assert 40 < mean < 400
    clocked.add("run", max_tokens=1000, ignore_eos=False)
    for _ in range(40):  # 40 tokens sampled, short of the mean
        clocked.step(0.010)
    (free,) = sched.stats()["seat_free_s"]
    # 360 tokens left of the long ones' 400, ~3.6 s of 10 ms steps (the mean's rest said
    # mean - 40 tokens, ~0.3 s)
    assert free == pytest.approx(360 * 0.010, rel=0.05), (free, mean)
    for _ in range(400):  # past every finished answer: as many again as it has sampled
        clocked.step(0.010)
    (free,) = sched.stats()["seat_free_s"]
    assert free == pytest.approx(440 * 0.010, rel=0.05), free
    sched.abort_requests(["run"])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_running_requests_end_is_not_known_from_fewer_than_four_finished_requests(
    monkeypatch,
):
    # A helper's pass (serve --runner sim, 4 seats): right after one 8-token
    # warm-up request, requests arriving while requests of max_tokens 400 held every seat were
    # predicted first tokens of 304-1,841 ms that came at 1.2-3.2 s; the one finished request
    # was the whole history (its mean rest, then "as many again"), and those misses then set
    # the miss margin to ~2.6 s. Fewer than OUTPUT_REST_MIN finished requests say nothing of
    # a running request's output: its end is not known, and a wait for its seat is not told.
    from prefixgate.engine.load_model import OUTPUT_REST_MIN

    clocked = _ClockedScheduler(monkeypatch, max_num_seqs=2, num_blocks=512)
    sched, config = clocked.sched, clocked.config
    clocked.add("warm", max_tokens=8, ignore_eos=False)
    while sched.has_unfinished_requests():
        clocked.step(0.010)
    clocked.add("long0", max_tokens=400, ignore_eos=False)
    clocked.add("long1", max_tokens=400, ignore_eos=False)
    for _ in range(20):
        clocked.step(0.010)
    stats = sched.stats()
    assert stats["seat_free_s"] == [None, None]
    # 380 steps of 10 ms away: no wait is told for a seat, not ~0.2 s
    assert sched.predict_ttft(3) is None
    # a free seat needs no end: its first token is known
    free_seat = {**stats, "num_running": 1, "seat_free_s": [None]}
    assert estimate_ttft(free_seat, 2, config.max_num_batched_tokens, 3) is not None
    # an ignore_eos request's end is its bound, known whatever the history
    clocked.add("bounded", max_tokens=100, ignore_eos=True)
    sched.abort_requests(["long1"])
    clocked.step(0.010)
    free = sched.stats()["seat_free_s"]
    assert free[1] is None and free[0] == pytest.approx(99 * 0.010, rel=0.05), free
    sched.abort_requests(["long0", "bounded"])
    # OUTPUT_REST_MIN finished requests: the rests are estimated again
    for i in range(OUTPUT_REST_MIN - 1):
        clocked.add(f"more{i}", max_tokens=8, ignore_eos=False)
        while sched.has_unfinished_requests():
            clocked.step(0.010)
    clocked.add("long2", max_tokens=400, ignore_eos=False)
    clocked.add("long3", max_tokens=400, ignore_eos=False)
    clocked.step(0.010)
    free = sched.stats()["seat_free_s"]
    assert None not in free and sched.predict_ttft(3) is not None
    sched.abort_requests(["long2", "long3"])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_output_lengths_residual_is_the_mean_rest_over_the_longer_ones_and_their_count():
    from prefixgate.engine.load_model import OUTPUT_WINDOW, OutputLengths

    lengths = OutputLengths()
    assert lengths.residual(0) == (None, 0) and len(lengths) == 0  # nothing finished
    for n in (10, 20, 30, 40, 50):
        lengths.add(n)
    assert len(lengths) == 5
    assert lengths.residual(0) == (pytest.approx(30), 5)
    assert lengths.residual(10) == (pytest.approx(35 - 10), 4)  # 20..50, mean 35
    assert lengths.residual(19) == (pytest.approx(35 - 19), 4)
    assert lengths.residual(20) == (pytest.approx(40 - 20), 3)  # 30..50, mean 40
    assert lengths.residual(50) == (None, 0)  # none longer
    for _ in range(OUTPUT_WINDOW):  # the window forgets the old lengths
        lengths.add(7)
    assert len(lengths) == OUTPUT_WINDOW
    assert lengths.residual(0) == (pytest.approx(7), OUTPUT_WINDOW)
    assert lengths.residual(7) == (None, 0)


def test_the_step_time_is_a_plain_mean_over_its_window():
    from prefixgate.engine.load_model import STEP_WINDOW_S, StepTime

    steps = StepTime()
    assert steps.mean_s() is None
    for i in range(int(4 * STEP_WINDOW_S / 0.01)):  # 1 prefill step of 50 ms in 10
        steps.add(0.050 if i % 10 == 0 else 0.005)
    assert steps.mean_s() == pytest.approx((0.050 + 9 * 0.005) / 10, rel=0.02)
    assert steps._seconds <= STEP_WINDOW_S + 0.05  # bounded by the window
    steps.add(30.0)  # a step longer than the window: the window holds it alone
    assert steps.mean_s() == pytest.approx(30.0)


def test_the_step_time_follows_a_slowdown_at_once():
    # Under a flood of 429s the gateway takes the engine thread's cores and steps slow
    # within a second; the 8 s mean alone lagged (first tokens 0.15 s later than predicted
    # at the median in the first seconds of a 4x flood).
    from prefixgate.engine.load_model import STEP_RECENT_S, STEP_WINDOW_S, StepTime

    steps = StepTime()
    for _ in range(int(STEP_WINDOW_S / 0.005)):
        steps.add(0.005)
    for _ in range(int(STEP_RECENT_S / 0.015) + 1):  # slower for the last second
        steps.add(0.015)
    assert steps.near_s() == pytest.approx(0.015)  # the steps just ahead
    assert steps.mean_s() < 0.008  # the window's: later services
    for _ in range(int(STEP_RECENT_S / 0.005) + 1):  # fast again: the window's mean holds
        steps.add(0.005)
    assert steps.near_s() == steps.mean_s() and 0.005 < steps.mean_s() < 0.015


def test_a_seat_is_held_at_least_as_long_as_finished_requests_sat(monkeypatch):
    # The service is the longer of the mean output's steps and the time finished requests
    # really sat; never the finish rate, which after a quiet spell of one request at a time
    # counted one busy seat of eight (a burst was told 34 s for about 6 s of work).
    clocked = _ClockedScheduler(monkeypatch, max_num_seqs=8, num_blocks=64)
    sched = clocked.sched
    for i in range(3):  # one at a time, 8 steps of 10 ms, then 5 s of nothing
        clocked.add(f"r{i}", max_tokens=8)
        while sched.has_unfinished_requests():
            clocked.step(0.010)
        clocked.now[0] += 5.0
    stats = sched.stats()
    assert stats["finished_per_s"] == pytest.approx(1 / 0.080)  # one seat of eight busy
    assert stats["seat_service_s"] == pytest.approx(0.080)  # what a seat is really held
    for i in range(16):  # a burst: 8 seated, 8 waiting behind them
        clocked.add(f"b{i}", max_tokens=8)
    clocked.step(0.010)
    # a new request, behind the 8 waiting, gets a seat when the first of them ends: 7 steps
    # left, then a service (0.15 s), then its first step (8 decodes at the 100 tokens/s
    # measured one at a time: 0.08 s); the fluid wait at the quiet finish rate: 0.72 s
    got = sched.predict_ttft(3)
    assert got == pytest.approx(0.07 + 0.08 + 0.08, abs=1e-6)
    while sched.has_unfinished_requests():
        clocked.step()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
