"""Admission control: a bounded queue in front of the engine, answered with 429 beyond it.

A request is *queued* from the moment it is admitted until its first token (or its end):
that is the time it waits for a prefill slot. Two bounds hold the queue (vLLM and TGI call
this backpressure): the number of queued requests and the sum of their prompt tokens.
Beyond either, the request is refused at once with 429 and a ``Retry-After`` derived from
the current drain rate (requests leaving the queue per second, an exponentially weighted
moving average), instead of letting latency grow without bound. Requests are counted as
engine requests: an HTTP request of ``n`` choices over ``p`` prompts takes ``n * p`` places
(one body must not slip thousands of engine requests past the bound); one that could never
fit the bounds at all is bad input (400), not an overload to retry.

The queue bound is shared per tenant (the API key's name): a tenant's share of
``max_queued_requests`` is its weight over the weights of the tenants with requests queued
(itself included). When the queue is full, a tenant over its share gets the 429; a tenant
still within its share is admitted all the same, so one tenant's flood earns that tenant the
429s, not the others (the total may then pass the bound by at most the newcomers' shares).

A refused request that comes back when it was told claims the places promised to it
(``admission_wait.Promises``) and is admitted even when the queue (or the in-flight bound) is
still full because the engine drained slower than predicted, up to :data:`PROMISE_OVERFLOW`
of each bound more: the ``Retry-After`` it was told is kept, and the newcomers, who find the
queue over its bound, are told later times. Beyond that overflow it meets the bound and a new
time. A request refused on its TTFT budget (``ttft_budget``) is told the time of an admission
slot reserved for it (``admission_slots``); back at that slot it is admitted into it, its
budget not checked again: the slot was placed where its prediction is within the budget, after
the slots of the requests refused before it. A claimed promise of the queue bound has its
budget checked again. A slot is kept and stated up to :data:`MAX_SLOT_WAIT_S` (600 s), every
other wait up to :data:`MAX_RETRY_AFTER_S` (60 s); past its cap a wait is a guess and promises
nothing.

A request back *before* its promise is due (an early return: a client that capped the
Retry-After it was told, as the SDK and openai-python cap a hint at 60 s) is not a new
request. It is judged as a newcomer would be, its own promised places not counted ahead of it:
admitted now, it gives back the places it was promised (its slot, if it had one, stays
reserved and passes unused, as a slot whose client never comes back); refused, it is told the
time left on its earliest promise (``Retry-After``, the bound's error code, ``PROMISE_HEADER``
until its promises lapse) and takes no new slot, rank or promise, so its places are never held
twice.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Hashable
from typing import Literal, NoReturn

from prefixgate.gateway.http.errors import APIError, bad_request, too_many
from prefixgate.gateway.settings import AdmissionConfig
from prefixgate.gateway.tenancy.admission_slots import SlotSchedule
from prefixgate.gateway.tenancy.admission_wait import PROMISE_HEADER, EngineWait, Promises
from prefixgate.gateway.tenancy.slot_wait import SlotClock
from prefixgate.gateway.tenancy.ttft_budget import BUDGET_HEADER

MIN_RETRY_AFTER_S = 0.05
"""The shortest wait a 429 states (``retry-after-ms``; ``Retry-After`` rounds up to 1 s)."""
MAX_RETRY_AFTER_S = 60.0
"""The longest wait a prediction states (the queue bound, the in-flight bound, a budget
refusal without a slot): a longer prediction is no prediction."""
MAX_SLOT_WAIT_S = 600.0
"""The longest wait a budget refusal's admission slot is kept and stated for
(``admission_slots``). A slot is a reservation placed at the predicted drain, not a free
prediction: the request is admitted into it when it comes back, whatever the queue then holds,
so its time holds past :data:`MAX_RETRY_AFTER_S`. A slot later than this is not kept: the 429
states this cap (a guess) and promises nothing."""
MIN_SLOT_S = 1e-3
"""The shortest admission slot (seconds), where neither the prediction nor the queue's pace
is measured (``AdmissionController._slot_lengths``)."""
PROMISE_OVERFLOW = 0.5
"""A request claiming its promise passes the queue and in-flight bounds by up to this share of
each (``ceil``; at least one place), or by :data:`PROMISE_ERROR_SHARE` of the departures its
wait was predicted from where that is more: the stated wait is kept where the engine drained
slower than predicted, and the overflow stays bounded."""
PROMISE_ERROR_SHARE = 0.2
"""The drain a claimed promise's overflow absorbs, as a share of the departures its wait was
predicted from: a wait told from ``n`` departures is kept when the queue drained up to this
much slower than measured (``n`` told 10 s ahead at 30 requests/s: 60 places). The error of a
prediction grows with its horizon, so the overflow grows with it; a fixed one held only the
first second of waits (docs/admission.md, "Promise overflow")."""


class Ticket:
    """One admitted request's place in the queue; ``started()`` then ``done()`` (idempotent)."""

    __slots__ = (
        "_ctl",
        "tokens",
        "requests",
        "tenant",
        "_queued",
        "_done",
        "_t_start",
        "_slot",
        "predicted_ttft",
        "_raw_prediction",
        "_t_admit",
        "hold_s",
    )

    def __init__(
        self,
        ctl: AdmissionController,
        tokens: int,
        requests: int = 1,
        tenant: str | None = None,
        hold_s: float | None = None,
    ) -> None:
        self._ctl = ctl
        self.tokens = tokens
        self.requests = requests
        self.tenant = tenant
        self._queued = True
        self._done = False
        self._t_start: float | None = None
        self._slot = ctl.slots.take(requests)
        self.predicted_ttft: float | None = None  # seconds, calibrated, at admission
        self._raw_prediction: float | None = None  # the engine's own (calibration input)
        self._t_admit = time.monotonic()
        self.hold_s = hold_s  # seconds each of its requests holds a seat by its size, or None

    def started(self) -> None:
        """The request left the queue (its first token came out)."""
        if self._queued:
            self._queued = False
            self._t_start = time.monotonic()
            wait = self._ctl.wait
            if wait is not None and self._raw_prediction is not None:
                wait.observe(self._raw_prediction, self._t_start - self._t_admit)
            self._ctl._leave_queue(self.tokens, self.requests, self.tenant, self.hold_s)

    def set_eta(self, eta: Callable[[], float | None]) -> None:
        """The request can predict its own end: ``eta()`` is the seconds until it ends (from
        its progress), or None while it cannot tell. ``max_running``'s ``Retry-After`` then
        counts on it (``SlotClock.set_eta``) rather than on the hold time of past requests."""
        self._ctl.slots.set_eta(self._slot, eta)

    def done(self) -> None:
        """The request finished, failed or was aborted: release its place."""
        if self._done:
            return
        t_start = self._t_start
        self.started()
        self._done = True
        self._ctl.in_flight -= self.requests
        self._ctl.slots.give(self._slot)
        if t_start is not None:
            self._ctl._note_service(time.monotonic() - t_start)


# what one HTTP request's places are, by ``admit``'s ``unit``: how the 400 over the bound
# counts them, and what the client sends less of
_UNITS = {
    "completions": ("completions (prompts x n)", "send fewer prompts or a smaller n"),
    "embeddings": ("embeddings (one per input)", "send fewer inputs per request"),
}


class AdmissionController:
    """Counts queued requests and tokens; ``admit`` refuses with 429 over the bounds.

    Drain rate: EWMA (time constant ``tau_s`` seconds) of queue departures per second while
    the queue holds requests (an empty queue has nothing to drain: idle time does not count
    as slow draining, or the first burst after a quiet minute would be told to wait 60 s).
    ``Retry-After`` = queued requests / drain rate, in [1, 60] seconds (1 s when no rate is
    known yet). An EWMA that starts from 0 underestimates a steady rate r as
    ``r * (1 - exp(-t / tau))`` after t busy seconds, so the estimate is divided by that factor
    (the bias correction of Adam, Kingma & Ba 2015, in continuous time; t counted from at least
    1 s) — otherwise the first overload after start-up would be told to wait 60 s.

    A rate measured from a handful of departures is no estimate at all: after a quiet period
    of three sequential requests the EWMA held ~3 departures and a burst of 800 was told
    ``Retry-After: 60`` while the admitted work drained in 5-7 s. Until the EWMA holds
    ``min_departures`` (10) departures, the wait is estimated from the service instead
    (Little's law): queued requests x the recent per-request service time (first token to
    end, EWMA) / the concurrency the server runs them at (``concurrency``: the engine's
    ``max_num_seqs`` in local mode; else the most requests seen running at once), in
    [1, 60] s. The in-flight cap (``max_running``) tells instead when enough running requests
    are estimated to end (``slot_wait.SlotClock``: their ages against the recent time a
    request stays admitted; a request that predicts its own end, ``Ticket.set_eta``, counts by
    that: its tokens left over its token rate).
    """

    def __init__(
        self,
        config: AdmissionConfig | None = None,
        tau_s: float = 5.0,
        concurrency: int = 0,
        min_departures: float = 10.0,
    ) -> None:
        self.config = config or AdmissionConfig()
        self.queued_requests = 0
        self.queued_tokens = 0
        self._queued_unsized = 0  # queued requests of unknown size (``Ticket.hold_s`` None)
        self._queued_hold_s = 0.0  # the seconds the others hold their seats by their size
        self.in_flight = 0
        self.concurrency = concurrency
        self._tau = tau_s
        self._min_departures = min_departures
        self._rate = 0.0  # departures per second (EWMA, biased towards 0 while warming up)
        self._busy = 0.0  # seconds the queue has held requests (the EWMA's age)
        self._last = time.monotonic()
        self._service = 0.0  # seconds from first token to end (EWMA over requests)
        self._peak_running = 0
        self.slots = SlotClock()  # admitted requests' hold times: max_running's Retry-After
        self.tpot_s = 0.0  # seconds per output token of recent generations (EWMA; 0: unknown)
        self.queued_by_tenant: dict[str | None, int] = {}  # tenants with requests queued
        self._weights: dict[str | None, float] = {}
        self.wait: EngineWait | None = None  # the engine's predictions (local mode)
        self.promises = Promises()  # places held for refused requests told to come back
        self.budget_slots = SlotSchedule()  # admission slots of budget refusals

    def admit(
        self,
        prompt_tokens: int,
        requests: int = 1,
        param: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
        fingerprint: Hashable | None = None,
        budget_s: float | None = None,
        max_tokens: int | None = None,
        unit: Literal["completions", "embeddings"] = "completions",
    ) -> Ticket:
        """Take ``requests`` places in the queue (the engine requests of one HTTP request:
        its choices) for ``prompt_tokens`` prompt tokens in all; ``param`` names the field
        that asked for them (in the 400); ``tenant`` / ``weight``: whose places (see the
        module docstring: a tenant within its share passes a full queue); ``fingerprint``:
        what identifies this request when it comes back after a 429 (it then claims the
        places it was promised, ``admission_wait.Promises``; ``None``: nothing is promised);
        ``budget_s``: its TTFT budget in seconds (``ttft_budget``), or ``None``;
        ``max_tokens``: the most output tokens any of its engine requests may generate (the
        body's ``max_tokens`` / ``max_completion_tokens``, as the engine caps it), or ``None``
        where not given: a budget refusal's admission slot is spaced by that size where it is
        shorter than the recent mean (``_slot_lengths``); ``unit``: what the places are,
        ``"completions"`` (prompts x n) or ``"embeddings"`` (one per input), in the 400's
        words.

        Raises:
            TypeError / ValueError: ``max_tokens`` not an int >= 1 (or ``None``).
            APIError: 429 ``server_overloaded`` / ``ttft_budget_exceeded`` with
                ``Retry-After`` (the predicted wait until this request would be admitted, or
                for an early return the time left on its promise) over a bound; 400
                ``too_many_requests_in_body`` when ``requests`` alone exceeds a bound.
        """
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
                raise TypeError(f"max_tokens must be an int or None, got {max_tokens!r}")
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        # one engine state for the whole decision (``EngineWait.one_snapshot``; a stand-in
        # wait without it reads as it reads)
        hold = getattr(self.wait, "one_snapshot", None)
        with hold() if hold is not None else contextlib.nullcontext():
            return self._admit(
                prompt_tokens,
                requests,
                param,
                tenant,
                weight,
                fingerprint,
                budget_s,
                max_tokens,
                unit,
            )

    def _admit(
        self,
        prompt_tokens: int,
        requests: int,
        param: str | None,
        tenant: str | None,
        weight: float,
        fingerprint: Hashable | None,
        budget_s: float | None,
        max_tokens: int | None,
        unit: Literal["completions", "embeddings"] = "completions",
    ) -> Ticket:
        """``admit``'s decision, its arguments checked."""
        cfg = self.config
        limit = min(cfg.max_queued_requests, cfg.max_running or cfg.max_queued_requests)
        if requests > limit:
            asked, fewer = _UNITS[unit]
            raise bad_request(
                f"this request asks for {requests} {asked}; the server admits at most "
                f"{limit} at once: {fewer}",
                param=param,
                code="too_many_requests_in_body",
            )
        self._weights[tenant] = weight
        # A returning request claims its promise; a new one finds the promised places taken:
        # every promised request's work is ahead of it (``every``), and the places of those
        # due before it would leave the queue (``held``; see ``admission_wait``).
        promise = self.promises.claim(fingerprint)
        claimed = promise is not None
        # back before its promise is due (a client that capped the Retry-After it was told):
        # judged as a newcomer, but its own places are not ahead of it, and a refusal states
        # the time left on its promise instead of taking a new one
        early_s = None if claimed else self.promises.pending_s(fingerprint)
        own = fingerprint if early_s is not None else None
        ahead = promise.ahead if promise is not None else 0
        every, every_tokens = (0, 0) if claimed else self.promises.held(but=own)
        prediction = (
            self.wait.predict_ttft(prompt_tokens, self.queued_requests, self.queued_tokens, tenant)
            if self.wait is not None
            else None
        )
        held, held_tokens = (0, 0)
        if every:
            held, held_tokens = self.promises.held(prediction[0] if prediction else 0.0, own)
        rank = promise.rank if promise is not None else None
        refuse: Callable[..., NoReturn]
        if early_s is not None:
            refuse = functools.partial(self._restate, fingerprint, early_s)
        else:
            refuse = functools.partial(self._refuse, fingerprint, requests, prompt_tokens, rank)
        if budget_s is not None and not (promise is not None and self.promises.in_slot(promise)):
            # a newcomer: the work of the promised requests due within its budget is ahead
            # of it (one due later cannot delay a first token that comes within the budget:
            # an idle server is not held idle for clients due minutes later, who may never
            # come back); a returning request: the work of those ahead of it in line still
            # to come back. A request back at its admission slot (``admission_slots``) is
            # admitted into it; one back after its slot has passed is judged again
            # (``Promises.in_slot``).
            if promise is not None:
                ahead_requests, ahead_tokens = self.promises.ranked_before(promise.rank)
            else:
                ahead_requests, ahead_tokens = self.promises.held(budget_s, own)
            self._check_budget(
                budget_s,
                prediction,
                prompt_tokens,
                ahead_requests,
                ahead_tokens,
                refuse,
                requests,
                tenant,
                fingerprint is not None and early_s is None,  # an early return takes no slot
                max_tokens,
            )
        within_share = self._within_share(tenant, requests)
        # a returning request that claimed its promise passes each bound by the overflow
        slack_requests = _overflow(cfg.max_queued_requests, ahead) if claimed else 0
        # the token bound passes by the same share of itself as the request bound (at least
        # half of it, as slack_requests is at least half the request bound)
        slack_tokens = math.ceil(cfg.max_queued_tokens * slack_requests / cfg.max_queued_requests)
        slack_running = _overflow(cfg.max_running, ahead) if claimed and cfg.max_running else 0
        over = self.queued_requests + held + requests - cfg.max_queued_requests
        if over > slack_requests and not within_share:
            n = over + every - held
            wait = self._departures(n, every)
            if claimed:  # back past its overflow: the promises due before it returns go first
                for _ in range(2):
                    due = self.promises.held(wait[0])[0]
                    wait = self._departures(over + due, due)
                n = over + due
            refuse(
                self._queue_full_message(held),
                *wait,
                ahead=n,
            )
        # A single prompt larger than the token bound still passes when the queue is empty.
        if (
            self.queued_requests + held
            and self.queued_tokens + held_tokens + prompt_tokens
            > cfg.max_queued_tokens + slack_tokens
            and not within_share
        ):
            n = max(1, self.queued_requests + every - 1)
            refuse(
                f"server overloaded: {self.queued_tokens} prompt tokens already waiting; "
                "retry later",
                *self._departures(n, every),
                ahead=n,
            )
        running_over = self.in_flight + held + requests - cfg.max_running
        if cfg.max_running and running_over > slack_running:
            # Retry-After: when enough of the running requests are estimated to end
            n = running_over + every - held
            refuse(
                f"server overloaded: {self.in_flight} requests in flight "
                f"(max_running={cfg.max_running}); retry later",
                self.slots.wait(n),
                self.slots.hold_s > 0,  # from a measured hold time: a promise
                ahead=n,
            )
        if early_s is not None:  # an early return admitted now: its promise's places go back
            self.promises.claim(fingerprint, early=True)
        if not self.queued_requests:
            self._last = time.monotonic()  # a busy period starts: the idle time is skipped
        self.queued_requests += requests
        self.queued_tokens += prompt_tokens
        self.in_flight += requests
        self.queued_by_tenant[tenant] = self.queued_by_tenant.get(tenant, 0) + requests
        hold_s = self._own_service_s(prompt_tokens // max(1, requests), max_tokens)
        if hold_s is None:
            self._queued_unsized += requests
        else:
            self._queued_hold_s += requests * hold_s
        ticket = Ticket(self, prompt_tokens, requests, tenant, hold_s)
        if prediction is not None:
            ticket.predicted_ttft, ticket._raw_prediction = prediction
        return ticket

    def _queue_full_message(self, held: int) -> str:
        """The queue bound's 429 message: what it counts (requests waiting for their first
        token, places ``held`` for refused requests due back) against ``max_queued_requests``;
        a queue over the bound says what passed it (module docstring)."""
        bound = self.config.max_queued_requests
        waiting = f"{self.queued_requests} requests waiting for their first token"
        if held:
            waiting += f" and {held} places held for refused requests due back"
        if self.queued_requests > bound:
            waiting += (
                f", over max_queued_requests={bound} by requests admitted on a place promised "
                "to them or within their tenant's share"
            )
        else:
            waiting += f" (max_queued_requests={bound})"
        return f"server overloaded: {waiting}; retry later"

    def _refuse(
        self,
        fingerprint: Hashable | None,
        requests: int,
        tokens: int,
        rank: float | None,
        message: str,
        wait_s: float,
        predicted: bool,
        code: str = "server_overloaded",
        ahead: int = 0,
        slot_s: float = 0.0,
        cap_s: float = MAX_RETRY_AFTER_S,
    ) -> NoReturn:
        """Raise one request's 429 with ``Retry-After`` = ``wait_s`` (seconds, in
        [:data:`MIN_RETRY_AFTER_S`, ``cap_s``]: :data:`MAX_SLOT_WAIT_S` for an admission slot,
        else :data:`MAX_RETRY_AFTER_S`); a ``predicted`` wait
        (from measured rates, ``ahead`` departures) of a request that can be recognised on its
        return (``fingerprint``) is promised: its ``requests`` places and ``tokens`` are held
        for it until then (``Promises``; ``rank``: a claimed promise's place in line, kept by
        the next one; ``slot_s``: the admission slot reserved for it at ``wait_s``, which
        takes a new rank). A promised 429 says so in ``PROMISE_HEADER``: the milliseconds
        until the promise lapses. A guess is not promised."""
        wait_s = min(cap_s, max(MIN_RETRY_AFTER_S, wait_s))
        err = too_many(message, wait_s, code=code)
        if predicted and fingerprint is not None:
            self.promises.promise(
                fingerprint,
                wait_s,
                requests,
                tokens,
                max(0, ahead),
                None if slot_s else rank,
                slot_s,
            )
            self._say_promised(err, fingerprint)
        raise err

    def _restate(
        self,
        fingerprint: Hashable,
        left_s: float,
        message: str,
        wait_s: float,
        predicted: bool,
        code: str = "server_overloaded",
        ahead: int = 0,
        slot_s: float = 0.0,
        cap_s: float = MAX_RETRY_AFTER_S,
    ) -> NoReturn:
        """Raise the 429 of an early return: a request (``fingerprint``) back ``left_s``
        seconds before its earliest promise is due, over a bound now (``message``, ``code``:
        the bound's). Its ``Retry-After`` is ``left_s`` (at least :data:`MIN_RETRY_AFTER_S`)
        and ``PROMISE_HEADER`` the milliseconds until its promises lapse: the promise it holds,
        re-stated. Nothing new is promised or reserved (the bound's own wait, ``wait_s`` and
        the rest, is not used): a second promise would hold its places twice."""
        left_s = max(MIN_RETRY_AFTER_S, left_s)
        err = too_many(
            f"{message} (this request came back before the time it was told: its place is "
            f"held for it in {_ms(left_s)} ms)",
            left_s,
            code=code,
        )
        self._say_promised(err, fingerprint)
        raise err

    def _say_promised(self, err: APIError, fingerprint: Hashable) -> None:
        """Mark ``err`` (a 429) promised: ``PROMISE_HEADER`` = the milliseconds until
        ``fingerprint``'s promises lapse (none held: no header)."""
        lapses = self.promises.lapses_in(fingerprint)
        if lapses is not None and lapses > 0:
            err.headers[PROMISE_HEADER] = str(math.ceil(lapses * 1000))

    def _check_budget(
        self,
        budget: float,
        prediction: tuple[float, float] | None,
        prompt_tokens: int,
        held: int,
        held_tokens: int,
        refuse: Callable[..., NoReturn],
        requests: int = 1,
        tenant: str | None = None,
        promised: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        """Refuse when the predicted TTFT (the engine's, calibrated, plus the margin of recent
        misses and the promised places ``held`` ahead; or ``tenant``'s own queued requests at
        its own measured pace, when that is later) exceeds ``budget`` seconds; no prediction
        (proxy mode, rates not measured, no free seat and a running request's end not known):
        admit. A budget under what
        the request takes alone (its idle prediction and the margin) is the wait it accepts
        beyond that: refused while the queue ahead adds more. A budget under twice that
        accepts as much queue as the largest budget under it (what it takes alone), so that
        a larger budget is admitted wherever a smaller one is.

        A refused request that can be recognised on its return (``promised``) is told the
        time of an admission slot (``admission_slots.SlotSchedule``): the first free one once
        the queue, and its tenant's own queue, would be within the budget, one request's work
        and at least one departure long (``_slot_lengths``; by its own size, ``max_tokens``,
        where that is shorter than the mean), after the slots of those refused before it;
        kept up to :data:`MAX_SLOT_WAIT_S` from now."""
        if self.wait is None or prediction is None:
            return
        margin = self.wait.margin_s()  # how much later than predicted first tokens come
        extra = self.wait.extra_s(
            held, held_tokens, prompt_tokens, self.queued_requests, self.queued_tokens, tenant
        )
        predicted = prediction[0] + margin + extra
        schedule = self.budget_slots
        own = schedule.own_wait_s(tenant, self.queued_by_tenant.get(tenant, 0) + requests)
        if own is not None:
            predicted = max(predicted, own)
        if predicted <= budget:
            return
        # What the request would take alone no wait removes (its idle prediction and the
        # margin). A budget below that is read as the wait it accepts beyond it: the request
        # is admitted once the queue ahead adds no more than its budget, and refused while
        # it adds more. Admitting it at once instead (a 429 would send it back forever to an
        # idle server) switched budgets off whenever the margin was large: after one long
        # miss a 50 ms budget was admitted at a predicted 12.3 s (docs/admission.md, "A
        # budget no wait can meet"). A budget over that accepts no less queue than every
        # budget under it (up to ``alone``): else a budget just under ``alone`` accepted
        # almost ``alone`` of queue and one just over it almost none, and a larger budget was
        # refused where a smaller one was admitted.
        alone = (self.wait.alone_s(prompt_tokens) or 0.0) + margin
        accepted = min(budget, alone)  # the queue ahead a budget under 2 * alone accepts
        allowed, beyond = max(budget, alone + accepted), ""
        if allowed > budget:
            if predicted <= allowed:
                return
            beyond = (
                f"; it takes {_ms(alone)} ms alone, and is admitted once the queue ahead "
                f"adds no more than {_ms(accepted)} ms"
            )
        wait_s = predicted - allowed
        slot_s = 0.0
        if promised and math.isfinite(predicted):
            slot_s, own_slot_s = self._slot_lengths(requests, prompt_tokens, tenant, max_tokens)
            earliest = max(prediction[0] + margin, own or 0.0) - allowed
            wait_s = schedule.place(tenant, earliest, slot_s, own_slot_s, MAX_SLOT_WAIT_S)
            if wait_s > MAX_SLOT_WAIT_S:
                # past what a slot is kept for: none is kept (the capped Retry-After is not
                # its slot's time), and on its return it is judged again
                slot_s = 0.0
        # a slot is a reservation and is stated up to MAX_SLOT_WAIT_S; a wait without one
        # (nobody to keep it for) is a prediction, capped at MAX_RETRY_AFTER_S
        cap = MAX_SLOT_WAIT_S if promised and math.isfinite(predicted) else MAX_RETRY_AFTER_S
        refuse(
            f"the predicted time to first token ({_ms(predicted)} ms) exceeds this "
            f"request's budget ({_ms(budget)} ms, {BUDGET_HEADER}){beyond}; retry later",
            wait_s,
            # no time in sight, or a slot past the longest kept: a guess, no promise
            math.isfinite(predicted) and wait_s <= cap,
            code="ttft_budget_exceeded",
            slot_s=slot_s,
            cap_s=cap,
        )

    def _slot_lengths(
        self, requests: int, prompt_tokens: int, tenant: str | None, max_tokens: int | None = None
    ) -> tuple[float, float]:
        """``(slot_s, own_slot_s)``: the length in seconds of the admission slot of a budget
        refusal of ``requests`` engine requests of ``prompt_tokens`` (``SlotSchedule.place``),
        and of its tenant's own (the spacing of ``tenant``'s next slot). Needs ``self.wait``.

        A slot is the time this request's own work adds to the queue's prediction
        (``EngineWait.extra_s``), so that the slots admit no faster than the predicted work
        drains (the queue's first-come drain: the slots are every tenant's; a tenant served
        after the others spaces its own slots by what one more of its requests adds at its
        place, or by its own measured departures). Either is at least ``requests``
        departures at the queue's pace (``_departure_s``): behind running requests that end
        together one more request adds nothing to the prediction (it takes a seat freed at
        that moment), and slots without that floor were all placed on that one moment,
        more of them than the seats it frees (docs/admission.md, "A slot is at least one
        departure").

        ``max_tokens`` (the request's output bound; ``None``: not given): its work, and the
        seat it holds in the departure floor, are its own size where that is shorter than
        the mean (``EngineWait.extra_s``, ``_own_service_s``): short requests refused behind
        long answers were spaced at the long answers' mean seat time (docs/admission.md, "A
        queued request's own size")."""
        assert self.wait is not None
        own_s = self._own_service_s(prompt_tokens // max(1, requests), max_tokens)
        floor = max(self._departure_s(requests, own_s), MIN_SLOT_S)
        queue = (requests, prompt_tokens, prompt_tokens, self.queued_requests)
        slot_s = max(self.wait.extra_s(*queue, self.queued_tokens, max_tokens=max_tokens), floor)
        own_rate = self.budget_slots.tenant_rate(tenant)
        own_slot_s = max(
            requests / own_rate if own_rate else 0.0,
            self.wait.extra_s(*queue, self.queued_tokens, tenant, max_tokens=max_tokens),
            floor,
        )
        return slot_s, own_slot_s

    def _own_service_s(self, prompt_tokens: int, max_tokens: int | None) -> float | None:
        """Seconds one request of ``prompt_tokens`` and at most ``max_tokens`` output tokens
        holds its seat by its own size: the engine's estimate (``EngineWait.own_hold_s``,
        local mode), else ``max_tokens`` at the recent seconds per output token
        (``tpot_s``); ``None`` when ``max_tokens`` is ``None`` or neither is measured."""
        if max_tokens is None:
            return None
        if self.wait is not None:
            got = self.wait.own_hold_s(prompt_tokens, max_tokens)
            if got is not None:
                return got
        return max_tokens * self.tpot_s if self.tpot_s > 0 else None

    def _departure_s(self, requests: int, own_s: float | None = None) -> float:
        """Seconds ``requests`` departures of the queue take at its pace: the longer of the
        measured drain rate's (once warm) and the service-time estimate's (``retry_after``'s:
        the recent service time over the concurrency, the pace running requests free their
        seats at; ``own_s``: the seconds each of these requests holds its seat by its own
        size, where that is shorter than the recent service time); 0.0 while neither is
        measured.

        The drain rate counts departures per second the queue held requests: a batch that
        leaves the queue at once into free seats is measured as departing at once, faster
        than a full server frees seats (docs/admission.md, "A slot is at least one
        departure")."""
        service = self._service if own_s is None else min(self._service, own_s)
        return self._paced(requests, requests * service / self._seats)

    @property
    def _seats(self) -> int:
        """The concurrency running requests free their seats at (at least one)."""
        return max(1, self.concurrency or self._peak_running)

    def _paced(self, n: int, seats_s: float) -> float:
        """``n`` departures at the queue's pace: the seats' ``seats_s``, no faster than the
        measured drain rate once warm."""
        if self._drain_warm:
            return max(n / self.drain_rate, seats_s)
        return seats_s

    def _queue_departure_s(self, n: int, promised: int = 0) -> float:
        """Seconds ``n`` departures of the queue and its ``promised`` places take at its pace
        (``_departure_s``), the queued requests costed by their own size where every one of
        them has one (``Ticket.hold_s``) and their mean is shorter than the recent service
        time: the first ``concurrency`` departures take the seats the running requests free
        (at the recent service time), the rest those the queued requests free (their mean
        size; a promised place, of unknown size, the service time); as ``_departure_s``
        where a queued request's size is unknown (proxy mode before a token rate is
        measured, a body without a bound)."""
        queued = self.queued_requests
        if self._queued_unsized > 0 or queued <= 0 or n <= 0:
            return self._departure_s(n)
        pace = (self._queued_hold_s + promised * self._service) / (queued + promised)
        if pace >= self._service:
            return self._departure_s(n)
        running = self._seats
        first = min(n, running)
        return self._paced(n, (first * self._service + (n - first) * pace) / running)

    def _departures(self, n: int, held: int) -> tuple[float, bool]:
        """Seconds until ``n`` places of the queue are free, and whether that is predicted
        from measured rates: the engine's prediction of ``n`` departures (local mode, rates
        measured), else the drain-rate estimate of the queue and the promised places
        (``retry_after``)."""
        if self.wait is not None:
            if self._drain_warm:
                # the queue's measured drain, once warm: departures are what it counts. The
                # engine's rates are its model time per step and leave out the gaps between
                # steps, the gateway's work and a machine short of CPU (returning clients met
                # the bound again); for hundreds of departures its model overshot instead
                # (docs/admission.md, "The queue bound's wait"). No faster than the seats'
                # pace: a batch that left the queue at once into free seats is measured as
                # departing at once (``_departure_s``); the queued requests at their own size
                # (``_queue_departure_s``)
                return self._queue_departure_s(n, held), True
            queued = self.queued_requests + held
            mean = (self.queued_tokens + self.promises.tokens) / max(1, queued)
            got = self.wait.departure_s(n, mean)
            if got is not None and math.isfinite(got):
                return got, True
        return self.retry_after(held), False

    def note_tpot(self, seconds: float, alpha: float = 0.3) -> None:
        """One generation's measured seconds per output token (after its first token): kept
        as an EWMA (``tpot_s``) that a request too young to measure its own rate predicts its
        end by (``Exchange.eta_s``)."""
        if seconds > 0:
            self.tpot_s = (
                seconds if not self.tpot_s else (1 - alpha) * self.tpot_s + alpha * seconds
            )

    def _within_share(self, tenant: str | None, requests: int) -> bool:
        """True when ``tenant`` holding ``requests`` more places stays within its weighted
        share of ``max_queued_requests`` among the tenants with requests queued (itself
        included). With a single tenant there is nobody to be fair to: False."""
        present = {t for t, n in self.queued_by_tenant.items() if n > 0}
        if not present - {tenant}:
            return False
        present.add(tenant)
        total = sum(self._weights.get(t, 1.0) for t in present)
        share = self.config.max_queued_requests * self._weights.get(tenant, 1.0) / total
        return self.queued_by_tenant.get(tenant, 0) + requests <= share

    def retry_after(self, held: int = 0) -> float:
        """Seconds until the current queue (and ``held`` promised places) has drained, within
        ``[1, 60]``: its departures at the queue's pace (``_departure_s``: the measured drain
        rate once it holds ``min_departures`` departures, never faster than the seats' pace
        from the service-time estimate; see class), the queued requests at their own size
        where every one has one (``_queue_departure_s``)."""
        return min(60.0, max(1.0, self._queue_departure_s(self.queued_requests + held, held)))

    def _note_service(self, seconds: float) -> None:
        self._service = seconds if self._service == 0.0 else 0.7 * self._service + 0.3 * seconds

    @property
    def _drain_warm(self) -> bool:
        """True once the drain rate's EWMA holds ``min_departures`` departures (an estimate)."""
        return self._rate * self._tau >= self._min_departures

    @property
    def drain_rate(self) -> float:
        """Queue departures per second (EWMA, bias-corrected for its age)."""
        self._decay(time.monotonic())
        warm = 1.0 - math.exp(-max(self._busy, 1.0) / self._tau)
        return self._rate / warm

    def _leave_queue(
        self,
        tokens: int,
        requests: int = 1,
        tenant: str | None = None,
        hold_s: float | None = None,
    ) -> None:
        self._decay(time.monotonic())  # over the busy interval that ends here
        self.queued_requests -= requests
        self.queued_tokens -= tokens
        if hold_s is None:
            self._queued_unsized -= requests
        else:
            self._queued_hold_s = max(0.0, self._queued_hold_s - requests * hold_s)
        if not self.queued_requests:
            self._queued_hold_s = 0.0  # no drift of the float sum past an empty queue
        left = self.queued_by_tenant.get(tenant, 0) - requests
        if left > 0:
            self.queued_by_tenant[tenant] = left
        else:
            self.queued_by_tenant.pop(tenant, None)
        self._rate += requests / self._tau  # each departure's impulse on the EWMA of a rate
        self.budget_slots.departed(tenant, requests)
        self._peak_running = max(self._peak_running, self.in_flight - self.queued_requests)

    def _decay(self, now: float) -> None:
        dt = now - self._last
        if dt > 0:
            if self.queued_requests:  # the queue is unchanged since ``_last``
                self._rate *= math.exp(-dt / self._tau)
                self._busy += dt
            self._last = now


def _overflow(bound: int, ahead: int = 0) -> int:
    """Places a claimed promise, told from ``ahead`` departures, may pass ``bound`` by
    (:data:`PROMISE_OVERFLOW`, :data:`PROMISE_ERROR_SHARE`)."""
    return max(1, math.ceil(PROMISE_OVERFLOW * bound), math.ceil(PROMISE_ERROR_SHARE * ahead))


def _ms(seconds: float) -> str:
    return "inf" if not math.isfinite(seconds) else f"{seconds * 1000:.0f}"
