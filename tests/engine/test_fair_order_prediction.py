"""The first-token prediction under the ``fair`` scheduler's order: a tenant running more than
its seat share (a flood) has its waiting requests served after the other tenants' new ones,
which take the seats that free first (and displace its running ones). A prediction that
assumed first come first served admitted a flooding tenant's requests whose first tokens came
after their budget (docs/sim.md, "6 December 2026, late night"); with the others' arrival
rate (``overtake_per_s``) its seat is the first one left to it."""

from __future__ import annotations

import math

import pytest
from prefixgate.engine.load_model import (
    ARRIVAL_TAU_S,
    ArrivalRates,
    LoadModel,
    estimate_ttft,
    nth_free_seat,
    nth_free_seat_overtaken,
)


def test_a_seat_left_after_the_others_take_theirs_first():
    # without overtakes it is the n-th free seat
    for free, service in (([0.1, 0.3], 1.0), ([0.0, 2.5], 1.0)):
        for n in range(6):
            assert nth_free_seat_overtaken(free, service, n, 0.0) == pytest.approx(
                nth_free_seat(free, service, n)
            )
    # seats free at 1 and 2 s, then every 10 s; others arrive at 0.1/s: at 1 s the one freed
    # seat goes to the 0.1 others due by then (the first free time t with k >= 0 + 0.1 t,
    # k = 0 at 1 s: no), the second at 2 s is left to it (1 >= 0.2)
    assert nth_free_seat_overtaken([1.0, 2.0], 10.0, 0, 0.1) == pytest.approx(2.0)
    # the 2nd of the queue: seats freed at 1, 2, 11, 12: k = 2 at 11 s (2 >= 1 + 1.1: no),
    # k = 3 at 12 s (3 >= 1 + 1.2: yes)
    assert nth_free_seat_overtaken([1.0, 2.0], 10.0, 1, 0.1) == pytest.approx(12.0)
    # the others arrive faster than seats free (0.2/s): no seat is ever left to it
    assert math.isinf(nth_free_seat_overtaken([1.0, 2.0], 10.0, 0, 1.0))
    bad_args = (
        ([], 1.0, 0, 0.0),
        ([0.1], 0.0, 0, 0.0),
        ([0.1], 1.0, -1, 0.0),
        ([0.1], 1.0, 0, -1.0),
    )
    for bad in bad_args:
        with pytest.raises(ValueError):
            nth_free_seat_overtaken(*bad)


def test_the_others_arrivals_delay_the_seat_of_a_tenant_served_after_them():
    # 8 seats taken, 4 waiting: 5 seats to free at 4 a second (the fluid form)
    stats = {
        "num_running": 8,
        "num_waiting": 4,
        "queued_prefill_tokens": 400,
        "prefill_tokens_per_s": 10_000.0,
        "decode_tokens_per_s": 100.0,
        "finished_per_s": 4.0,
    }
    fcfs = estimate_ttft(stats, 8, 2048, 100)
    assert fcfs == pytest.approx(5 / 4.0 + 0.08)
    # others arriving at 2/s take half of the seats first
    assert estimate_ttft(stats, 8, 2048, 100, overtake_per_s=2.0) == pytest.approx(5 / 2.0 + 0.08)
    assert math.isinf(estimate_ttft(stats, 8, 2048, 100, overtake_per_s=4.0))
    # the seat schedule's form: seats free at 0.1 s and 0.2 s, then every second, the rest later
    sched = {
        **stats,
        "num_waiting": 0,
        "queued_prefill_tokens": 0,
        "seat_free_s": [0.1, 0.2] + [5.0] * 6,
        "seat_service_s": 1.0,
    }
    assert estimate_ttft(sched, 8, 2048, 100) == pytest.approx(0.1 + 0.08)
    # others at 5/s: k >= 5 t first holds at 0.2 s (k = 1)
    assert estimate_ttft(sched, 8, 2048, 100, overtake_per_s=5.0) == pytest.approx(0.2 + 0.08)
    # others at 20/s: 0.1 s (k = 0 < 2) and 0.2 s (1 < 4) go to them, then 1.1 s (2 < 22) ...
    # six seats at 5 s: k = 2..7 < 100; none until the others' rate falls behind
    assert estimate_ttft(sched, 8, 2048, 100, overtake_per_s=20.0) > 5.0


def test_arrival_rates_sum_over_tenants():
    rates = ArrivalRates()
    for i in range(40):
        rates.add("heavy" if i % 4 else "a", 10.0 + 0.05 * i)
    now = 12.0
    total, heavy, a = rates.per_s(now), rates.per_s(now, "heavy"), rates.per_s(now, "a")
    assert total == pytest.approx(heavy + a)
    assert heavy == pytest.approx(3 * a, rel=0.1)
    assert rates.per_s(now, "nobody") == 0.0
    model = LoadModel()
    model.arrivals = rates
    assert model.overtake_per_s({"heavy": 5.0}, now) == {"heavy": pytest.approx(a)}
    # two tenants over their shares: the one of the lower counter goes before the other
    assert model.overtake_per_s({"heavy": 5.0, "a": 1.0}, now) == {
        "heavy": pytest.approx(a),
        "a": pytest.approx(0.0),
    }
    assert model.overtake_per_s({}, now) == {}
    # a rate decays with the time constant
    assert rates.per_s(now + ARRIVAL_TAU_S, "a") == pytest.approx(a / math.e)


def _scheduler(monkeypatch: pytest.MonkeyPatch, policy: str):
    from prefixgate.engine import scheduler as sched_module
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.kv_cache_manager import KVCacheManager

    now = [100.0]
    monkeypatch.setattr(sched_module.time, "monotonic", lambda: now[0])
    config = EngineConfig(block_size=16, max_num_seqs=4, scheduling_policy=policy)
    kv = KVCacheManager.from_config(config, 256)
    return sched_module.Scheduler(config, kv, 4096)


def _add(sched, rid: str, tenant: str) -> None:
    from prefixgate.engine.request import Request
    from prefixgate.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sched.add_request(Request(rid, [5, 6, 7], sp, eos_token_ids=[2], max_tokens=8, tenant=tenant))


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_the_scheduler_names_a_tenant_over_its_seat_share_and_the_others_arrivals(
    monkeypatch, policy
):
    sched = _scheduler(monkeypatch, policy)
    for i in range(4):
        _add(sched, f"h{i}", "heavy")
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: 9 for s in out.scheduled if s.samples})
    assert sched.load_stats()["overtake_per_s"] == {}  # one tenant: nobody to be fair to
    _add(sched, "a0", "a")
    _add(sched, "h4", "heavy")
    got = sched.load_stats()["overtake_per_s"]
    if policy == "fcfs":
        assert got == {}  # first come first served: nobody goes before an earlier arrival
    else:
        # two tenants: heavy's share is 2 seats of 4 and it holds 4; a's one arrival so far
        assert got == {"heavy": pytest.approx(1.0 / ARRIVAL_TAU_S)}
    assert sched.stats()["overtake_per_s"] == got
