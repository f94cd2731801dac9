"""The engine's thread count beside other busy processes (torch-free; Linux ``/proc/stat``).

OpenMP threads that spin for their next parallel region are fast on a quiet host (no idle
CPU to wake for every parallel region) but collapse beside another busy
process: a spinning thread holds the core the other thread's half of the work needs. So the
engine spins for a bounded while (``engine/threads.py``) and :class:`ThreadGovernor` runs it
on fewer threads while other processes keep its CPUs busy: on as many threads as CPUs are left
to it, at least one; back up once they are free again. Measured: docs/cpu-performance.md.

:class:`CpuShare` measures the other processes: the busy time of the CPUs this process may run
on (``/proc/stat``'s per-CPU ``user + system + irq + softirq``; steal and iowait are not
another process's work there, nor ``nice``: :data:`BUSY_FIELDS`) minus this process's own CPU time, over the wall time between two
samples, in CPUs. A container's ``/proc/stat`` is the host's; the CPUs read are the affinity
set's, which a cpuset maps to the host's own numbering.

``PREFIXGATE_ADAPTIVE_THREADS=0`` in the environment switches the governor off (the engine keeps
the thread count it was given).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

STAT_PATH = "/proc/stat"
USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
"""``/proc/stat``'s tick: its counters are in 1/USER_HZ seconds (100 on Linux)."""

BUSY_FIELDS = (0, 2, 5, 6)
"""``user nice system idle iowait irq softirq steal``: the fields counted busy (``guest`` is
inside ``user`` already). ``nice`` (processes of lowered priority) counts only where this
process runs niced itself (:func:`busy_fields`): a nice-19 process gets about 1/70 of a core
beside a normal-priority thread, so spinning beside it costs it, not the engine."""


def busy_fields() -> tuple[int, ...]:
    """:data:`BUSY_FIELDS`, plus ``nice`` where this process's own niceness is above 0 (its own
    CPU time is counted there then)."""
    try:
        niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
    except (AttributeError, OSError):
        niced = False
    return (*BUSY_FIELDS, 1) if niced else BUSY_FIELDS


INTERVAL_S = 0.5
"""Seconds between two samples: long enough for 100 Hz ticks (±0.02 CPU), short enough that a
new competitor meets spinning threads for at most about this long."""

STALE_INTERVALS = 4
"""A sample spanning more than this many intervals, over which this process ran less than
:data:`IDLE_CPU` CPUs, is only a baseline (:class:`ThreadGovernor`)."""

IDLE_CPU = 0.25
"""This process's own CPUs (CPU seconds over wall seconds) under which a long sample spanned an
idle or paused engine rather than one long step: an engine stepping runs at least one thread,
most of a CPU even beside a competitor."""

ENV_SWITCH = "PREFIXGATE_ADAPTIVE_THREADS"

_lowered: dict[str, int] = {}
"""The process's last count a governor applied (``"set"``) and the count asked before any
governor changed it (``"asked"``): torch's thread count is process-wide, so an engine made
after another's governor lowered it reads the asked count back (:func:`asked_threads`)."""


def asked_threads(current: int) -> int:
    """The thread count a governor's lowering hid: the count asked before it where ``current``
    (``torch.get_num_threads()``) is still the count a governor last set, else ``current`` (a
    count set since by anyone else is theirs)."""
    if _lowered and current == _lowered["set"]:
        return _lowered["asked"]
    return current


def read_cpu_busy(
    cpus: Iterable[int], path: str = STAT_PATH, fields: tuple[int, ...] | None = None
) -> float | None:
    """Busy seconds so far of ``cpus`` (ids as ``/proc/stat`` numbers them; ``fields`` default
    :func:`busy_fields`), or None where the file or one of the CPUs' lines is missing (not
    Linux, a hidden ``/proc``)."""
    want = {f"cpu{c}" for c in cpus}
    fields = busy_fields() if fields is None else fields
    total = 0
    found = 0
    try:
        with open(path) as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                name, _, rest = line.partition(" ")
                if name not in want:
                    continue
                values = rest.split()
                total += sum(int(values[i]) for i in fields if i < len(values))
                found += 1
    except (OSError, ValueError):
        return None
    return total / USER_HZ if found == len(want) else None


class CpuShare:
    """CPUs of this process's set kept busy by other processes, between two :meth:`sample` s.

    Args:
        cpus: the CPU ids to watch (default: this process's affinity set).
        read_busy: ``cpus -> busy seconds so far or None`` (default :func:`read_cpu_busy`).
        own_cpu_s: this process's CPU seconds so far (default ``time.process_time``).
        clock: wall seconds (default ``time.monotonic``).
    """

    def __init__(
        self,
        cpus: Iterable[int] | None = None,
        read_busy: Callable[[Iterable[int]], float | None] = read_cpu_busy,
        own_cpu_s: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cpus is None:
            getaff = getattr(os, "sched_getaffinity", None)
            cpus = sorted(getaff(0)) if getaff is not None else range(os.cpu_count() or 1)
        self.cpus = tuple(cpus)
        self._read, self._own, self._clock = read_busy, own_cpu_s, clock
        self._last: tuple[float, float, float] | None = None
        self.own_cpus: float | None = None  # this process's CPUs over the last sample's span

    def sample(self) -> float | None:
        """Other processes' busy CPUs (``>= 0``) since the previous sample; None at the first
        sample, where ``/proc/stat`` cannot be read, or where no wall time passed."""
        busy = self._read(self.cpus)
        if busy is None:
            self._last = None
            return None
        now = (self._clock(), busy, self._own())
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:
            return None
        wall = now[0] - last[0]
        self.own_cpus = (now[2] - last[2]) / wall
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / wall)


class ThreadGovernor:
    """Keeps the torch thread count at what the CPUs other processes leave free allow.

    Args:
        threads: the thread count asked for (the most it runs at), ``>= 1``.
        share: what measures the other processes (default a :class:`CpuShare` of the affinity).
        set_threads: applies a thread count (default ``torch.set_num_threads``).
        clock: wall seconds (default ``time.monotonic``).
        interval_s: seconds between samples.

    :meth:`tick` (once per engine step) samples at most every ``interval_s``; the count goes down
    at once, and up only after two samples in a row allow it (a competitor's short pause does
    not bring the spinning back for half a second). A sample over more than
    ``STALE_INTERVALS`` intervals in which this process ran under :data:`IDLE_CPU` CPUs (the
    engine sat idle or paused, no step ticked) is a new baseline, not a verdict: the CPUs' past
    while the engine waited says nothing of them now. One over a long step (a prefill of
    thousands of tokens takes seconds at one thread) is a verdict like any other.
    """

    def __init__(
        self,
        threads: int,
        share: CpuShare | None = None,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = INTERVAL_S,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.current = threads
        self.share = share if share is not None else CpuShare()
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set = set_threads
        self._clock = clock
        self.interval_s = interval_s
        self._next = clock()
        self._sampled = self._next
        self._raise_votes = 0
        self.share.sample()  # the baseline

    def target(self, others: float) -> int:
        """Threads for ``others`` busy CPUs of ours: the CPUs left (rounded to nearest), at
        least 1, at most :attr:`threads`."""
        free = len(self.share.cpus) - others
        return max(1, min(self.threads, int(free + 0.5)))

    def tick(self) -> int:
        """Sample if ``interval_s`` passed and apply the new count; returns the count."""
        now = self._clock()
        if now < self._next:
            return self.current
        self._next = now + self.interval_s
        long = now - self._sampled > STALE_INTERVALS * self.interval_s
        self._sampled = now
        others = self.share.sample()
        # a long span is a verdict when the engine ran through it (one long prefill step, or
        # steps too far apart to tick between); over an idle or paused engine, a baseline
        own = self.share.own_cpus
        if others is None or (long and (own is None or own < IDLE_CPU)):
            return self.current
        want = self.target(others)
        if want < self.current:
            self._apply(want, others)
            self._raise_votes = 0
        elif want > self.current:
            self._raise_votes += 1
            if self._raise_votes >= 2:
                self._apply(want, others)
                self._raise_votes = 0
        else:
            self._raise_votes = 0
        return self.current

    def _apply(self, n: int, others: float) -> None:
        logger.info(
            "other processes keep %.1f of this process's %d CPUs busy: %d -> %d threads",
            others,
            len(self.share.cpus),
            self.current,
            n,
        )
        self._set(n)
        self.current = n
        _lowered.update(asked=self.threads, set=n)


def make_governor(threads: int) -> ThreadGovernor | None:
    """A :class:`ThreadGovernor` for ``threads`` (at one thread it only samples), or None: the
    switch off (``PREFIXGATE_ADAPTIVE_THREADS=0``), or ``/proc/stat`` not readable here."""
    if threads < 1 or os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    share = CpuShare()
    if read_cpu_busy(share.cpus) is None:
        return None
    return ThreadGovernor(threads, share)
