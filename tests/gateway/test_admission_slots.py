"""Admission slots (``admission_slots.SlotSchedule``): the times at which requests refused on
their TTFT budget are admitted, one slot per request's work, none overlapping, and a tenant's
own slots at its own measured pace (a fair scheduler serves a tenant over its share later)."""

from __future__ import annotations

import pytest
from prefixgate.gateway.tenancy.admission_slots import SlotSchedule


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_slots_follow_one_another_and_fill_the_gaps():
    clock = Clock()
    s = SlotSchedule(clock=clock)
    assert s.place("a", 1.0, 0.25) == pytest.approx(1.0)  # from its earliest
    assert s.place("b", 1.0, 0.25) == pytest.approx(1.25)  # after a's slot
    assert s.place("c", 0.0, 0.25) == pytest.approx(0.0)  # a gap before them fits
    assert s.place("d", 0.1, 0.25) == pytest.approx(0.25)  # after c's, in the gap
    assert s.place("e", -3.0, 0.6) == pytest.approx(1.5)  # no gap of 0.6 before the last
    assert s.place("f", -3.0, 0.1) == pytest.approx(0.5)  # never before now; a gap fits
    assert len(s) == 6
    clock.t += 1.3  # the slots that ended are forgotten
    assert len(s) == 2


def test_a_tenant_s_own_slots_are_spaced_at_its_own_pace():
    clock = Clock()
    s = SlotSchedule(tau_s=5.0, min_departures=5.0, clock=clock)
    assert s.tenant_rate("heavy") is None and s.own_wait_s("heavy", 10) is None
    for _ in range(50):  # 2 departures a second for 25 s
        s.departed("heavy")
        clock.t += 0.5
    rate = s.tenant_rate("heavy")
    assert rate == pytest.approx(2.0, rel=0.1)
    assert s.own_wait_s("heavy", 4) == pytest.approx(4 / rate)
    first = s.place("heavy", 0.0, 0.05, 1 / rate)
    second = s.place("heavy", 0.0, 0.05, 1 / rate)
    assert second - first == pytest.approx(1 / rate)  # its own pace, not the queue's
    assert s.place("light", 0.0, 0.05) == pytest.approx(first + 0.05)  # others fill the gap
    assert s.tenant_rate("light") is None  # too few departures to tell a pace


def test_a_rate_decays_when_the_tenant_stops():
    clock = Clock()
    s = SlotSchedule(tau_s=1.0, min_departures=2.0, clock=clock)
    for _ in range(10):
        s.departed("t")
        clock.t += 0.1
    assert s.tenant_rate("t") is not None
    clock.t += 10.0
    assert s.tenant_rate("t") is None
