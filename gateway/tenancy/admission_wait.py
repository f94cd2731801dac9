"""When a refused request will be admitted: the predicted wait behind a ``Retry-After``, and
the places promised to the requests told to come back.

Two parts:

* ``EngineWait`` (local mode): the engine's rates turned into waits, by
  ``engine.load_model.estimate_ttft`` on the engine's ``stats()`` (queued prefill tokens,
  running decodes, measured prefill / decode rates, requests finished per second).
  ``departure_s(n)`` is the predicted time until ``n`` more requests of the queue (first come,
  first served) have their first token: the admission queue (which holds a request until its
  first token) then has ``n`` places free. ``extra_s(requests, tokens)`` is the time that much
  more queued work adds to a new request's first token. Every wait is scaled by ``scale``,
  the measured ratio of admitted requests' actual first-token waits to the engine's
  predictions for them (``observe``, an EWMA of weight ``alpha``). Off by default
  (``alpha=0``: ``scale`` stays 1): ``alpha=0.1`` made the waits worse (docs/admission.md,
  "Calibration"): one ratio learnt mostly from short predictions misjudges long ones.
* ``Promises``: a refused request is told to come back after ``wait`` seconds; the server
  then holds its places for it. A place promised counts as taken for every later request (a
  newcomer does not take the place a returning client was promised: that would make the
  returning client meet a 429 again and every ``Retry-After`` a lie), and the returning
  request (recognised by its fingerprint: tenant, prompt tokens and choices) claims it from
  ``early_s`` before its time until ``grace`` after it. A promise nobody claims within its
  grace (``grace_s`` + ``grace_fraction`` x the wait: a client rounding ``Retry-After`` up to
  whole seconds is up to 1 s late) lapses and frees its places. A newcomer counts only the
  promises due between now and its own predicted first token (``held(within_s)``): one that
  leaves the queue before they are due takes nothing from them, so an idle server is never
  held idle for clients due later; and a promise past its time keeps nobody out (its client
  may never come back, and unclaimed promises once kept a full queue full: docs/admission.md),
  though it can still be claimed until it lapses. Promises are made only for waits predicted from measured
  rates (the engine's, or the measured hold time of a slot); a guess promises nothing.

So a crowd refused at once is told a spread of times, one departure apart, instead of one
time at which all of them meet the same single free place.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.engine.load_model import estimate_ttft, own_hold_s
from prefixgate.engine.protocol import EngineClient

PROMISE_HEADER = "x-prefixgate-promise-ms"
"""A 429's header when its ``Retry-After`` is promised (``Promises``): the milliseconds from now
until the promise lapses (the wait plus its grace). A proxy gateway relaying the 429 sends the
client's retry of the same request back to the upstream that answered it (``proxy.attempts``;
docs/serving.md, "A promise holds in proxy mode too")."""

MISS_WINDOW = 200  # admitted requests whose prediction misses the budget margin is read from
MISS_MIN = 20  # misses known before the margin counts
MISS_QUANTILE = 0.95  # the share of admitted budgets the margin aims to meet


class EngineWait:
    """Waits predicted from an engine's ``stats()`` (see the module docstring).

    Args:
        engine: the served engine (``stats()`` never blocks).
        max_num_seqs / max_num_batched_tokens: the engine's seats and step token budget.
    """

    def __init__(
        self,
        engine: EngineClient,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        alpha: float = 0.0,
        max_scale: float = 5.0,
    ):
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scale = 1.0  # actual / predicted first-token wait (EWMA over admitted requests)
        self._alpha = alpha
        self._max_scale = max_scale
        self._misses: deque[float] = deque(maxlen=MISS_WINDOW)  # actual - predicted, s
        self._holding = False  # inside one_snapshot()
        self._held: Mapping[str, Any] | None = None  # its snapshot, once read

    @contextlib.contextmanager
    def one_snapshot(self) -> Iterator[None]:
        """Within: every wait reads one ``stats()`` snapshot, taken at the first read, so one
        admission decision (``AdmissionController.admit``) sees one engine state: without it a
        decision read ``stats()`` up to eight times (each a fresh snapshot between engine
        steps), and a step ending part-way mixed two states in one Retry-After. Nested uses
        share the outer snapshot. The fast path of :meth:`predict_ttft` (nothing unseen, no
        overtaking) asks the engine's own ``predict_ttft``, as it always has."""
        if self._holding:
            yield
            return
        self._holding = True
        try:
            yield
        finally:
            self._holding, self._held = False, None

    def _stats(self) -> Mapping[str, Any]:
        """The engine's ``stats()``: the held snapshot inside :meth:`one_snapshot`."""
        if not self._holding:
            return self.engine.stats()
        if self._held is None:
            self._held = self.engine.stats()
        return self._held

    def observe(self, predicted_s: float, actual_s: float) -> None:
        """Fold one admitted request's first-token wait (``actual_s``) against the engine's
        prediction for it (``predicted_s``, uncalibrated) into ``scale`` (clamped to
        ``[1 / max_scale, max_scale]``). The engine's rates are its model time per step; what
        they leave out (the gaps between steps, the gateway's own work, a machine short of
        CPU) shows as this ratio, so every wait below is scaled by it."""
        if not 0 < predicted_s < math.inf or actual_s < 0:
            return
        self._misses.append(actual_s - predicted_s * self.scale)
        ratio = min(self._max_scale, max(1.0 / self._max_scale, actual_s / predicted_s))
        self.scale = (1 - self._alpha) * self.scale + self._alpha * ratio

    def margin_s(self) -> float:
        """How much later than predicted first tokens came: the ``MISS_QUANTILE`` of the
        last ``MISS_WINDOW`` admitted requests' (actual - predicted) first-token waits, at
        least 0; 0.0 until ``MISS_MIN`` are known. A TTFT budget is checked against the
        prediction plus this margin, so that the budgets admitted are met at that quantile
        (without it, too few budgets were met: docs/admission.md, "The miss margin")."""
        if len(self._misses) < MISS_MIN:
            return 0.0
        ordered = sorted(self._misses)
        return max(0.0, ordered[min(len(ordered) - 1, int(MISS_QUANTILE * len(ordered)))])

    def predict_ttft(
        self, tokens: int, queued: int = 0, queued_tokens: int = 0, tenant: str | None = None
    ) -> tuple[float, float] | None:
        """The engine's predicted first-token wait for a request of ``tokens`` arriving now:
        ``(calibrated, uncalibrated)`` seconds (``inf`` while every seat is taken and no
        request has finished yet), or ``None`` before the rates are measured and while every
        seat is taken by requests of which one's end is not known yet (``estimate_ttft``:
        fewer than ``OUTPUT_REST_MIN`` finished requests; no miss is then recorded either).

        ``queued`` / ``queued_tokens``: the requests (and their prompt tokens) the admission
        queue holds now. Those the engine does not show yet (``unseen``) count as waiting
        too: an admitted request reaches the engine only when its handler's task next runs
        and the engine thread takes it in, and in the first seconds of a flood every request
        admitted in between was judged on a queue without the others (docs/admission.md,
        "Unseen requests").

        ``tenant``: whose request; a tenant the engine's fair order serves after the others'
        new requests (``stats()``'s ``overtake_per_s``) waits for a seat behind them too."""
        overtake = self._overtake(tenant)
        if self.unseen(queued) <= 0 and not overtake:
            got = self.engine.predict_ttft(max(1, tokens))
        else:
            got = estimate_ttft(
                self._view(queued, queued_tokens),
                self.max_num_seqs,
                self.max_num_batched_tokens,
                max(1, tokens),
                overtake_per_s=overtake,
            )
        if got is None:
            return None
        return got * self.scale, got

    def _overtake(self, tenant: str | None) -> float:
        """Requests per second of others the engine serves before ``tenant``'s waiting ones
        (``stats()``'s ``overtake_per_s``; 0.0 for a tenant not in it, or no tenant)."""
        if tenant is None:
            return 0.0
        return float((self._stats().get("overtake_per_s") or {}).get(tenant, 0.0))

    def _view(self, queued: int, queued_tokens: int) -> dict[str, Any]:
        """The engine's ``stats()`` with the ``unseen`` requests of the admission queue
        (``queued`` requests of ``queued_tokens`` prompt tokens) counted as waiting, each of
        the queue's mean prompt."""
        stats = dict(self._stats())
        unseen = self.unseen(queued)
        if unseen > 0:
            mean = math.ceil(queued_tokens / max(1, queued))
            stats["num_waiting"] = int(stats.get("num_waiting", 0)) + unseen
            stats["queued_prefill_tokens"] = (
                int(stats.get("queued_prefill_tokens", 0)) + unseen * mean
            )
        return stats

    def unseen(self, queued: int) -> int:
        """How many of the admission queue's ``queued`` requests the engine's ``stats()`` do
        not show yet: ``queued`` less the engine's waiting and still-prefilling requests
        (``num_running - running_decodes``); 0 for an engine that does not report
        ``running_decodes``. A request whose first token the engine has made but its handler
        not yet read counts too: it is still in the admission queue."""
        stats = self._stats()
        if "running_decodes" not in stats:
            return 0
        prefilling = int(stats["num_running"]) - int(stats["running_decodes"])
        return max(0, queued - int(stats["num_waiting"]) - prefilling)

    def alone_s(self, tokens: int) -> float | None:
        """The calibrated first-token wait of a request of ``tokens`` on an idle engine
        (nothing running or queued): the part of any prediction no wait can remove; ``None``
        before the rates are measured."""
        stats = self._stats()
        idle = {**stats, "num_running": 0, "num_waiting": 0, "queued_prefill_tokens": 0}
        return self._estimate(idle, max(1, tokens))

    def own_hold_s(self, tokens: int, max_tokens: int | None) -> float | None:
        """Seconds a request of ``tokens`` prompt tokens and at most ``max_tokens`` output
        tokens holds a seat by its own size (``load_model.own_hold_s`` on the engine's
        ``stats()``), at most the mean service (``seat_service_s``), calibrated; ``None``
        when ``max_tokens`` is ``None`` or the engine has no seat schedule yet."""
        stats = self._stats()
        own = own_hold_s(stats, self.max_num_batched_tokens, max(1, tokens), max_tokens)
        service = stats.get("seat_service_s")
        if own is None or not service:
            return None
        return min(own, float(service)) * self.scale

    def _estimate(
        self,
        stats: Mapping[str, Any],
        tokens: int,
        overtake_per_s: float = 0.0,
        holds_s: Sequence[float] = (),
    ) -> float | None:
        got = estimate_ttft(
            stats,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            tokens,
            overtake_per_s=overtake_per_s,
            queued_holds_s=holds_s,
        )
        return None if got is None else got * self.scale

    def departure_s(self, n: int, tokens_per_request: float) -> float | None:
        """Seconds until ``n`` (>= 1) more queued requests have their first token, each of
        ``tokens_per_request`` prompt tokens (the queue's mean); ``None`` before the engine
        measured its rates. The ``n``-th departure is a request with ``n - 1`` requests of
        queued work ahead of it (those of the engine's queue, then the promised ones)."""
        stats = self._stats()
        tokens = max(1, math.ceil(tokens_per_request))
        ahead = {**stats, "num_waiting": n - 1, "queued_prefill_tokens": (n - 1) * tokens}
        return self._estimate(ahead, tokens)

    def extra_s(
        self,
        requests: int,
        tokens: int,
        own_tokens: int,
        queued: int = 0,
        queued_tokens: int = 0,
        tenant: str | None = None,
        max_tokens: int | None = None,
    ) -> float:
        """Seconds ``requests`` more queued requests of ``tokens`` prompt tokens in all add to
        the first token of a new request of ``own_tokens`` (0.0 when nothing is added or the
        rates are not measured), behind the admission queue's ``queued`` requests of
        ``queued_tokens`` (as ``predict_ttft``: the ones the engine does not show yet count;
        without them a crowd admitted at once left the engine's seats looking free, and the
        requests refused behind it were all told one wait instead of a spread); ``tenant``:
        the new request's, as ``predict_ttft``'s. ``max_tokens``: the output bound of each of
        the ``requests`` (they hold their seats by that size where it is shorter than the
        mean service, ``own_hold_s``); ``None``: the mean service."""
        if requests <= 0:
            return 0.0
        stats = self._view(queued, queued_tokens)
        own = max(1, own_tokens)
        overtake = self._overtake(tenant)
        now = self._estimate(stats, own, overtake)
        more = {
            **stats,
            "num_waiting": int(stats.get("num_waiting", 0)) + requests,
            "queued_prefill_tokens": int(stats.get("queued_prefill_tokens", 0)) + tokens,
        }
        holds: list[float] = []
        if max_tokens is not None:
            each = own_hold_s(
                stats, self.max_num_batched_tokens, max(1, tokens // requests), max_tokens
            )
            holds = [] if each is None else [each] * requests
        later = self._estimate(more, own, overtake, holds)
        if now is None or later is None or not math.isfinite(later - now):
            return 0.0
        return max(0.0, later - now)


@dataclass(slots=True)
class Promise:
    """Places held for a refused request until it comes back.

    Attributes:
        fingerprint: what identifies the returning request.
        due: monotonic time it was told to come back at.
        expires: monotonic time the places lapse if it has not.
        requests / tokens: the places (engine requests) and prompt tokens held.
        ahead: the departures its wait was predicted from (0: not from departures).
        rank: its place in line among the promises (monotonic time): the time its request
            was first told to come back at. A request refused again on its return keeps the
            rank of the promise it claimed, so it stays ahead of the promises due after it.
        slot_s: the length of the admission slot reserved for it at ``due``
            (``admission_slots``; 0: none). Back at its slot, it is admitted into it.
    """

    fingerprint: Hashable
    due: float
    expires: float
    requests: int
    tokens: int
    ahead: int = 0
    rank: float = 0.0
    slot_s: float = 0.0


SLOT_LATE_S = 1.0
"""How late after its admission slot's end a returning request is still admitted into it: a
client rounding ``Retry-After`` up to whole seconds is up to 1 s late. Later, its slot has
passed (others took what it reserved) and its budget is judged again (``Promises.in_slot``)."""


class Promises:
    """The places promised to refused requests (see the module docstring).

    Args:
        early_s: a request may claim its promise this long before it is due.
        grace_s / grace_fraction: a promise lapses ``grace_s + grace_fraction * wait`` after
            it is due.
        clock: monotonic seconds (injectable for tests; None: ``time.monotonic``, read at
            each call).
    """

    def __init__(
        self,
        early_s: float = 0.05,
        grace_s: float = 1.5,
        grace_fraction: float = 0.25,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.early_s = early_s
        self.grace_s = grace_s
        self.grace_fraction = grace_fraction
        self._clock = clock if clock is not None else _monotonic
        self._by_id: dict[int, Promise] = {}
        self._by_fingerprint: dict[Hashable, list[int]] = {}
        self._expiry: list[tuple[float, int]] = []  # heap of (expires, id)
        self._ids = itertools.count()
        self.requests = 0  # places held now
        self.tokens = 0  # their prompt tokens

    def __len__(self) -> int:
        self._expire()
        return len(self._by_id)

    def held(self, within_s: float | None = None, but: Hashable | None = None) -> tuple[int, int]:
        """``(requests, prompt tokens)`` held for returning requests: all of them, or with
        ``within_s`` those due within that many seconds from now, not before (a request
        admitted now that leaves the queue before a promise is due takes nothing from it;
        one already due keeps nobody out: its client may never come back). ``but``: a
        fingerprint whose own promises are not counted (an early return's places are not
        ahead of itself)."""
        self._expire()
        if within_s is None and (but is None or but not in self._by_fingerprint):
            return self.requests, self.tokens
        now = self._clock()
        until = math.inf if within_s is None else now + within_s
        since = -math.inf if within_s is None else now
        requests = tokens = 0
        for p in self._by_id.values():
            if since <= p.due <= until and (but is None or p.fingerprint != but):
                requests += p.requests
                tokens += p.tokens
        return requests, tokens

    def ranked_before(self, rank: float) -> tuple[int, int]:
        """``(requests, prompt tokens)`` of the promises ahead of ``rank`` in line (an earlier
        rank) whose clients are still to come back (due from ``early_s`` ago on, not lapsed):
        a returning request refused again keeps its rank, so a request due after it that
        comes back first does not take the place that was its."""
        self._expire()
        since = self._clock() - self.early_s
        requests = tokens = 0
        for p in self._by_id.values():
            if p.rank < rank and p.due >= since:
                requests += p.requests
                tokens += p.tokens
        return requests, tokens

    def promise(
        self,
        fingerprint: Hashable,
        wait_s: float,
        requests: int,
        tokens: int,
        ahead: int = 0,
        rank: float | None = None,
        slot_s: float = 0.0,
    ) -> None:
        """Hold ``requests`` places of ``tokens`` prompt tokens for ``fingerprint``, due in
        ``wait_s`` seconds (> 0), predicted from ``ahead`` departures; ``rank``: its place in
        line (``Promise.rank``; ``None``: its due time, a new request's); ``slot_s``: the
        admission slot reserved for it (``Promise.slot_s``)."""
        now = self._clock()
        due = now + wait_s
        expires = due + self.grace_s + self.grace_fraction * wait_s
        p = Promise(
            fingerprint,
            due,
            expires,
            requests,
            tokens,
            ahead,
            due if rank is None else rank,
            slot_s,
        )
        pid = next(self._ids)
        self._by_id[pid] = p
        self._by_fingerprint.setdefault(fingerprint, []).append(pid)
        heapq.heappush(self._expiry, (p.expires, pid))
        self.requests += requests
        self.tokens += tokens

    def claim(self, fingerprint: Hashable | None, early: bool = False) -> Promise | None:
        """The earliest due promise of ``fingerprint`` (removed: its places are the caller's),
        or ``None`` when it holds none that is due (from ``early_s`` before) and not lapsed.
        ``early``: the earliest one not lapsed, due or not (an early return admitted on its
        own merits gives back the places it was promised)."""
        ids = self._held_ids(fingerprint)
        if not ids:
            return None
        now = self._clock()
        due = [pid for pid in ids if early or self._by_id[pid].due - self.early_s <= now]
        if not due:
            return None
        pid = min(due, key=lambda i: self._by_id[i].due)
        return self._drop(pid)

    def in_slot(self, promise: Promise) -> bool:
        """Whether ``promise`` (claimed now) reserved an admission slot that is still open:
        ``slot_s`` > 0 and now no later than ``SLOT_LATE_S`` after the slot's end (``due +
        slot_s``). A request back in its slot is admitted into it; one back later is judged
        on its budget again, as a returning request (a nu2 pass: a client that gave up and
        sent the same body 3 s later claimed the promise within its grace and was admitted
        unchecked at a predicted 1.5-2.4 s against a 300 ms budget)."""
        if promise.slot_s <= 0:
            return False
        return self._clock() <= promise.due + promise.slot_s + SLOT_LATE_S

    def pending_s(self, fingerprint: Hashable | None) -> float | None:
        """Seconds from now until ``fingerprint``'s earliest promise not yet due (from
        ``early_s`` before) is due, or ``None`` when it holds none: a request that finds
        ``claim`` empty but this set came back before the time it was told (an early return,
        not a new request)."""
        ids = self._held_ids(fingerprint)
        if not ids:
            return None
        now = self._clock()
        waits = [self._by_id[pid].due - now for pid in ids]
        early = [w for w in waits if w > self.early_s]
        return min(early) if early else None

    def _held_ids(self, fingerprint: Hashable | None) -> list[int]:
        """The ids of ``fingerprint``'s promises not lapsed (expired ones dropped first)."""
        self._expire()
        if fingerprint is None:
            return []
        return self._by_fingerprint.get(fingerprint, [])

    def lapses_in(self, fingerprint: Hashable) -> float | None:
        """Seconds from now until the last of ``fingerprint``'s promises lapses (what a
        gateway pinning the request's retry to this upstream keeps the pin for), or None
        when it holds none."""
        self._expire()
        ids = self._by_fingerprint.get(fingerprint)
        if not ids:
            return None
        return max(self._by_id[pid].expires for pid in ids) - self._clock()

    def _drop(self, pid: int) -> Promise:
        p = self._by_id.pop(pid)
        ids = self._by_fingerprint[p.fingerprint]
        ids.remove(pid)
        if not ids:
            del self._by_fingerprint[p.fingerprint]
        self.requests -= p.requests
        self.tokens -= p.tokens
        return p

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, pid = heapq.heappop(self._expiry)
            if pid in self._by_id:
                self._drop(pid)


def _monotonic() -> float:
    """``time.monotonic()`` read through this module's ``time`` at each call (not bound once
    as a default argument), so that a clock put in its place (``prefixgate sim``'s virtual
    clock) is the one read."""
    return time.monotonic()
