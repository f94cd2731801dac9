"""Retry policy: which failures are retried and how long to wait before each retry.

Retried: connection errors and timeouts (``APIConnectionError``, ``APITimeoutError``) and the
statuses 408, 409, 429 and >= 500. Every other 4xx is final, and so is a 429 whose error code
is in ``FINAL_CODES`` (a quota that no short wait clears). A server may override with the
``x-should-retry: true|false`` header (the convention of OpenAI's API and SDKs).

A *promised* 429 (prefixgate's ``x-prefixgate-promise-ms`` header, ``PROMISE_HEADER``: the
server holds a place for this request at its ``Retry-After``) whose hint is longer than
``max_retry_after`` is final too: a retry after the capped wait would come back before the
promised time and be refused again for sure. It is raised at once, its ``retry_after`` the
server's full hint (seconds), so the caller can send the same request again then and claim
the place held for it. A hint over the cap without that header keeps the capped wait below.

With ``adaptive_concurrency`` a 429 is flow control, not a fault: the client's AIMD limit
answers it, and it is retried without spending ``max_retries`` while the call is younger than
``max_retry_after`` seconds (so a crowd of calls finding the server's capacity never exhausts
its retries; past that age 429s count again, so a server that never recovers still ends the
call).

Wait before retry ``k`` (k = 1, 2, ...):

* the server's hint when it sent one: ``retry-after-ms`` (milliseconds), else ``Retry-After``
  as delta-seconds or an HTTP date (RFC 9110 section 10.2.3), capped at ``max_retry_after``;
* else exponential backoff with *full jitter*: ``uniform(0, min(max_delay, initial_delay *
  2 ** (k - 1)))`` (Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015),
  which spreads a crowd of clients rejected together over the whole window.

The loop itself is tenacity's ``AsyncRetrying`` with ``RetryPolicy.wait`` as its wait strategy;
``sleep``, ``clock`` and ``rng`` are injectable so tests assert the computed waits without
real time.
"""

from __future__ import annotations

import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import tenacity
from tenacity.wait import wait_base

from .errors import APIConnectionError, APIStatusError

__all__ = ["RetryPolicy", "parse_retry_after", "should_retry", "RETRY_STATUSES"]

logger = logging.getLogger("prefixgate.sdk")

RETRY_STATUSES = frozenset({408, 409, 429})
PROMISE_HEADER = "x-prefixgate-promise-ms"
"""A prefixgate 429's header when its ``Retry-After`` is promised: milliseconds until the
place held for the request lapses."""
# 429s that retrying within seconds cannot clear: prefixgate's pinned-prefix space is full until
# prefixes are deleted or expire (its Retry-After is the TTL), and OpenAI's exhausted quota.
FINAL_CODES = frozenset({"prefix_limit_exceeded", "insufficient_quota"})


def parse_retry_after(headers: Mapping[str, str], now: float) -> float | None:
    """Seconds the server asked the client to wait, or None.

    Args:
        headers: response headers (case-insensitive mapping such as ``httpx.Headers``).
        now: the current Unix time (seconds), used for an HTTP-date ``Retry-After``.

    ``retry-after-ms`` (float milliseconds) wins over ``Retry-After``; negative or unparsable
    values are ignored; a date in the past gives 0.
    """
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            ms = float(raw_ms)
        except ValueError:
            ms = -1.0
        if ms >= 0 and ms == ms:  # not NaN
            return ms / 1000.0
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        seconds = float(raw)
    except ValueError:
        seconds = None
    if seconds is not None:
        return seconds if seconds >= 0 and seconds == seconds else None
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - now)


def should_retry(exc: BaseException) -> bool:
    """True when ``exc`` is a failure worth another attempt (see the module docstring)."""
    if isinstance(exc, APIStatusError):
        hint = exc.response.headers.get("x-should-retry")
        if hint == "true":
            return True
        if hint == "false":
            return False
        if exc.code in FINAL_CODES:
            return False
        return exc.status_code in RETRY_STATUSES or exc.status_code >= 500
    return isinstance(exc, APIConnectionError)


@dataclass(slots=True)
class RetryPolicy:
    """How often and how long to retry.

    Args:
        max_retries: retries after the first attempt (0 disables retrying).
        initial_delay: backoff base, seconds (the first window is ``[0, initial_delay]``).
        max_delay: cap of the backoff window, seconds.
        max_retry_after: cap on a server's ``Retry-After`` hint, seconds (a promised 429's
            hint over it ends the call at once: module docstring).
        sleep: ``async (seconds) -> None`` used between attempts (default ``anyio.sleep``).
        clock: ``() -> Unix seconds`` used for HTTP-date ``Retry-After`` (default ``time.time``).
        rng: random source of the jitter.

    Raises:
        ValueError: a negative count or delay.
    """

    max_retries: int = 2
    initial_delay: float = 0.5
    max_delay: float = 8.0
    max_retry_after: float = 60.0
    sleep: Callable[[float], Awaitable[Any]] = anyio.sleep
    clock: Callable[[], float] = time.time
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        for name in ("initial_delay", "max_delay", "max_retry_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def compute_wait(self, retry_number: int, exc: BaseException | None) -> float:
        """Seconds to wait before retry ``retry_number`` (1-based) after failure ``exc``."""
        if isinstance(exc, APIStatusError):
            hint = self._hint(exc)
            if hint is not None:
                return min(hint, self.max_retry_after)
        window = min(self.max_delay, self.initial_delay * 2 ** (retry_number - 1))
        return self.rng.uniform(0.0, window)

    def retryable(self, exc: BaseException) -> bool:
        """True when ``exc`` is worth another attempt under this policy: ``should_retry``, less
        a promised 429 whose hint exceeds ``max_retry_after`` (see the module docstring)."""
        if not should_retry(exc):
            return False
        if isinstance(exc, APIStatusError) and exc.status_code == 429:
            if exc.response.headers.get(PROMISE_HEADER) is not None:
                hint = self._hint(exc)
                if hint is not None and hint > self.max_retry_after:
                    return False
        return True

    def _hint(self, exc: APIStatusError) -> float | None:
        """The server's wait (seconds) for ``exc``, parsed once into ``exc.retry_after``."""
        if exc.retry_after is None:
            exc.retry_after = parse_retry_after(exc.response.headers, self.clock())
        return exc.retry_after

    def retrying(self, max_retries: int | None = None) -> tenacity.AsyncRetrying:
        """A fresh tenacity ``AsyncRetrying`` for one call (``max_retries`` overrides)."""
        retries = self.max_retries if max_retries is None else max_retries
        return tenacity.AsyncRetrying(
            stop=_Stop(retries, self.max_retry_after),
            wait=_Wait(self),
            retry=tenacity.retry_if_exception(self.retryable),
            sleep=self.sleep,
            reraise=True,
            before_sleep=_log_retry,
        )


def _log_retry(retry_state: tenacity.RetryCallState) -> None:
    """Log each retry at INFO: the failure and the wait chosen."""
    outcome = retry_state.outcome
    exc = outcome.exception() if outcome is not None else None
    wait = retry_state.next_action.sleep if retry_state.next_action is not None else 0.0
    logger.info(
        "retrying in %.3f s (attempt %d failed: %s)",
        wait,
        retry_state.attempt_number,
        f"{type(exc).__name__}: {exc}" if exc is not None else "?",
    )


class _Stop:
    """tenacity stop strategy: stop once ``max_retries`` retries were spent. A flow-control
    429 (``APIStatusError.flow_control``: an adaptive client's) spends none while the call is
    younger than ``flow_control_s`` seconds."""

    def __init__(self, max_retries: int, flow_control_s: float) -> None:
        self.max_retries = max_retries
        self.flow_control_s = flow_control_s
        self.free = 0

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None and outcome.failed else None
        if getattr(exc, "flow_control", False):
            elapsed = retry_state.seconds_since_start or 0.0
            if elapsed < self.flow_control_s:
                self.free += 1
        return retry_state.attempt_number - self.free > self.max_retries


class _Wait(wait_base):
    """tenacity wait strategy delegating to ``RetryPolicy.compute_wait``."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None and outcome.failed else None
        return self.policy.compute_wait(retry_state.attempt_number, exc)
