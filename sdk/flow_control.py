"""Client-side flow control: a concurrency limiter (optionally AIMD-adaptive) and a rate limiter.

``ConcurrencyLimiter``: every HTTP attempt of a client holds one slot from sending the request
until its response is read or its stream closed, so the server never sees more than the limit
of requests of this client at once. A slot is released in a ``finally`` (also on
cancellation), so a cancelled call never leaks one. (anyio's ``CapacityLimiter`` has one FIFO
queue; this one serves retries first, see the class.)

Adaptive mode applies AIMD (additive increase, multiplicative decrease; Jacobson, "Congestion
Avoidance and Control", SIGCOMM 1988): a 429 multiplies the limit by ``decrease_factor`` (once
per "window": only a request admitted after the previous decrease can shrink it again, so one
burst of 429s counts once), and every ``limit`` successes add one slot, up to
``max_concurrency``. A 429 stating its wait (``retry-after-ms`` / ``Retry-After``) also holds
every new attempt until it has passed, and the limit probes up again only after it: successes
during the wait, or of requests admitted before the decrease, do not count. Lowering the limit never interrupts requests in flight; it only delays new
ones.

``RateLimiter`` paces requests/min and tokens/min with debt-based token buckets: a caller takes
its cost at once (the level may go negative) and sleeps until the level would have been >= 0,
so callers are served first come, first served without holding a lock while they sleep. A
call that never reached the server (cancelled while it waited, or failed before sending) gets
its charge back: waiting in a client-side limiter costs nothing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

__all__ = ["ConcurrencyLimiter", "RateLimit", "RateLimiter", "Slot", "Charge"]


@dataclass(slots=True, eq=False)
class Slot:
    """One held concurrency slot (hashed by identity); ``epoch``: the limiter's decrease count
    at admission."""

    epoch: int
    released: bool = False


class _Waiter:
    """A call queued for a slot; ``granted`` once the slot is its own."""

    __slots__ = ("slot", "event", "granted")

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.event = anyio.Event()
        self.granted = False


class ConcurrencyLimiter:
    """At most ``limit`` slots held at once (see the module docstring).

    Waiting calls are served first come, first served, except that a retry (``acquire(retry=
    True)``: an attempt after a failed one) goes before every first attempt: a rejected call
    waits for a slot like everyone else, but calls queued behind it cannot starve it of its
    retries. So the attempts in flight never exceed the current limit, retries included: after
    a decrease, a crowd of rejected calls does not come back at once to meet 429s again (each
    of which would spend one of their retries).

    Args:
        max_concurrency: the ceiling (and starting limit), >= 1.
        adaptive: enable AIMD on 429s.
        min_concurrency: floor of the adaptive limit, >= 1.
        decrease_factor: multiplicative decrease on a 429, in (0, 1).
        clock: monotonic seconds (injectable for tests).
        sleep: ``async (seconds)`` (injectable for tests).

    In adaptive mode a 429 that carries a wait hint (``Retry-After`` / ``retry-after-ms``) also
    sets a shared cool-down: no attempt of this client starts before it ends, so the requests
    queued behind the limiter do not spend their retries hammering a server that already said
    when to come back.

    Raises:
        ValueError: bad bounds.
    """

    def __init__(
        self,
        max_concurrency: int,
        *,
        adaptive: bool = False,
        min_concurrency: int = 1,
        decrease_factor: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = anyio.sleep,
    ) -> None:
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if not 1 <= min_concurrency <= max_concurrency:
            raise ValueError("min_concurrency must be in [1, max_concurrency]")
        if not 0.0 < decrease_factor < 1.0:
            raise ValueError("decrease_factor must be in (0, 1)")
        self.max_concurrency = max_concurrency
        self.min_concurrency = min_concurrency
        self.adaptive = adaptive
        self.decrease_factor = decrease_factor
        self._limit = max_concurrency
        self._in_flight = 0
        self._retries: deque[_Waiter] = deque()
        self._firsts: deque[_Waiter] = deque()
        self._epoch = 0
        self._successes = 0
        self._clock = clock
        self._sleep = sleep
        self._resume_at = 0.0

    @property
    def limit(self) -> int:
        """The current in-flight limit (== ``max_concurrency`` unless adaptive)."""
        return self._limit

    @property
    def in_flight(self) -> int:
        """Slots held now."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Calls queued for a slot now."""
        return len(self._retries) + len(self._firsts)

    async def acquire(self, *, retry: bool = False) -> Slot:
        """Wait for the end of any cool-down, then for a free slot, and take it.

        ``retry``: this is a retry of a call (served before first attempts). Cancelled while
        waiting, the call leaves the queue and holds nothing.
        """
        while (delay := self._resume_at - self._clock()) > 0:
            await self._sleep(delay)
        if self._in_flight < self._limit and not self._retries and not self._firsts:
            self._in_flight += 1
            return Slot(self._epoch)
        waiter = _Waiter(Slot(self._epoch))
        queue = self._retries if retry else self._firsts
        queue.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release(waiter.slot)  # granted as it was cancelled: pass it on
            else:
                queue.remove(waiter)
            raise
        return waiter.slot

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back (idempotent) and admit the next waiting call, if any."""
        if not slot.released:
            slot.released = True
            self._in_flight -= 1
            self._admit()

    def _admit(self) -> None:
        while self._in_flight < self._limit and (self._retries or self._firsts):
            waiter = (self._retries or self._firsts).popleft()
            waiter.granted = True
            waiter.slot.epoch = self._epoch
            self._in_flight += 1
            waiter.event.set()

    def on_overload(self, slot: Slot, retry_after: float | None = None) -> None:
        """A request admitted as ``slot`` got a 429: shrink the limit (adaptive mode) and, when
        the server said how long to wait (``retry_after`` seconds), hold new attempts that long."""
        if not self.adaptive:
            return
        if retry_after is not None and retry_after > 0:
            self._resume_at = max(self._resume_at, self._clock() + retry_after)
        if slot.epoch != self._epoch:
            return
        self._epoch += 1
        self._successes = 0
        self._set(max(self.min_concurrency, math.floor(self._limit * self.decrease_factor)))

    def on_success(self, slot: Slot | None = None) -> None:
        """A request (admitted as ``slot``) succeeded: grow the limit by one every ``limit``
        successes (adaptive). No probing up before the server's stated wait has passed: a
        success during a cool-down, or of a request admitted before the last decrease (it
        says nothing about the new limit), does not count."""
        if not self.adaptive or self._limit >= self.max_concurrency:
            return
        if self._clock() < self._resume_at:
            return
        if slot is not None and slot.epoch != self._epoch:
            return
        self._successes += 1
        if self._successes >= self._limit:
            self._successes = 0
            self._set(self._limit + 1)

    def _set(self, limit: int) -> None:
        self._limit = limit
        self._admit()


@dataclass(slots=True)
class RateLimit:
    """A client-side rate limit.

    Args:
        requests_per_minute: attempts started per minute (None: unlimited).
        tokens_per_minute: prompt + completion tokens per minute (None: unlimited). A request
            is charged an estimate up front (prompt characters / 4 + ``max_tokens``, default
            256 completion tokens) and corrected by its reported ``usage.total_tokens``.
        burst_seconds: bucket depth in seconds of rate (at least one request / one token): how
            much may go at once after idling. The default 0 paces evenly (one request per
            ``60 / requests_per_minute`` s): it leaves the server's own burst allowance free to
            absorb network jitter, where a client burst would spend it and meet 429s.

    Raises:
        ValueError: a non-positive rate or a negative burst.
    """

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    burst_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 or None, got {v!r}")
        if not self.burst_seconds >= 0:
            raise ValueError(f"burst_seconds must be >= 0, got {self.burst_seconds!r}")


@dataclass(slots=True, eq=False)
class Charge:
    """What one ``RateLimiter.acquire`` took: requests and estimated tokens."""

    requests: float = 0.0
    tokens: float = 0.0
    refunded: bool = False


class TokenBucket:
    """A token bucket: ``capacity`` tokens, refilled at ``rate`` tokens per second; the level
    may go negative (a debt repaid by refill). The project's one bucket: the SDK's
    ``RateLimiter`` paces with ``charge`` (take now, wait out the debt), the gateway's per-key
    limits admit or refuse with ``take``.

    Times are monotonic seconds; ``now`` defaults to ``time.monotonic()`` (pass the caller's
    clock to keep one time base).
    """

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, capacity: float, rate: float, now: float | None = None) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.stamp = time.monotonic() if now is None else now

    def _refill(self, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, n: float, now: float | None = None) -> float:
        """Take ``n`` tokens and return 0.0 when available, else return the seconds until they
        are (nothing taken). A cost above the capacity passes when the bucket is full (and
        empties it), so an oversized request is slowed, never refused forever."""
        self._refill(now)
        need = min(n, self.capacity)
        if self.level >= need:
            self.level -= n
            return 0.0
        return (need - self.level) / self.rate

    def charge(self, n: float, now: float | None = None) -> float:
        """Take ``n`` tokens even if that leaves a debt (negative ``n`` gives tokens back);
        return the seconds until the debt is repaid (0.0 without one)."""
        self._refill(now)
        self.level -= n
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def adjust(self, delta: float) -> None:
        """Charge ``delta`` more tokens (negative: refund, capped at the capacity) now."""
        self.level = min(self.capacity, self.level - delta)


class RateLimiter:
    """Paces attempts to a ``RateLimit`` (see the module docstring).

    Args:
        limit: the rates.
        clock: monotonic seconds (injectable for tests).
        sleep: ``async (seconds) -> None`` (injectable for tests).
    """

    def __init__(
        self,
        limit: RateLimit,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = anyio.sleep,
    ) -> None:
        self.limit = limit
        self._clock = clock
        self._sleep = sleep
        now = clock()
        self._requests = self._tokens = None
        if limit.requests_per_minute is not None:
            rate = limit.requests_per_minute / 60.0
            self._requests = TokenBucket(max(1.0, rate * limit.burst_seconds), rate, now)
        if limit.tokens_per_minute is not None:
            rate = limit.tokens_per_minute / 60.0
            self._tokens = TokenBucket(max(1.0, rate * limit.burst_seconds), rate, now)

    async def acquire(self, tokens: int = 0) -> Charge:
        """Wait until one more request costing ``tokens`` (estimated tokens) may start.

        Returns the ``Charge`` taken (hand it to ``refund`` if the request is then not sent).
        Cancelled while it waits, the call is refunded before the cancellation propagates.
        """
        now = self._clock()
        wait = 0.0
        charge = Charge()
        if self._requests is not None:
            wait = self._requests.charge(1.0, now)
            charge.requests = 1.0
        if self._tokens is not None and tokens > 0:
            wait = max(wait, self._tokens.charge(float(tokens), now))
            charge.tokens = float(tokens)
        if wait > 0:
            try:
                await self._sleep(wait)
            except BaseException:
                self.refund(charge)
                raise
        return charge

    def refund(self, charge: Charge) -> None:
        """Give back a charge whose request never reached the server (idempotent)."""
        if charge.refunded:
            return
        charge.refunded = True
        if self._requests is not None and charge.requests:
            self._requests.adjust(-charge.requests)
        if self._tokens is not None and charge.tokens:
            self._tokens.adjust(-charge.tokens)

    def correct(self, estimated: int, actual: int) -> None:
        """Replace a request's estimated token charge by its ``actual`` usage."""
        if self._tokens is not None:
            self._tokens.adjust(actual - estimated)


def estimate_tokens(body: dict[str, Any]) -> int:
    """Rough token cost of a request body: prompt characters / 4 + max output tokens.

    Four characters per token is the usual English rule of thumb for BPE tokenizers
    (OpenAI, "What are tokens and how to count them").
    """
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) if isinstance(p, str) else 4 for p in prompt)
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(str(part.get("text", ""))) for part in content if isinstance(part, dict)
            )
    out = body.get("max_completion_tokens") or body.get("max_tokens") or 256
    n = body.get("n") or 1
    try:
        return int(chars / 4) + max(0, int(out)) * max(1, int(n))
    except (TypeError, ValueError):  # malformed counts: the server will say so
        return int(chars / 4) + 256
