"""How long until a slot frees: the ``Retry-After`` of a concurrency bound (``max_running``,
a key's ``max_concurrent``), estimated from the running requests' progress.

``SlotClock`` holds the start time of every slot in use and an EWMA of how long a slot is held
(start to release, over released slots). A held slot's remaining time is estimated as
``max(0, hold - its age)``; ``wait(needed)`` is when ``needed`` slots have freed: the
``needed``-th smallest remaining time. Before any slot was released there is no hold time to go
by: the estimate is then the oldest slot's age (a request expected to take as long again), at
least ``floor_s``. A holder that knows its progress says when it will end instead
(``set_eta``: a generation's tokens left over its own measured token rate), which follows the
machine's speed of the moment rather than the last request's. A client told that waits about one slot's release, not a fixed second:
under ``--max-running`` a constant ``Retry-After: 1`` was refused nine times in a row while the
first slot freed 5-9 s later.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable


class SlotClock:
    """Slots in use with their start times (``take`` → token, ``give(token)``) and the EWMA
    of their hold time (seconds, weight ``alpha`` for each release); ``clock``: monotonic
    seconds (injectable for tests)."""

    __slots__ = ("_live", "_hold", "_alpha", "_ids", "floor_s", "_clock", "_eta")

    def __init__(
        self,
        alpha: float = 0.3,
        floor_s: float = 1.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._clock = clock if clock is not None else _monotonic
        self._eta: dict[int, Callable[[], float | None]] = {}  # token -> predicted release
        self._live: dict[int, tuple[float, int]] = {}  # token -> (start, slots)
        self._hold = 0.0
        self._alpha = alpha
        self._ids = itertools.count()
        self.floor_s = floor_s

    def take(self, slots: int = 1) -> int:
        """``slots`` slots start being held now; returns the token that gives them back."""
        token = next(self._ids)
        self._live[token] = (self._clock(), slots)
        return token

    def give(self, token: int) -> None:
        """The slots of ``token`` are free again (a second call is a no-op)."""
        entry = self._live.pop(token, None)
        self._eta.pop(token, None)
        if entry is None:
            return
        held = self._clock() - entry[0]
        a = self._alpha
        self._hold = held if self._hold == 0.0 else (1 - a) * self._hold + a * held

    @property
    def held(self) -> int:
        """Slots in use now."""
        return sum(n for _, n in self._live.values())

    @property
    def hold_s(self) -> float:
        """The EWMA of a slot's hold time in seconds (0 before any release)."""
        return self._hold

    def set_eta(self, token: int, eta: Callable[[], float | None]) -> None:
        """The holder of ``token`` can predict its own release: ``eta()`` is the seconds until
        it ends (from its progress), or ``None`` while it cannot tell (then the hold time is
        used). No-op for a token already given back."""
        if token in self._live:
            self._eta[token] = eta

    def wait(self, needed: int = 1) -> float:
        """Seconds until ``needed`` held slots are estimated free (see the module docstring);
        at least ``floor_s``."""
        now = self._clock()
        if not self._live or needed <= 0:
            return self.floor_s
        ages = sorted(((now - start, n) for start, n in self._live.values()), reverse=True)
        etas = {t: f() for t, f in self._eta.items()}
        if any(v is not None for v in etas.values()):  # holders that predict their release
            oldest = ages[0][0]
            left: list[tuple[float, int]] = []
            for token, (start, n) in self._live.items():
                own = etas.get(token)
                if own is None:  # by the hold time (as below): the oldest's age without one
                    own = oldest if self._hold == 0.0 else max(0.0, self._hold - (now - start))
                left.append((max(0.0, own), n))
            left.sort()
            freed = 0
            for seconds, n in left:
                freed += n
                if freed >= needed:
                    return max(self.floor_s, seconds)
            return max(self.floor_s, left[-1][0])
        if self._hold == 0.0:
            return max(self.floor_s, ages[0][0])
        freed = 0
        remaining = 0.0
        for age, n in ages:  # oldest first: the first expected to end
            remaining = max(0.0, self._hold - age)
            freed += n
            if freed >= needed:
                break
        return max(self.floor_s, remaining)


def _monotonic() -> float:
    """``time.monotonic()`` read through this module's ``time`` at each call (not bound once
    as a default argument), so that a clock put in its place (``prefixgate sim``'s virtual
    clock) is the one read."""
    return time.monotonic()
