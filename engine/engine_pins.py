"""Prefix pins on the engine: compute the prefix as an internal prefill request, then pin.

``LLMEngine`` mixes this in. A pin job queues an internal request (``max_tokens=1``, greedy)
for the prefix; when it finishes, the prefix's full blocks are in the prefix cache and
``KVCacheManager.pin`` holds them (reference + 1) until unpinned or expired.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.engine.outputs import RequestOutput
from prefixgate.engine.sampling_params import SamplingParams

PIN_REQUEST_PREFIX = "__pin-"
"""Request ids of the internal prefill requests that compute a prefix before it is pinned."""


@dataclass(slots=True)
class PinJob:
    """A prefix pin in progress: an internal prefill request, then ``kv_cache_manager.pin``.

    ``callback(job)`` runs (on the engine's thread) once ``done``; then ``result`` holds the
    ``PrefixPin`` or ``error`` the exception.
    """

    request_id: str
    token_ids: list[int]
    ttl_s: float
    cache_salt: str | None
    callback: Callable[[PinJob], None] | None = None
    result: Any = None
    error: BaseException | None = None
    done: bool = False


class PrefixPinsMixin:
    """Pin API of ``LLMEngine`` (uses its ``config``, ``scheduler``, ``kv_cache_manager``,
    ``prepare_request``, ``_enqueue``, ``_requests``, ``_stashed`` and ``step``)."""

    _pin_jobs: dict[str, PinJob]
    _pin_counter: itertools.count

    # -- prefix pins ---------------------------------------------------------------------

    def start_pin(
        self,
        token_ids: Sequence[int],
        ttl_s: float,
        cache_salt: str | None = None,
        callback: Callable[[PinJob], None] | None = None,
    ) -> PinJob:
        """Start pinning a prefix: queue an internal prefill of ``token_ids`` (one greedy
        token); when it finishes, its full blocks (now in the prefix cache) are pinned for
        ``ttl_s`` seconds and ``callback(job)`` runs.

        Raises:
            ValueError: prefix caching disabled, ttl_s <= 0, or a bad prefix (see
                ``prepare_request``); TypeError: wrong types.
        """
        if not self.config.enable_prefix_caching:
            raise ValueError("prefix pins need enable_prefix_caching=True")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or ttl_s <= 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if isinstance(token_ids, str):
            raise TypeError("pin_prefix takes token ids; tokenize the text first")
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prep = self.prepare_request(list(token_ids), params, cache_salt)
        if len(prep.prompt_token_ids) < self.config.block_size:
            raise ValueError(
                f"a pinned prefix needs at least one full block ({self.config.block_size} tokens)"
            )
        rid = f"{PIN_REQUEST_PREFIX}{next(self._pin_counter)}"
        job = PinJob(rid, prep.prompt_token_ids, float(ttl_s), cache_salt, callback)
        self._enqueue(rid, prep, time.monotonic())
        self._pin_jobs[rid] = job
        return job

    def _on_pin_request(self, req: Any) -> None:
        job = self._pin_jobs.pop(req.request_id)
        if not req.is_finished():  # cannot happen with max_tokens=1; be safe
            self.scheduler.abort_requests([req.request_id])
        self._requests.pop(req.request_id, None)
        try:
            pin = self.kv_cache_manager.pin(job.token_ids, job.cache_salt, job.ttl_s)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            self._resolve_pin(job, None, exc)
        else:
            self._resolve_pin(job, pin, None)

    @staticmethod
    def _resolve_pin(job: PinJob, result: Any, error: BaseException | None) -> None:
        job.result, job.error, job.done = result, error, True
        if job.callback is not None:
            job.callback(job)

    def pin_prefix(
        self, token_ids: Sequence[int], ttl_s: float, cache_salt: str | None = None
    ) -> Any:
        """Compute ``token_ids`` (if not cached) and pin its full blocks for ``ttl_s`` seconds.

        Steps the engine until done; outputs of other requests produced meanwhile are returned
        by the next ``step()``.

        Returns:
            ``PrefixPin(id, num_tokens, expires_at, ...)``.

        Raises:
            PinLimitError: pins would exceed ``max_pinned_fraction`` of the cache.
            ValueError / TypeError: see ``start_pin``.
        """
        job = self.start_pin(token_ids, ttl_s, cache_salt)
        pending: list[RequestOutput] = []
        while not job.done:
            pending.extend(self.step())
        self._stashed = pending + self._stashed
        if job.error is not None:
            raise job.error
        return job.result

    def expire_pins(self, now: float | None = None) -> list[str]:
        """Release pins whose TTL has passed (``schedule()`` does this every step; call it when
        idle). Returns the released pin ids."""
        return self.kv_cache_manager.expire_pins(now)

    def next_pin_expiry(self) -> float | None:
        """Earliest ``expires_at`` (``time.monotonic()`` seconds) of the live pins, or None."""
        times = [p.expires_at for p in self.kv_cache_manager.pins if p.expires_at is not None]
        return min(times) if times else None

    def unpin_prefix(self, pin_id: str) -> None:
        """Release a pin (its blocks become evictable once no request uses them).

        Raises:
            ValueError / KeyError: unknown pin id.
        """
        self.kv_cache_manager.unpin(pin_id)
