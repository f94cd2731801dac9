"""Admission slots: the times at which requests refused on their TTFT budget are admitted.

A request refused because its predicted first token is past its budget is told to come back
at a *slot*: a time reserved for it in a departure order, one slot per departure of the
engine's queue. When it comes back at its slot it is admitted into it; it does not compete
again with the requests refused before or after it. So the ``Retry-After`` it was told is the
time of its admission, not a guess that the work ahead will have drained by then.

Two paces set the slots (``SlotSchedule.place``):

* the queue's: one request's slot is the time its work adds to the queue's predicted first
  tokens, and at least ``requests / drain rate`` (the admission queue's measured departures
  per second; ``AdmissionController._slot_lengths``), and slots do not overlap, so the slots
  admit no faster than the queue empties, even behind running requests that end together;
* the tenant's: a fair scheduler (``engine/scheduling_policy.py``) serves a tenant over its
  share later than the queue's pace. A tenant's own slots are spaced by its own measured
  departures (``requests / tenant rate``), and its first slot waits until its own queued
  requests would be within the budget at that rate (``own_wait_s``).

Figures: docs/sim.md, "6 December 2026, night: admission slots".
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Hashable


class SlotSchedule:
    """Reserved admission slots (monotonic seconds) and each tenant's measured departures.

    Args:
        tau_s: the time constant of each tenant's departure-rate EWMA (seconds).
        min_departures: a tenant's rate counts once its EWMA holds this many departures.
        clock: monotonic seconds (None: ``time.monotonic``, read at each call).
    """

    def __init__(
        self,
        tau_s: float = 5.0,
        min_departures: float = 5.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._tau = tau_s
        self._min = min_departures
        self._clock = clock if clock is not None else _monotonic
        self._starts: list[float] = []  # reserved slots, sorted by start; no two overlap
        self._ends: list[float] = []
        self._tail: dict[Hashable, float] = {}  # tenant -> end of its last slot (own pace)
        self._rate: dict[Hashable, tuple[float, float, float]] = {}  # (ewma, last, first)
        self._departures = 0

    def departed(self, tenant: Hashable, requests: int = 1) -> None:
        """``requests`` of ``tenant`` left the queue now (their first token)."""
        now = self._clock()
        got = self._rate.get(tenant)
        if got is None:
            rate, first = 0.0, now
        else:
            rate = got[0] * math.exp(-(now - got[1]) / self._tau)
            first = got[2]
        self._rate[tenant] = (rate + requests / self._tau, now, first)
        self._departures += 1
        if self._departures % 4096 == 0:
            self._prune(now)

    def tenant_rate(self, tenant: Hashable) -> float | None:
        """``tenant``'s departures per second (EWMA, bias-corrected for its age as the
        admission queue's drain rate is), or None while it holds fewer than
        ``min_departures``."""
        got = self._rate.get(tenant)
        if got is None:
            return None
        now = self._clock()
        rate = got[0] * math.exp(-(now - got[1]) / self._tau)
        if rate * self._tau < self._min:
            return None
        warm = 1.0 - math.exp(-max(now - got[2], 1.0) / self._tau)
        return rate / warm

    def own_wait_s(self, tenant: Hashable, queued: int) -> float | None:
        """Seconds until ``tenant``'s ``queued`` requests have left the queue at its own
        pace, or None while its pace is not measured."""
        rate = self.tenant_rate(tenant)
        return None if rate is None else queued / rate

    def place(
        self,
        tenant: Hashable,
        earliest_s: float,
        slot_s: float,
        own_slot_s: float = 0.0,
        horizon_s: float = math.inf,
    ) -> float:
        """Reserve the first free slot ``slot_s`` seconds long from ``earliest_s`` from now on,
        and after ``tenant``'s last slot (each of its slots ``own_slot_s`` long at its own
        pace); returns the seconds from now to its start. A slot starting later than
        ``horizon_s`` from now (past what a client is told to wait) is not reserved: its start
        is returned all the same."""
        now = self._clock()
        self._drop_past(now)
        t = max(now + max(0.0, earliest_s), self._tail.get(tenant, -math.inf))
        i = bisect.bisect_right(self._ends, t)
        while i < len(self._starts) and self._starts[i] < t + slot_s:
            t = max(t, self._ends[i])
            i += 1
        if t - now > horizon_s:
            return t - now
        self._starts.insert(i, t)
        self._ends.insert(i, t + slot_s)
        self._tail[tenant] = t + max(slot_s, own_slot_s)
        return t - now

    def __len__(self) -> int:
        self._drop_past(self._clock())
        return len(self._starts)

    def _drop_past(self, now: float) -> None:
        k = bisect.bisect_right(self._ends, now)
        if k:
            del self._starts[:k]
            del self._ends[:k]

    def _prune(self, now: float) -> None:
        """Forget tenants whose rate has decayed away and whose slots are past."""
        for tenant, (rate, last, _) in list(self._rate.items()):
            if rate * math.exp(-(now - last) / self._tau) * self._tau < 0.01:
                del self._rate[tenant]
        for tenant, end in list(self._tail.items()):
            if end < now:
                del self._tail[tenant]


def _monotonic() -> float:
    return time.monotonic()
