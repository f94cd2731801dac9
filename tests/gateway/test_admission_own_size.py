"""A budget refusal's admission slot by the refused request's own size (``admit(...,
max_tokens=)``, ``EngineWait.extra_s(..., max_tokens=)``, ``_departure_s(..., own_s)``): short
requests refused behind long answers had their slots spaced at the long answers' mean seat
time, and 20 clients with 50 ms budgets were admitted up to 12.5 s after the server went idle
where ~0.7 s of work cleared them (docs/admission.md "A queued request's own
size")."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prefixgate.engine.load_model import estimate_ttft, seat_queue
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.tenancy.admission import AdmissionConfig, AdmissionController
from prefixgate.gateway.tenancy.admission_slots import SlotSchedule
from prefixgate.gateway.tenancy.admission_wait import EngineWait, Promises

SEQS, BUDGET_TOKENS = 2, 2048
STEP_S = 0.01  # a step's busy wall time
END_S = 5.0  # both seats' long answers end then
SERVICE_S = 5.0  # the recent mean seat time: long answers'


class LongAnswersEngine:
    """Two seats held by long answers ending together at ``END_S``; the recent mean seat time
    ``SERVICE_S`` (long answers'); 10 ms steps; ``waiting`` queued of unknown size."""

    def __init__(self, waiting: int = 0) -> None:
        self.waiting = waiting

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": SEQS,
            "num_waiting": self.waiting,
            "queued_prefill_tokens": 100 * self.waiting,
            "prefill_tokens_per_s": 10_000.0,
            "decode_tokens_per_s": SEQS / STEP_S,
            "finished_per_s": SEQS / SERVICE_S,
            "seat_free_s": [END_S] * SEQS,
            "seat_service_s": SERVICE_S,
            "seat_step_s": STEP_S,
            "waiting_seat_s": None,
            "seat_after_waiting_s": None,
        }

    def predict_ttft(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float | None:
        return estimate_ttft(self.stats(), SEQS, BUDGET_TOKENS, num_prompt_tokens)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ctl(engine: LongAnswersEngine, clock: Clock) -> AdmissionController:
    ctl = AdmissionController(AdmissionConfig(), concurrency=SEQS)
    ctl.wait = EngineWait(engine, SEQS, BUDGET_TOKENS)  # type: ignore[arg-type]
    ctl.promises = Promises(clock=clock)
    ctl.budget_slots = SlotSchedule(clock=clock)
    ctl._service = SERVICE_S  # first token to end, recent requests: the long answers
    return ctl


def _refusals(n: int, max_tokens: int | None, budget: float = 0.05) -> tuple[list[float], Any]:
    clock = Clock()
    engine = LongAnswersEngine()
    ctl = _ctl(engine, clock)
    waits = []
    for k in range(n):
        with pytest.raises(APIError) as exc:
            ctl.admit(
                100, tenant=f"t{k}", fingerprint=f"r{k}", budget_s=budget, max_tokens=max_tokens
            )
        assert exc.value.code == "ttft_budget_exceeded"
        waits.append(exc.value.retry_after)
    return waits, (clock, ctl)


def test_short_refusals_behind_long_answers_are_spaced_by_their_own_size():
    # 20 refusals of 8 tokens each (80 ms of seat) on a 50 ms budget, behind two long answers
    # ending at 5 s: their slots are a departure of their own size apart (80 ms over two
    # seats), not of the long answers' mean (5 s over two seats: 47.5 s for the twenty)
    n, max_tokens, budget = 20, 8, 0.05
    waits, (clock, ctl) = _refusals(n, max_tokens, budget)
    own = max_tokens * STEP_S
    steps = [b - a for a, b in zip(waits, waits[1:], strict=False)]
    assert min(steps) >= own / SEQS * 0.99, steps  # at least a departure of its size
    assert waits[-1] - waits[0] <= (n - 1) * own / SEQS * 1.05, waits
    # each comes back when told, into its slot, and takes the next seat the short ones free:
    # its first token within its budget
    starts, _ = seat_queue([END_S] * SEQS, [own] * n)
    t0 = clock.t
    for k, wait in enumerate(waits):
        clock.t = t0 + wait
        ctl.admit(100, tenant=f"t{k}", fingerprint=f"r{k}", budget_s=budget).done()
        ttft = max(0.0, starts[k] - wait) + STEP_S  # the seat, then its first token's step
        assert ttft <= budget + 0.01, (k, wait, ttft)


@pytest.mark.parametrize("max_tokens", [None, 1000])
def test_a_refusal_of_unknown_or_long_size_keeps_the_mean_spacing(max_tokens):
    waits, _ = _refusals(4, max_tokens)
    steps = [b - a for a, b in zip(waits, waits[1:], strict=False)]
    assert steps == [pytest.approx(SERVICE_S / SEQS, rel=0.01)] * 3, steps


def test_extra_work_of_known_size_adds_its_own_seat_time():
    # behind two waiting requests of unknown size (the mean: seats at 5 s, then 10 s), two
    # more of 8 tokens add their 80 ms, not the mean's 5 s
    wait = EngineWait(LongAnswersEngine(waiting=2), SEQS, BUDGET_TOKENS)  # type: ignore[arg-type]
    assert wait.extra_s(2, 200, 100) == pytest.approx(SERVICE_S, rel=1e-6)
    assert wait.extra_s(2, 200, 100, max_tokens=8) == pytest.approx(8 * STEP_S, rel=1e-6)
    assert wait.extra_s(2, 200, 100, max_tokens=10_000) == pytest.approx(SERVICE_S, rel=1e-6)
    assert wait.own_hold_s(100, 8) == pytest.approx(8 * STEP_S)
    assert wait.own_hold_s(100, None) is None


@pytest.mark.parametrize(
    ("bad", "error"),
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("8", TypeError)],
)
def test_a_malformed_max_tokens_is_refused(bad, error):
    ctl = AdmissionController(AdmissionConfig())
    with pytest.raises(error, match="max_tokens"):
        ctl.admit(100, max_tokens=bad)
    assert ctl.queued_requests == 0


def test_proxy_mode_takes_max_tokens_and_keeps_working():
    ctl = AdmissionController(AdmissionConfig())  # no engine: proxy mode
    ctl.admit(100, max_tokens=8, budget_s=0.05).done()
    ctl.admit(100, max_tokens=None).done()
    assert ctl.queued_requests == 0 and ctl.in_flight == 0


def _record_admits(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    seen: list[int | None] = []
    admit = AdmissionController.admit

    def recording(self: AdmissionController, *args: Any, **kw: Any) -> Any:
        seen.append(kw.get("max_tokens"))
        return admit(self, *args, **kw)

    monkeypatch.setattr(AdmissionController, "admit", recording)
    return seen


def test_the_body_max_tokens_reaches_admission_in_both_modes(serve_fake, gw, monkeypatch):
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings

    seen = _record_admits(monkeypatch)
    srv, _ = serve_fake()
    messages = {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with gw.client(srv) as c:
        assert c.post("/v1/chat/completions", json=gw.chat_body(max_tokens=7)).status_code == 200
        body = gw.chat_body(max_completion_tokens=6)
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert c.post("/v1/messages", json=messages).status_code == 200
    assert seen == [7, 6, 5]
    settings = GatewaySettings(health_interval_s=60)
    seen.clear()
    with BackgroundServer(lambda: create_proxy_app([srv.url], settings)) as proxy:
        with gw.client(proxy) as c:
            r = c.post("/v1/chat/completions", json=gw.chat_body(max_tokens=7))
            assert r.status_code == 200, r.text
            body = gw.chat_body()
            body.pop("max_tokens", None)
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            assert c.post("/v1/messages", json=messages).status_code == 200
    # each call: the proxy's admission, then its upstream's (local mode: without a bound in
    # the body, what the context leaves)
    assert seen[0::2] == [7, None, 5], seen
    assert seen[1] == 7 and seen[3] is not None and seen[3] > 7 and seen[5] == 5, seen


def _draining(ctl: AdmissionController, per_s: float) -> None:
    """``ctl``'s measured drain rate ``per_s`` departures a second, warm."""
    ctl._rate, ctl._busy, ctl._last = per_s, 1e6, time.monotonic()
    ctl._min_departures = 1.0


@pytest.mark.parametrize("warm", [False, True])
def test_the_queue_bounds_wait_costs_queued_requests_by_their_own_size(warm):
    # 16 queued requests of 8 tokens (80 ms of seat each) behind two long answers: the
    # departures past the first two (the seats the long answers free, at the recent service
    # time) take the seats the short ones free, 80 ms each, not the long answers' 5 s
    clock = Clock()
    ctl = AdmissionController(AdmissionConfig(max_queued_requests=16), concurrency=SEQS)
    ctl.wait = EngineWait(LongAnswersEngine(), SEQS, BUDGET_TOKENS)  # type: ignore[arg-type]
    ctl.promises = Promises(clock=clock)
    ctl._service = SERVICE_S
    if warm:
        _draining(ctl, 1000.0)  # a fast measured drain: the seats' pace is the floor
    own = 8 * STEP_S
    held = [ctl.admit(100, max_tokens=8) for _ in range(16)]
    assert ctl._queued_unsized == 0 and ctl._queued_hold_s == pytest.approx(16 * own)
    waits = []
    for k in range(4):
        with pytest.raises(APIError) as exc:
            ctl.admit(100, fingerprint=f"late{k}", max_tokens=8)
        assert exc.value.code == "server_overloaded"
        waits.append(exc.value.retry_after)
    if warm:  # n departures: the first two at the service time, the rest at the queue's size
        for k, wait in enumerate(waits):  # the k-th refusal waits for k + 1 departures
            n = k + 1
            first = min(n, SEQS)
            # the k places promised before it (of unknown size) count at the service time
            pace = (16 * own + k * SERVICE_S) / (16 + k)
            expect = (first * SERVICE_S + (n - first) * pace) / SEQS
            assert wait == pytest.approx(expect, rel=1e-3), (k, waits)
        assert waits[-1] < 4 * SERVICE_S / SEQS - 3.0  # 10 s before, the mean for all four
    # the whole queue: 2 x 5 s + 14 x 80 ms over two seats, not 16 x 5 s over two (the cap)
    assert ctl.retry_after() == pytest.approx((2 * SERVICE_S + 14 * own) / SEQS, rel=1e-6)
    for ticket in held:
        ticket.done()
    assert ctl._queued_unsized == 0 and ctl._queued_hold_s == 0.0


def test_the_queue_bounds_wait_keeps_the_mean_where_a_queued_size_is_unknown():
    ctl = AdmissionController(AdmissionConfig(max_queued_requests=16), concurrency=SEQS)
    ctl.wait = EngineWait(LongAnswersEngine(), SEQS, BUDGET_TOKENS)  # type: ignore[arg-type]
    ctl._service = SERVICE_S
    held = [ctl.admit(100, max_tokens=8) for _ in range(15)] + [ctl.admit(100)]
    assert ctl._queued_unsized == 1
    assert ctl.retry_after() == pytest.approx(min(60.0, 16 * SERVICE_S / SEQS))
    for ticket in held:
        ticket.done()
    assert ctl._queued_unsized == 0 and ctl._queued_hold_s == 0.0
