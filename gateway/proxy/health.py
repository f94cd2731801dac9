"""Upstream health, after Envoy's outlier detection and active health checks: the knobs
(``settings.HealthPolicy``, with the other options) and one upstream's state machine
(``UpstreamHealth``).

Two signals, kept apart (``docs/proxy-health.md`` has the timeline):

* **Passive (outlier detection)**: every attempt of a client request is a success or a
  *gateway failure* (Envoy's ``consecutive_gateway_failure``: a refused, reset or timed-out
  connection, a 502/503/504, an answer cut mid-body, an answer that is not the route's
  shape). ``consecutive_failures`` failures in a row eject the upstream for
  ``base_ejection_s`` × (its number of ejections), at most ``max_ejection_s``; one failure
  fails only its own request. An ejection that would leave more than
  ``max_ejection_percent`` of the pool out of rotation (ejected or down) is not made: the
  last healthy upstreams are never all ejected by their answers (the active checks decide
  for them).
* **Active (health checks)**: every ``interval_s`` each upstream is sent ``GET /health``
  with a ``timeout_s`` timeout; an answer below 500 passes (a server without ``/health``
  answers 404: alive), a 5xx, a refused connection or no answer in time fails.
  ``unhealthy_threshold`` failed checks in a row mark it down (a frozen or silent upstream
  is caught in about ``unhealthy_threshold`` × (``interval_s`` + ``timeout_s``));
  ``healthy_threshold`` passed checks in a row bring a down upstream back.

Coming back is half-open either way: an ejected upstream is checked once its ejection time
is over and, on a pass, returns with ``consecutive_failures - 1`` failures counted, so one
more failure ejects it again (for longer); a success clears the count. The ejection
multiplier decays by one for every ``base_ejection_s`` spent in rotation without an ejection.
"""

from __future__ import annotations

import time

from prefixgate.gateway.settings import HealthPolicy


class UpstreamHealth:
    """One upstream's health (see the module docstring): ``down`` (its active checks failed
    ``unhealthy_threshold`` times in a row, or it failed the check at start), ``ejected``
    (its answers failed ``consecutive_failures`` times in a row) until ``ejected_until``
    (``time.monotonic()`` seconds), then half-open until a check passes.

    ``in_rotation`` is true when it is neither. ``failures`` counts gateway failures in a
    row, ``ejections`` the current ejection multiplier, ``checks_failed`` /
    ``checks_passed`` the active checks in a row."""

    __slots__ = (
        "down",
        "ejected",
        "ejected_until",
        "ejections",
        "failures",
        "checks_failed",
        "checks_passed",
        "_calm_since",
    )

    def __init__(self) -> None:
        self.down = False
        self.ejected = False
        self.ejected_until = 0.0
        self.ejections = 0
        self.failures = 0
        self.checks_failed = 0
        self.checks_passed = 0
        self._calm_since = time.monotonic()  # the start of its time in rotation

    @property
    def in_rotation(self) -> bool:
        return not self.down and not self.ejected

    def state(self) -> str:
        """``"healthy"``, ``"ejected"`` (its ejection time runs), ``"half_open"`` (ejection
        over, waiting for a check to pass) or ``"down"``."""
        if self.down:
            return "down"
        if self.ejected:
            return "ejected" if time.monotonic() < self.ejected_until else "half_open"
        return "healthy"

    def success(self) -> None:
        """An attempt got its answer: the failure count is cleared."""
        self.failures = 0

    def failure(self, policy: HealthPolicy) -> bool:
        """One gateway failure; True when it makes ``consecutive_failures`` in a row (the
        caller ejects, if the pool's share allows: ``eject``)."""
        self.failures += 1
        return self.failures >= policy.consecutive_failures

    def eject(self, policy: HealthPolicy) -> float:
        """Take it out of rotation for its next ejection time; returns that time (s)."""
        self.ejections += 1
        seconds = min(policy.base_ejection_s * self.ejections, policy.max_ejection_s)
        self.ejected = True
        self.ejected_until = time.monotonic() + seconds
        return seconds

    def due_check(self) -> bool:
        """Whether an active check is due: always, except while its ejection time runs."""
        return not (self.ejected and time.monotonic() < self.ejected_until)

    def checked(self, ok: bool, policy: HealthPolicy) -> str | None:
        """Record one active check; returns ``"back"`` (in rotation again, half-open),
        ``"down"`` (just marked down) or None (no change of state)."""
        now = time.monotonic()
        if ok:
            self.checks_failed = 0
            self.checks_passed += 1
            if self.down and self.checks_passed >= policy.healthy_threshold:
                self.down = False
                self.ejected = False
                return self._back(policy, now)
            if self.ejected and not self.down and now >= self.ejected_until:
                self.ejected = False
                return self._back(policy, now)
            if (
                self.in_rotation
                and self.ejections
                and now - self._calm_since >= (policy.base_ejection_s)
            ):
                self.ejections -= 1  # a calm stretch: the next ejection is shorter
                self._calm_since = now
            return None
        self.checks_passed = 0
        self.checks_failed += 1
        if not self.down and self.checks_failed >= policy.unhealthy_threshold:
            self.down = True
            return "down"
        return None

    def _back(self, policy: HealthPolicy, now: float) -> str:
        self.failures = policy.consecutive_failures - 1  # half-open: one failure ejects
        self._calm_since = now
        return "back"

    def mark_down(self) -> None:
        """Down at once (the check at start failed): back after ``healthy_threshold``
        passed checks."""
        self.down = True
        self.checks_passed = 0
