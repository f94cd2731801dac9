"""Anticipation: a short wait for a light tenant's next request before a step it would miss.

A client that sends its requests one after another (a chat user, an agent loop) is idle for a
moment after each response: its next request is on its way. A work-conserving loop starts the
next step at once, so under a flood that request always lands just after a heavy step began and
waits almost a whole step for it ("deceptive idleness": Iyer & Druschel, *Anticipatory
scheduling: a disk scheduling framework to overcome deceptive idleness in synchronous I/O*,
SOSP 2001). The remedy is theirs: when the tenant whose request just ended has, by its measured
**think time** (its last request's end → its next request's arrival, in the engine), usually
come back quickly, the loop waits up to about that long before a step that holds only other
tenants' work; a request arriving meanwhile runs in the next step (under ``fair`` alone:
``FairPolicy.hold_back``).

Bounds: one wait per finished request, at most ``max_wait_s`` (``EngineConfig.
fair_anticipation_ms``), and only when the tenant has come back within ``max_wait_s`` in most
of its recent requests (the median of its last :data:`THINK_TIMES` think times); a tenant
that stops coming back quickly stops being waited for after a few requests. The scheduling
policy says who may be waited for (``SchedulingPolicy.anticipates``: ``fair`` only, for a
tenant that would get a seat and whose waiting would hold back an over-share tenant).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

THINK_TIMES = 8
"""Recent think times kept per tenant (the median of these decides)."""

MIN_THINK_TIMES = 3
"""Think times a tenant must have shown before it is waited for."""

WINDOW_OF_MEDIAN = 2.0
"""A wait lasts up to this many times the tenant's median think time, plus
:data:`WINDOW_SLACK_S` (at most ``max_wait_s``)."""

WINDOW_SLACK_S = 0.002
"""Added to a window so that a tenant whose think time is a fraction of a millisecond (in
process) is not missed by its jitter (seconds)."""


@dataclass(slots=True)
class ThinkTime:
    """One tenant's recent think times (seconds) and its pending wait.

    Attributes:
        gaps: its last :data:`THINK_TIMES` think times, oldest first.
        idle_since: monotonic time its last request in the engine ended (None: it has a
            request in the engine, or never had one).
        waited: a wait was started for it since ``idle_since`` (counted once).
        window: its wait's length (:meth:`Anticipation.window`), computed when a think time
            is added (the loop asks every step).
    """

    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=THINK_TIMES))
    idle_since: float | None = None
    waited: bool = False
    window: float | None = None  # Anticipation.window's value, set when ``gaps`` change


class Anticipation:
    """Per-tenant think times and the deadline of the loop's next wait.

    Args:
        max_wait_s: the longest wait after one finished request (seconds, >= 0; 0: off).

    Raises:
        ValueError: ``max_wait_s`` < 0.
    """

    def __init__(self, max_wait_s: float) -> None:
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_wait_s = float(max_wait_s)
        self.tenants: dict[str, ThinkTime] = {}
        self.num_waits = 0  # waits started (one per finished request at most)
        self.num_hits = 0  # waits that the tenant's next request ended
        self.wait_s = 0.0  # time the loop spent waiting (seconds)

    def on_arrival(self, tenant: str, now: float) -> None:
        """A request of ``tenant`` reaches the engine at ``now`` (monotonic seconds)."""
        st = self.tenants.get(tenant)
        if st is None or st.idle_since is None:
            return
        st.gaps.append(max(0.0, now - st.idle_since))
        st.window = self._window(st)
        if st.waited:
            self.num_hits += 1
        st.idle_since, st.waited = None, False

    def on_idle(self, tenant: str, now: float) -> None:
        """``tenant``'s last request in the engine ended at ``now``: its think time starts."""
        if self.max_wait_s <= 0:
            return
        st = self.tenants.get(tenant)
        if st is None:
            st = self.tenants[tenant] = ThinkTime()
        st.idle_since, st.waited = now, False

    def window(self, tenant: str) -> float | None:
        """How long after its request ended ``tenant`` is waited for (seconds): ``min(
        max_wait_s, WINDOW_OF_MEDIAN x median think time + WINDOW_SLACK_S)``; None when it has shown fewer
        than :data:`MIN_THINK_TIMES` think times or their median exceeds ``max_wait_s``."""
        st = self.tenants.get(tenant)
        return None if st is None else st.window

    def _window(self, st: ThinkTime) -> float | None:
        if len(st.gaps) < MIN_THINK_TIMES or self.max_wait_s <= 0:
            return None
        median = statistics.median(st.gaps)
        if median > self.max_wait_s:
            return None
        return min(self.max_wait_s, WINDOW_OF_MEDIAN * median + WINDOW_SLACK_S)

    def deadline(self, now: float, eligible: Callable[[str], bool]) -> float | None:
        """The latest monotonic time to wait until for an idle tenant that ``eligible``
        accepts, or None when there is none (or every window has passed). Counts a wait the
        first time a tenant's window is returned."""
        best: float | None = None
        for tenant, st in self.tenants.items():
            if st.idle_since is None:
                continue
            w = st.window
            if w is None or now >= st.idle_since + w or not eligible(tenant):
                continue
            end = st.idle_since + w
            if not st.waited:
                st.waited = True
                self.num_waits += 1
            best = end if best is None else max(best, end)
        return best

    def note_waited(self, seconds: float) -> None:
        """The loop waited ``seconds`` (counted in ``wait_s``)."""
        self.wait_s += max(0.0, seconds)

    def stats(self) -> dict[str, float | int]:
        """``anticipation_waits``, ``anticipation_hits`` (counts) and ``anticipation_wait_s``."""
        return {
            "anticipation_waits": self.num_waits,
            "anticipation_hits": self.num_hits,
            "anticipation_wait_s": round(self.wait_s, 6),
        }
