"""The load model: what the engine's measured load predicts (the scheduler feeds it, admission
reads it). It holds the step rates, the finish rate, the step time and the seat schedule, and
turns a ``stats()`` snapshot of them into a predicted time to first token (``estimate_ttft``).

Rates (``stats()``): each step's model time is the time from ``schedule()`` to
``update_from_output()``. ``decode_tokens_per_s`` is an exponentially weighted mean (weight
``RATE_ALPHA`` for the newest step) of decode tokens / time over steps that prefill nothing;
``prefill_tokens_per_s`` the same of prefill tokens / (time - decode tokens /
``decode_tokens_per_s``) over steps that prefill; ``finished_per_s`` is not a per-step mean
(finishes come in bursts: a batch admitted together finishes together, and a per-step mean
decayed 30-fold over the finish-free steps in between, so a full engine predicted a 33 s wait
for a seat that freed in 0.5 s) but the requests finished over the step time of a window of
recent steps that spans at least ``FINISH_WINDOW_S`` seconds and ``FINISH_WINDOW_MIN``
finishes (at most ``FINISH_WINDOW_MAX_S`` seconds; ``FinishRate``). A step's time there is
busy wall time, from the end of the step before it (when that one left requests unfinished)
to its own end: the gap between steps (the engine thread's loop, the gateway's own work on
the same cores) drains no seat, and a rate over model time alone told waits that were 0.6-0.8
of the real ones through ``prefixgate serve`` at 2x overload. ``estimate_ttft``
(``Scheduler.predict_ttft``, ``LLMEngine`` / ``AsyncEngine.predict_ttft``) turns them into a
first-token wait.

The scheduler calls ``LoadModel.on_step`` once a step and ``LoadModel.on_finished`` with the
requests each step finished; ``LoadModel.stats`` is its part of ``Scheduler.stats()``. Torch-free:
the gateway imports this module in proxy mode too.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixgate.engine.request import Request

RATE_ALPHA = 0.2
"""Weight of the newest step in the exponentially weighted rates of ``stats()``."""
FINISH_WINDOW_S = 8.0  # step seconds the finish rate spans at least ...
FINISH_WINDOW_MIN = 8  # ... and finishes, when the last FINISH_WINDOW_MAX_S seconds hold them
FINISH_WINDOW_MAX_S = 60.0
STEP_WINDOW_S = 8.0  # busy wall seconds of steps the seat schedule's mean step spans
STEP_RECENT_S = 1.0  # ... and the recent part of it that counts when its steps are slower
SEAT_HOLD_WINDOW = 64  # finished requests whose time seated bounds the seat service below
OUTPUT_WINDOW = 256  # finished requests' output lengths a running request's rest is read from
OUTPUT_REST_MIN = 4  # ... of them longer than it has run, for that rest to count
ARRIVAL_TAU_S = 2.0  # time constant (seconds) of the arrival rates (``ArrivalRates``)
SEAT_HORIZON_S = 120.0  # a seat later than this many seconds ahead is no seat in sight (inf)
SEAT_QUEUE_MAX = 256  # waiting requests seated by their own size (the rest: the mean service)


class FinishRate:
    """Requests finished per second of step time over a window of recent steps (see the
    module docstring): it spans at least ``FINISH_WINDOW_S`` step seconds and
    ``FINISH_WINDOW_MIN`` finishes, never more than ``FINISH_WINDOW_MAX_S`` step seconds.
    Cost: O(1) amortized a step; memory: one pair per step in the window."""

    __slots__ = ("_steps", "_seconds", "_finished")

    def __init__(self) -> None:
        self._steps: deque[tuple[float, int]] = deque()
        self._seconds = 0.0
        self._finished = 0

    def add(self, dt: float, num_finished: int) -> None:
        """Fold in one step of ``dt`` seconds that finished ``num_finished`` requests."""
        self._steps.append((dt, num_finished))
        self._seconds += dt
        self._finished += num_finished
        while len(self._steps) > 1:
            old_dt, old_n = self._steps[0]
            rest_s, rest_n = self._seconds - old_dt, self._finished - old_n
            enough = rest_s >= FINISH_WINDOW_S and rest_n >= FINISH_WINDOW_MIN
            if not (enough or rest_s >= FINISH_WINDOW_MAX_S):
                break
            self._steps.popleft()
            self._seconds, self._finished = rest_s, rest_n

    def per_s(self) -> float | None:
        """Finishes per step second over the window; ``None`` before the first finish. A
        window that starts or ends at a burst counts one burst too many or too few: with
        ``FINISH_WINDOW_S`` of 8 s and requests of about 1 s, within about 15 %."""
        if not self._finished or self._seconds <= 0:
            return None
        return self._finished / self._seconds


class StepTime:
    """Mean busy wall seconds a step over the last ``STEP_WINDOW_S`` seconds of steps (at
    least the newest step): the seat schedule's clock. A plain mean, not an exponential one
    (steps that prefill a batch are many times a decode step: a per-step mean of weight 0.2
    read 7.4 ms where the steps took 4.8 ms on average). A wait tens of seconds ahead is that
    many steps of this mean, so it follows the window's noise: with a 2 s window, traced
    at 4x overload, returners found themselves up to 7 s over their budget (p90 error 0.35 at
    2x and 4x, against 0.07 and 0.34 over 8 s). Cost: O(1) amortized a step."""

    __slots__ = ("_steps", "_seconds", "_recent", "_recent_s")

    def __init__(self) -> None:
        self._steps: deque[float] = deque()
        self._seconds = 0.0
        self._recent: deque[float] = deque()  # the last STEP_RECENT_S of them
        self._recent_s = 0.0

    def add(self, dt: float) -> None:
        """Fold in one step of ``dt`` busy wall seconds."""
        self._seconds = _push(self._steps, self._seconds, dt, STEP_WINDOW_S)
        self._recent_s = _push(self._recent, self._recent_s, dt, STEP_RECENT_S)

    def mean_s(self) -> float | None:
        """Mean seconds a step over the window; ``None`` before the first step."""
        return self._seconds / len(self._steps) if self._steps else None

    def near_s(self) -> float | None:
        """Mean seconds a step for the steps just ahead: over the last ``STEP_RECENT_S``
        seconds where that is longer than the window's (a slowdown is followed at once, a
        speed-up over the window); ``None`` before the first step. A wait tens of seconds
        ahead is not scaled by it: a recent slowdown taken as lasting told long waits far
        too long (docs/admission.md, "Near steps")."""
        if not self._steps:
            return None
        return max(self._seconds / len(self._steps), self._recent_s / len(self._recent))


def _push(steps: deque[float], total: float, dt: float, bound: float) -> float:
    """Append ``dt`` to ``steps`` (summing to ``total``), drop the oldest while the rest span
    ``bound`` seconds (at least one stays); returns the new total."""
    steps.append(dt)
    total += dt
    while len(steps) > 1 and total - steps[0] >= bound:
        total -= steps.popleft()
    return total


class ArrivalRates:
    """Requests arriving at the scheduler per second, in all and per tenant: exponentially
    weighted (time constant ``ARRIVAL_TAU_S``; each arrival adds ``1 / tau`` to a rate that
    decays as ``exp(-dt / tau)``). Not corrected for a young stream (it reads low for its
    first ``tau`` seconds), so that the total is the sum of the tenants' rates at every
    moment and the rate of all tenants but a few is the total less theirs. Memory: one
    entry per tenant seen in the last ``~10 tau`` seconds (older ones are dropped every
    4,096 arrivals)."""

    __slots__ = ("_total", "_by_tenant", "_arrivals")

    def __init__(self) -> None:
        self._total: tuple[float, float] | None = None  # (rate, last arrival)
        self._by_tenant: dict[str, tuple[float, float]] = {}
        self._arrivals = 0

    @staticmethod
    def _bump(got: tuple[float, float] | None, now: float) -> tuple[float, float]:
        if got is None:
            return (1.0 / ARRIVAL_TAU_S, now)
        rate, last = got
        return (rate * math.exp(-(now - last) / ARRIVAL_TAU_S) + 1.0 / ARRIVAL_TAU_S, now)

    def add(self, tenant: str, now: float) -> None:
        """One request of ``tenant`` arrived at monotonic ``now`` (seconds)."""
        self._total = self._bump(self._total, now)
        self._by_tenant[tenant] = self._bump(self._by_tenant.get(tenant), now)
        self._arrivals += 1
        if self._arrivals % 4096 == 0:
            horizon = 10 * ARRIVAL_TAU_S
            self._by_tenant = {t: v for t, v in self._by_tenant.items() if now - v[1] < horizon}

    def per_s(self, now: float, tenant: str | None = None) -> float:
        """Arrivals per second at monotonic ``now``: of ``tenant``, or of all (``None``)."""
        got = self._total if tenant is None else self._by_tenant.get(tenant)
        if got is None:
            return 0.0
        rate, last = got
        return rate * math.exp(-max(0.0, now - last) / ARRIVAL_TAU_S)


class OutputLengths:
    """The output lengths of the last ``OUTPUT_WINDOW`` finished requests, and the rest of a
    running request from them (``residual``). Cost: O(W) a ``add`` batch, O(log W) a query."""

    __slots__ = ("_window", "_sorted", "_suffix")

    def __init__(self) -> None:
        self._window: deque[int] = deque(maxlen=OUTPUT_WINDOW)
        self._sorted: list[int] | None = []
        self._suffix: list[int] = [0]  # _suffix[i]: sum of _sorted[i:]

    def __len__(self) -> int:
        """How many lengths the window holds (the finished requests, up to ``OUTPUT_WINDOW``)."""
        return len(self._window)

    def add(self, n: int) -> None:
        self._window.append(n)
        self._sorted = None  # re-sorted at the next query

    def residual(self, done: int) -> tuple[float | None, int]:
        """``(rest, longer)`` for a request that has sampled ``done`` tokens: ``longer`` is
        how many of the window's lengths ``L`` are ``> done``, ``rest`` the mean of ``L -
        done`` over them (the empirical mean residual life, as in renewal theory; ``None``
        when none is). One bisection."""
        if self._sorted is None:
            self._sorted = sorted(self._window)
            suffix = [0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + self._sorted[i]
            self._suffix = suffix
        i = bisect.bisect_right(self._sorted, done)
        longer = len(self._sorted) - i
        if not longer:
            return None, 0
        return self._suffix[i] / longer - done, longer


class LoadModel:
    """The measured load of one scheduler: step rates, finish rate, step time and the finished
    requests' output lengths and seated times (see the module docstring).

    Attributes:
        prefill_tokens_per_s, decode_tokens_per_s: exponentially weighted step rates
            (``None`` before a step of that kind was measured).
        finished_per_s: ``FinishRate.per_s`` after the last step (``None`` before a finish).
        mean_output_tokens: exponentially weighted mean output length of finished requests.
    """

    def __init__(self) -> None:
        self.prefill_tokens_per_s: float | None = None
        self.decode_tokens_per_s: float | None = None
        self.finished_per_s: float | None = None
        self.mean_output_tokens: float | None = None
        self._finish_rate = FinishRate()
        self._step_time = StepTime()
        self._busy_since: float | None = None  # the last step's end, when it left work
        self._holds: deque[float] = deque(maxlen=SEAT_HOLD_WINDOW)  # seconds seated, finished
        self.outputs = OutputLengths()  # finished requests' output lengths
        self.arrivals = ArrivalRates()  # requests arriving per second, in all and per tenant

    def overtake_per_s(self, over: Mapping[str, float], now: float) -> dict[str, float]:
        """For each tenant of ``over`` (those the fair order serves after the others' new
        requests, with their places: ``SchedulingPolicy.over_share``): the requests per second
        arriving at monotonic ``now`` of the tenants that go before its waiting ones, which
        take the seats that free first: every tenant but those of ``over`` at a place no
        lower than its own (itself included); at least 0."""
        names = sorted(over)  # a fixed order: the same sums in every process
        if not names:
            return {}
        total = self.arrivals.per_s(now)
        rates = {t: self.arrivals.per_s(now, t) for t in names}
        out = {}
        for t in names:
            behind = sum(rates[u] for u in names if over[u] >= over[t])
            out[t] = max(0.0, total - behind)
        return out

    def on_finished(self, finished: Iterable[Request]) -> None:
        """Fold in the requests a step finished: their seconds seated (first scheduled to
        finished) and output lengths."""
        for r in finished:
            if r.first_scheduled_time is not None and r.finished_time is not None:
                self._holds.append(r.finished_time - r.first_scheduled_time)
            n = float(r.num_output_tokens)
            self.outputs.add(r.num_output_tokens)
            old = self.mean_output_tokens
            self.mean_output_tokens = n if old is None else (1 - RATE_ALPHA) * old + RATE_ALPHA * n

    def on_decode_steps(self, start: float, ends: Sequence[float], num_decode: int) -> None:
        """Fold in back-to-back pure decode steps, the first from ``start`` and step ``j``
        ending at ``ends[j]`` (monotonic seconds), each of ``num_decode`` tokens, none
        finishing a request, requests left after each: the state ``on_step(ends[j] -
        ends[j - 1], ends[j], 0, num_decode, 0, True)`` for each leaves, the same
        floating-point operations in the same order (``prefixgate sim``'s decode stretches)."""
        before = start
        rate = self.decode_tokens_per_s
        busy_since = self._busy_since
        finish_add, step_add = self._finish_rate.add, self._step_time.add
        a = RATE_ALPHA
        for now in ends:
            dt = now - before
            before = now
            busy = now - busy_since if busy_since is not None else dt
            busy_since = now
            if dt <= 0:
                continue
            new = num_decode / dt
            rate = new if rate is None else (1 - a) * rate + a * new
            held = max(dt, busy)
            finish_add(held, 0)
            step_add(held)
        self._busy_since = busy_since
        self.decode_tokens_per_s = rate
        self.finished_per_s = self._finish_rate.per_s()

    def on_step(
        self,
        dt: float,
        now: float,
        num_prefill: int,
        num_decode: int,
        num_finished: int,
        busy_after: bool,
    ) -> None:
        """Fold one non-empty step into the rates: ``dt`` seconds of model time ending at
        monotonic ``now``, ``num_prefill`` prompt tokens and ``num_decode`` other tokens,
        ``num_finished`` requests finished; ``busy_after``: requests are left unfinished."""
        # finishes over busy wall time: from the last step's end (when it left work) to this
        # one's, the gap between steps included
        busy = now - self._busy_since if self._busy_since is not None else dt
        self._busy_since = now if busy_after else None
        if dt <= 0:
            return

        def ewma(old: float | None, new: float) -> float:
            return new if old is None else (1 - RATE_ALPHA) * old + RATE_ALPHA * new

        if num_prefill == 0:
            self.decode_tokens_per_s = ewma(self.decode_tokens_per_s, num_decode / dt)
        else:
            decode_s = num_decode / self.decode_tokens_per_s if self.decode_tokens_per_s else 0.0
            prefill_s = max(dt - decode_s, 0.1 * dt)  # never credit prefill with no time
            self.prefill_tokens_per_s = ewma(self.prefill_tokens_per_s, num_prefill / prefill_s)
        self._finish_rate.add(max(dt, busy), num_finished)
        self._step_time.add(max(dt, busy))
        self.finished_per_s = self._finish_rate.per_s()

    def stats(
        self,
        running: Sequence[Request],
        max_num_batched_tokens: int,
        max_model_len: int,
        waiting: Sequence[Request] = (),
        max_num_seqs: int = 0,
    ) -> dict[str, Any]:
        """The rates and the seat schedule, keys as ``Scheduler.stats()``."""
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "finished_per_s": self.finished_per_s,
            **self.seat_schedule(
                running, max_num_batched_tokens, max_model_len, waiting, max_num_seqs
            ),
        }

    def seat_schedule(
        self,
        running: Sequence[Request],
        max_num_batched_tokens: int,
        max_model_len: int,
        waiting: Sequence[Request] = (),
        max_num_seqs: int = 0,
    ) -> dict[str, Any]:
        """When the seats free (``stats()``'s ``seat_free_s``: seconds until each running
        request is estimated to finish, ascending, then ``None`` for each whose end is not
        known yet) and how long a seat is then held (``seat_service_s``), from the requests'
        own progress and the mean busy wall time of a step (``StepTime``: the running
        requests' steps at ``near_s``, the seats' later services at the window's ``mean_s``);
        ``seat_free_s`` is ``None`` before a step was measured, ``seat_service_s`` before a
        request has finished.

        A running request's steps left: its tokens left (``max_tokens`` and the model length
        bound them; without ``ignore_eos`` also its expected rest: the mean rest of the
        finished requests that ran longer than it has (``OutputLengths.residual``), or, where
        too few did, the rest of the mean output, or, once it has run past that mean, as many
        tokens again as it has sampled: a request longer than the typical one is no sign of
        ending soon; the few that ran longer, if any, lift that to their mean rest; at least
        one), one a step, and its prompt's chunks still to prefill (at most
        ``max_num_batched_tokens`` each; the last of them samples its first token). Without
        ``ignore_eos``, while fewer than ``OUTPUT_REST_MIN`` requests have finished, its end
        is not known (``None``): so few outputs say nothing of this one's (one 8-token answer
        told requests of up to 400 tokens that they were about to end). A waiting
        request holds its seat for the mean output's steps, or for the mean time the last
        ``SEAT_HOLD_WINDOW`` finished requests sat where that is longer (prefill steps,
        preemptions; at 4x overload the steps alone told returners to come back seconds
        early). Not the finish rate: after a quiet spell of one request at a time it counts
        one busy seat of eight, and a burst was told 34 s waits (the 60 s cap at most) for
        about 6 s of work. An estimate where requests stop early at EOS or a stop string.

        ``waiting`` (in the order they are served, first come first) and ``max_num_seqs``
        (the seats): the first ``SEAT_QUEUE_MAX`` waiting requests are seated by their own
        size (``seat_queue``): each takes the earliest free seat and holds it for the shorter
        of the mean service and its own bound, its ``max_tokens`` left (within the model
        length) and its prefill chunks, one step each at ``seat_step_s`` (the window's mean
        step, lifted as far as the finished requests sat longer than their steps:
        ``seat_service_s`` over the mean output). Where one of them is shorter than the mean,
        ``waiting_seat_s`` (seconds until each of them gets its seat) and
        ``seat_after_waiting_s`` (the seats' free times once they are seated,
        ``max_num_seqs`` of them, ascending) say so; else both are ``None`` and every waiting
        request holds the mean service (``estimate_ttft``). Cost: O(waiting) a snapshot,
        ``O(SEAT_QUEUE_MAX log max_num_seqs)`` at most."""
        step, near, mean = (
            self._step_time.mean_s(),
            self._step_time.near_s(),
            self.mean_output_tokens,
        )
        none: dict[str, Any] = {
            "seat_free_s": None,
            "seat_service_s": None,
            "seat_step_s": None,
            "waiting_seat_s": None,
            "seat_after_waiting_s": None,
        }
        if step is None or near is None:
            return none
        budget = max(1, max_num_batched_tokens)
        outputs_known = len(self.outputs) >= OUTPUT_REST_MIN
        free: list[float] = []
        unknown = 0
        for r in running:
            left = min(r.max_tokens - r.num_output_tokens, max_model_len - r.num_tokens)
            params = r.sampling_params
            if not (params is not None and params.ignore_eos):
                if not outputs_known or mean is None:
                    unknown += 1
                    continue
                done = r.num_output_tokens
                rest, longer = self.outputs.residual(done)
                if rest is None or longer < OUTPUT_REST_MIN:
                    # too few ran longer for their mean rest to stand alone, but they did
                    # run that long: it lifts the mean's rest, never lowers it
                    base = mean - done if done < mean else done
                    rest = base if rest is None else max(base, rest)
                left = min(left, math.ceil(rest))
            free.append(
                _seat_steps(left, r.num_prompt_tokens - r.num_computed_tokens, budget) * near
            )
        free.sort()
        seats = [*free, *[None] * unknown] if unknown else free
        if mean is None:
            return {**none, "seat_free_s": seats}
        service = max(1.0, mean) * step
        if self._holds:  # how long finished requests really sat, preemptions and all
            service = max(service, sum(self._holds) / len(self._holds))
        # a seat's seconds a step: the mean step, lifted as far as finished requests sat
        # longer than their steps (prefill steps, preemptions), as the mean service is
        seat_step = service / max(1.0, mean)
        seated: tuple[list[float], list[float]] | None = None
        # seated only where every running request's end is known (``unknown``: no wait is)
        if waiting and max_num_seqs >= len(running) and not unknown:
            holds = _own_holds(waiting, seat_step, budget, max_model_len, service)
            if holds is not None:
                seated = seat_queue([0.0] * (max_num_seqs - len(running)) + free, holds)
        return {
            "seat_free_s": seats,
            "seat_service_s": service,
            "seat_step_s": seat_step,
            "waiting_seat_s": None if seated is None else seated[0],
            "seat_after_waiting_s": None if seated is None else seated[1],
        }


def _seat_steps(tokens_left: int, uncomputed: int, budget: int) -> int:
    """Steps a request holds its seat for: its ``tokens_left`` output tokens (at least one),
    one a step, and its ``uncomputed`` prompt tokens' chunks of ``budget`` beyond the first
    (the last chunk samples its first token)."""
    chunks = -(-max(0, uncomputed) // budget)
    return max(1, tokens_left) + max(0, chunks - 1)


def _own_holds(
    waiting: Sequence[Request], step_s: float, budget: int, max_model_len: int, service_s: float
) -> list[float] | None:
    """The seconds each of the first ``SEAT_QUEUE_MAX`` ``waiting`` requests holds a seat:
    the shorter of ``service_s`` and its own bound (its ``max_tokens`` left within
    ``max_model_len``, at least one, and its prefill chunks of ``budget`` tokens beyond the
    first, at ``step_s`` each); ``None`` when none is shorter than ``service_s`` (its size
    says nothing the mean does not). A request whose ``max_tokens`` alone is the mean
    service's steps or more holds the mean (one comparison: most requests, where sizes are
    not given)."""
    holds = []
    shorter = False
    limit = service_s / step_s  # steps in the mean service
    for r in itertools.islice(waiting, SEAT_QUEUE_MAX):
        if r.max_tokens >= limit:
            holds.append(service_s)
            continue
        n = r.num_tokens
        left = min(r.max_tokens - r.num_output_tokens, max_model_len - n)
        own = _seat_steps(left, n - r.num_computed_tokens, budget) * step_s
        if own < service_s:
            holds.append(own)
            shorter = True
        else:
            holds.append(service_s)
    return holds if shorter else None


def seat_queue(
    free_s: Sequence[float], holds_s: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Seat a first-come-first-served queue: request ``j`` takes the earliest free seat (seat
    ``i`` frees at ``free_s[i]``) and holds it ``holds_s[j]`` seconds. Returns ``(starts,
    after)``: seconds until each request gets its seat, and the seats' free times once all
    are seated (ascending, ``len(free_s)`` of them). Cost: ``O(len(holds_s) log
    len(free_s))``.

    Raises:
        ValueError: no seat while requests wait.
    """
    if holds_s and not free_s:
        raise ValueError("need seats to seat a queue")
    heap = list(free_s)
    heapq.heapify(heap)
    starts = []
    for hold in holds_s:
        t = heap[0]
        starts.append(t)
        heapq.heapreplace(heap, t + hold)
    return starts, sorted(heap)


def estimate_ttft(
    stats: Mapping[str, Any],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_prompt_tokens: int,
    num_cached_tokens: int = 0,
    overtake_per_s: float = 0.0,
    queued_holds_s: Sequence[float] = (),
) -> float | None:
    """Predicted seconds until a request of ``num_prompt_tokens`` arriving now would get its
    first token, from a ``stats()`` snapshot (torch-free: the gateway can call it on
    ``engine.stats()`` with ``engine.config``); ``None`` before both rates are measured, and
    while no seat is free and a running request's end is not known (a ``None`` in
    ``seat_free_s``: that seat may free at the next step or at its ``max_tokens``, so no wait
    for a seat can be told). ``overtake_per_s``: requests per second of other tenants that
    the scheduler's order serves before this one's while it waits for a seat (its tenant's
    entry of ``stats()``'s ``overtake_per_s`` under ``fair``; 0: first come first served).

    With ``Q`` = ``queued_prefill_tokens`` + the new request's uncached tokens
    (``num_prompt_tokens - num_cached_tokens``), ``D`` = ``num_running`` (decodes per step),
    ``r_p`` / ``r_d`` = ``prefill_tokens_per_s`` / ``decode_tokens_per_s``, ``B`` =
    ``max_num_batched_tokens``::

        steps   = ceil(Q / max(1, B - D))          steps the prefill work needs
        compute = Q / r_p + steps * D / r_d        each of them also carries D decodes
        seat    = nth_free_seat(seats, seat_service_s, num_waiting)  while no seat is free
        ttft    = max(compute, seat) + D / r_d     (+ the first token's own step)

    ``seat`` is the wait for a free seat (0 while one is free): the ``num_waiting``-th free
    seat (0-based: the requests queued ahead take the ones before it), where the free seats
    free now and the running requests' at ``seat_free_s`` (``LoadModel.seat_schedule``: from
    their own tokens left), each then once a ``seat_service_s``. Without that schedule (a
    snapshot from before a step and a finish were measured, or one whose ``seat_free_s`` is
    not one entry a running request) it is the fluid ``max(0, num_running + num_waiting + 1 -
    max_num_seqs) / finished_per_s`` (``inf`` while seats are full and no request has finished
    yet). The fluid wait is a step function of time for a batch admitted together: it stays
    put until the batch finishes, and returning clients told it met their TTFT budget again
    and again (docs/admission.md, "The seat schedule"); the schedule's falls with every step.
    First come first served is assumed with ``overtake_per_s`` 0: under ``fair`` a light
    tenant, under ``priority`` an urgent request, waits less. With ``overtake_per_s`` = λ > 0
    (a tenant over its seat share under ``fair``: the others' new requests go first) the seat
    is the first free one left to it: the first time ``t`` at which more than ``num_waiting
    + λ t`` seats have freed (``nth_free_seat_overtaken``), or in the fluid form ``ahead /
    (finished_per_s - λ)`` (``inf`` when λ is no less).

    Each request queued ahead holds its seat for ``seat_service_s`` unless its own size is
    known and shorter: the engine's waiting requests seated by their own size
    (``waiting_seat_s`` / ``seat_after_waiting_s``, ``LoadModel.seat_schedule``: the
    ``n``-th request of a queue of them takes the seat ``waiting_seat_s[n]``; behind all of
    them the rest of the queue takes the seats of ``seat_after_waiting_s``), and the last
    ``len(queued_holds_s)`` of ``num_waiting`` (requests not in the engine yet whose size the
    caller knows: seconds each holds its seat, ``own_hold_s``; those seated behind the
    others). Without either, the seat is ``nth_free_seat`` of the free seats as above.

    Raises:
        TypeError: ``num_prompt_tokens`` / ``num_cached_tokens`` not ints.
        ValueError: ``num_prompt_tokens`` < 1 or ``num_cached_tokens`` outside
            ``[0, num_prompt_tokens)``.
    """
    for name, v in (
        ("num_prompt_tokens", num_prompt_tokens),
        ("num_cached_tokens", num_cached_tokens),
    ):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if num_prompt_tokens < 1:
        raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
    if not 0 <= num_cached_tokens < num_prompt_tokens:
        raise ValueError(
            f"num_cached_tokens must be in [0, {num_prompt_tokens}), got {num_cached_tokens}"
        )
    r_p, r_d = stats.get("prefill_tokens_per_s"), stats.get("decode_tokens_per_s")
    if not r_p or not r_d:
        return None
    d = int(stats["num_running"])
    q = int(stats["queued_prefill_tokens"]) + num_prompt_tokens - num_cached_tokens
    steps = -(-q // max(1, max_num_batched_tokens - d))
    compute = q / r_p + steps * d / r_d
    waiting = int(stats["num_waiting"])
    ahead = d + waiting + 1 - max_num_seqs
    seat = 0.0
    free, service = stats.get("seat_free_s"), stats.get("seat_service_s")
    if ahead > 0 and free is not None and len(free) == d and None in free:
        return None  # a seat's end is not known: nor is the wait for one
    if ahead > 0 and free is not None and service and len(free) == d:
        seats = [0.0] * (max_num_seqs - d) + list(free)
        seat = _queue_seat(stats, seats, service, waiting, queued_holds_s, overtake_per_s)
    elif ahead > 0:
        finished = stats.get("finished_per_s")
        left = (finished or 0.0) - max(0.0, overtake_per_s)
        seat = ahead / left if finished and left > 0 else float("inf")
    return max(compute, seat) + d / r_d


def _queue_seat(
    stats: Mapping[str, Any],
    seats: list[float],
    service_s: float,
    waiting: int,
    holds_s: Sequence[float],
    overtake_per_s: float,
) -> float:
    """Seconds until a request behind ``waiting`` queued ones gets a seat (``estimate_ttft``):
    ``seats`` free now or at the running requests' ends; the engine's waiting requests
    seated by their own size where ``stats`` has them, the last ``len(holds_s)`` of
    ``waiting`` holding their seats ``holds_s`` (each at most ``service_s``), the others
    ``service_s``; ``overtake_per_s``: as ``estimate_ttft``'s."""
    holds = [min(h, service_s) for h in holds_s][-waiting:] if waiting > 0 else []
    n = waiting - len(holds)  # requests ahead of the ones of known size, then those
    starts, after = stats.get("waiting_seat_s"), stats.get("seat_after_waiting_s")
    if starts is not None and after is not None and len(after) == len(seats) and n >= 0:
        if n >= len(starts):  # behind every waiting request seated by its size
            seats, n = list(after), n - len(starts)
        elif not holds and not overtake_per_s > 0:
            return starts[n]  # the seat the n-th of them takes
        # else (a view of fewer waiting requests than the engine's, with more after them):
        # the seats as they are, every request ahead of the mean service
    if not holds:
        if overtake_per_s > 0:
            return nth_free_seat_overtaken(seats, service_s, n, overtake_per_s)
        return nth_free_seat(seats, service_s, n)
    _, seats = seat_queue(seats_after(seats, service_s, n), holds)
    if overtake_per_s > 0:
        return nth_free_seat_overtaken(seats, service_s, 0, overtake_per_s)
    return seats[0]


def own_hold_s(
    stats: Mapping[str, Any],
    max_num_batched_tokens: int,
    num_prompt_tokens: int,
    max_tokens: int | None,
) -> float | None:
    """Seconds a request of ``num_prompt_tokens`` and at most ``max_tokens`` output tokens
    holds a seat by its own size, from a ``stats()`` snapshot: its prompt's chunks (of
    ``max_num_batched_tokens``) beyond the first and ``max_tokens`` steps, at ``seat_step_s``
    each (as ``LoadModel.seat_schedule`` seats a waiting request); ``None`` when
    ``max_tokens`` is ``None`` or the snapshot has no step time. ``estimate_ttft``'s
    ``queued_holds_s`` takes it (at most ``seat_service_s``).

    Raises:
        ValueError: ``max_tokens`` < 1 or ``num_prompt_tokens`` < 1.
    """
    if max_tokens is None:
        return None
    if max_tokens < 1 or num_prompt_tokens < 1:
        raise ValueError(
            f"need max_tokens >= 1 and num_prompt_tokens >= 1, got {max_tokens}, "
            f"{num_prompt_tokens}"
        )
    step = stats.get("seat_step_s")
    if not step:
        return None
    return _seat_steps(max_tokens, num_prompt_tokens, max(1, max_num_batched_tokens)) * float(step)


def seats_after(free_s: Sequence[float], service_s: float, n: int) -> list[float]:
    """The seats' free times (ascending) once ``n`` requests of a first-come-first-served
    queue, each holding its seat ``service_s``, have taken seats (seat ``i`` frees at
    ``free_s[i]``, then every ``service_s``): for each seat, its first free time the ``n``
    requests did not take (``nth_free_seat``'s count; of frees at one moment, the ones left
    over come back). Cost: ``nth_free_seat``'s.

    Raises:
        ValueError: as ``nth_free_seat``.
    """
    if n <= 0:
        return sorted(free_s)
    t = nth_free_seat(free_s, service_s, n - 1)  # at least n frees up to t
    counts = [math.floor((t - f) / service_s) + 1 if f <= t else 0 for f in free_s]
    excess = sum(counts) - n
    if excess > 0:  # frees at t (within the bisection's error) left over: the latest come back
        last = sorted(
            (i for i, c in enumerate(counts) if c > 0),
            key=lambda i: free_s[i] + (counts[i] - 1) * service_s,
            reverse=True,
        )
        for i in last[:excess]:
            counts[i] -= 1
    return sorted(f + c * service_s for f, c in zip(free_s, counts, strict=True))


def nth_free_seat(free_s: Sequence[float], service_s: float, n: int) -> float:
    """Seconds until the ``n``-th request (0-based) of a first-come-first-served queue gets a
    seat: seat ``i`` frees at ``free_s[i]`` and then at every ``service_s`` (each request
    holds it that long), so the ``n``-th is the ``n``-th smallest of
    ``{free_s[i] + r * service_s : i, r >= 0}``. Found by bisection on the count of frees up
    to a time (``O(len(free_s))`` each, 60 rounds: exact to well under a microsecond).

    Raises:
        ValueError: no seat, ``service_s`` not > 0, or ``n`` < 0.
    """
    if not free_s or not service_s > 0 or n < 0:
        raise ValueError(f"need seats, service_s > 0 and n >= 0, got {free_s}, {service_s}, {n}")
    seats = len(free_s)
    lo, hi = min(free_s), max(free_s) + (n // seats + 1) * service_s
    for _ in range(60):
        mid = (lo + hi) / 2
        count = sum(math.floor((mid - f) / service_s) + 1 for f in free_s if f <= mid)
        if count > n:
            hi = mid
        else:
            lo = mid
    return hi


def nth_free_seat_overtaken(
    free_s: Sequence[float], service_s: float, n: int, overtake_per_s: float
) -> float:
    """Seconds until the ``n``-th request (0-based) of a queue gets a seat when requests of
    others arrive at ``overtake_per_s`` per second and take the seats first: seat ``i``
    frees at ``free_s[i]`` and then every ``service_s`` (as ``nth_free_seat``); the answer is
    the first free time ``t`` with more than ``n + overtake_per_s * t`` seats freed by then
    (``k``, 0-based, of the free times in order, with ``k >= n + overtake_per_s * t``).
    ``inf`` when no such time comes within ``SEAT_HORIZON_S``. Equal to ``nth_free_seat``
    at ``overtake_per_s`` 0. Cost: ``O(k log len(free_s))``.

    Raises:
        ValueError: no seat, ``service_s`` not > 0, ``n`` < 0 or ``overtake_per_s`` < 0.
    """
    if not free_s or not service_s > 0 or n < 0 or overtake_per_s < 0:
        raise ValueError(
            f"need seats, service_s > 0, n >= 0 and overtake_per_s >= 0, got {free_s}, "
            f"{service_s}, {n}, {overtake_per_s}"
        )
    heap = list(free_s)
    heapq.heapify(heap)
    k = 0
    while True:
        t = heapq.heappop(heap)
        if t > SEAT_HORIZON_S:
            return math.inf
        if k >= n + overtake_per_s * t:
            return t
        k += 1
        heapq.heappush(heap, t + service_s)
