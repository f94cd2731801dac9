"""Where the gateway keeps state that replicas must share: per-key limits, concurrency slots,
registered prefixes and usage counters.

One interface, ``StateBackend``, with two implementations:

* ``LocalState`` (the default): everything in this process (each key's token buckets and
  in-flight count on its ``Principal``; prefixes only in the local ``PrefixRegistry``).
* ``RedisState`` (``--redis-url``, ``redis_state``): the same limits enforced across every
  gateway replica on one Redis, atomically (Lua scripts), concurrency slots held as leases
  with a TTL, prefixes readable by every replica, usage counted per key.

Promises (``put_promise`` / ``promised_upstream``): when an upstream refuses a request with a
429 and a ``Retry-After`` it has promised a place for (``admission_wait.Promises``), the
gateway records fingerprint -> upstream until the promise lapses, so the retry goes back to
the upstream that holds its place through whichever gateway the client reaches next.
``LocalState`` keeps them in this process (every gateway of one process, as ``prefixgate sim``'s
gateways, shares them); ``RedisState`` in Redis, for every gateway replica. Read by the proxy's
attempt loop (``proxy.attempts.each_upstream``) and ``prefixgate sim``'s routing. While
``may_hold_promises`` is False (none recorded, or all lapsed, on every replica) a request
needs no lookup: the proxy then skips its fingerprint and the read.

The routes call ``acquire`` before a request runs and, once it ends, ``close_lease`` with
the request's ``RequestAccount``: ``settle`` (served: charged exactly its usage's prompt +
completion tokens) or ``refund`` (refused or failed before its first token: costs nothing) —
``keys.Charge``'s accounting rule — never branching on the backend. Both are synchronous
(they run in a ``finally`` of a cancelled handler): a backend that talks to a server
schedules that work itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prefixgate.gateway.http.request_account import RequestAccount
    from prefixgate.gateway.tenancy.keys import Charge, Principal


@dataclass(slots=True)
class Lease:
    """One admitted request's hold on its key's limits.

    Attributes:
        id: unique id (the concurrency lease's member name in Redis).
        shared: True when taken in the shared store; False when taken on the local
            ``Principal`` (local backend, or Redis unreachable at admission).
        prompt_tokens: tokens charged at admission (for the usage counters).
        slot: the ``Principal.slots`` token of a shared concurrency lease (its hold time
            feeds the key's ``Retry-After``), None without one.
    """

    id: str
    shared: bool
    prompt_tokens: int
    charge: Charge | None = None  # the local charge (local backend, or Redis was down)
    slot: int | None = None

    @property
    def slot_token(self) -> int | None:
        """The key's ``Principal.slots`` token this lease holds (shared or local), or None
        (no concurrency limit): where the holder's predicted release is told (``set_eta``)."""
        if self.slot is not None:
            return self.slot
        return self.charge.slot if self.charge is not None else None


class StateBackend(Protocol):
    """The gateway's shared state (see the module docstring)."""

    @property
    def kind(self) -> str:
        """``"local"`` or ``"redis"``."""
        ...

    @property
    def up(self) -> bool:
        """False while the shared store is unreachable (limits then fall back to local)."""
        ...

    @property
    def shares_prefixes(self) -> bool:
        """True when prefixes are published to other replicas (and the store is up)."""
        ...

    async def start(self) -> None:
        """Connect (on the app's startup); never raises for an unreachable store."""
        ...

    async def close(self) -> None:
        """Release every lease this replica holds and disconnect."""
        ...

    async def acquire(self, principal: Principal, prompt_tokens: int) -> Lease:
        """Count one request of ``prompt_tokens`` against the key's limits.

        Raises:
            APIError: 429 ``rate_limit_exceeded`` with ``Retry-After`` when over a limit.
        """
        ...

    def settle(
        self, principal: Principal, lease: Lease, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """Served: charge ``prompt_tokens + completion_tokens`` in all, free the slot, count
        usage."""
        ...

    def refund(self, principal: Principal, lease: Lease) -> None:
        """Refused or failed before any token: give back what ``acquire`` took."""
        ...

    async def put_prefix(self, prefix_id: str, record: dict[str, Any], ttl_s: float) -> None:
        """Publish a registered prefix to every replica for ``ttl_s`` seconds."""
        ...

    async def get_prefix(self, prefix_id: str) -> dict[str, Any] | None:
        """A prefix published by any replica, or None (unknown, expired, or not shared)."""
        ...

    async def delete_prefix(self, prefix_id: str) -> None:
        """Withdraw a published prefix."""
        ...

    async def live_prefixes(self, prefix_ids: list[str]) -> set[str] | None:
        """Which of ``prefix_ids`` are still published (not deleted on any replica, not
        expired); None when that is unknown (local backend, or the store unreachable)."""
        ...

    async def reserve_prefix(
        self, owner: str, prefix_id: str, max_prefixes: int, ttl_s: float
    ) -> float | None:
        """Count ``prefix_id`` (live ``ttl_s`` seconds) against ``owner``'s (a key id's)
        ``max_prefixes`` on every replica at once.

        Returns:
            0.0 when reserved; the seconds until the owner's next prefix expires when it
            already holds ``max_prefixes`` (nothing reserved); None when the count is not
            shared (local backend, or the store unreachable): the caller counts on its own.
        """
        ...

    async def release_prefix(self, owner: str, prefix_id: str) -> None:
        """Give back ``reserve_prefix``'s count (the prefix was deleted, or never made)."""
        ...

    async def put_promise(self, fingerprint: str, upstream: str, ttl_s: float) -> None:
        """Record that ``upstream`` (its URL) holds a promised place for the request
        ``fingerprint`` for ``ttl_s`` seconds (until the promise lapses: its Retry-After plus
        the grace ``Promises`` gives it); a later record of the same fingerprint replaces it."""
        ...

    async def promised_upstream(self, fingerprint: str) -> str | None:
        """The upstream holding a promise for ``fingerprint`` (``put_promise``), or None (none,
        lapsed, or the store unreachable)."""
        ...

    async def drop_promise(self, fingerprint: str) -> None:
        """Forget ``fingerprint``'s promise (it was claimed: the request was admitted)."""
        ...

    def may_hold_promises(self) -> bool:
        """False when no promise can be outstanding (``promised_upstream`` would answer None
        for every fingerprint), on this replica or any other sharing the state; True when
        one may be (or that is not known)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What ``/ready`` shows: ``{"backend": kind, "shared": up, ...}``."""
        ...


def close_lease(
    shared: StateBackend, principal: Principal, lease: Lease, acct: RequestAccount
) -> None:
    """Once a request ends, charge its key from its account: a served request settles
    ``lease`` with ``acct.charge(lease.prompt_tokens)`` (its usage; the prompt at what
    admission took when not known) and notes it in ``acct.charged_tokens``; a request not
    served is refunded. Synchronous: it runs in the ``finally`` of a cancelled handler."""
    if not acct.served:
        shared.refund(principal, lease)
        return
    prompt, completion = acct.charge(lease.prompt_tokens)
    shared.settle(principal, lease, prompt, completion)
    acct.charged_tokens = prompt + completion


async def published_prefix(
    shared: StateBackend, prefix_id: str
) -> tuple[dict[str, Any] | None, bool]:
    """``(record, withdrawn)`` of ``prefix_id``: its record as published by any replica (None
    when unknown, expired or not shared), and whether the shared store answered that it holds
    none, so a copy of it here marked published was deleted on another replica or expired.
    ``withdrawn`` is False without shared state and when the store failed meanwhile."""
    if not shared.shares_prefixes:
        return None, False
    record = await shared.get_prefix(prefix_id)
    return record, record is None and shared.shares_prefixes  # False: the store failed


class LocalState:
    """In-process state: the key's ``Principal`` holds its buckets and in-flight count."""

    kind = "local"
    up = True
    shares_prefixes = False

    def __init__(self) -> None:
        # fingerprint -> (upstream, expiry in time.monotonic() seconds), in expiry order
        self._promises: dict[str, tuple[str, float]] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def acquire(self, principal: Principal, prompt_tokens: int) -> Lease:
        return Lease("", False, prompt_tokens, principal.acquire(prompt_tokens))

    def settle(
        self, principal: Principal, lease: Lease, prompt_tokens: int, completion_tokens: int
    ) -> None:
        assert lease.charge is not None
        lease.charge.settle(prompt_tokens, completion_tokens)

    def refund(self, principal: Principal, lease: Lease) -> None:
        assert lease.charge is not None
        lease.charge.refund()

    async def put_prefix(self, prefix_id: str, record: dict[str, Any], ttl_s: float) -> None:
        return None

    async def get_prefix(self, prefix_id: str) -> dict[str, Any] | None:
        return None

    async def delete_prefix(self, prefix_id: str) -> None:
        return None

    async def live_prefixes(self, prefix_ids: list[str]) -> set[str] | None:
        return None

    async def reserve_prefix(
        self, owner: str, prefix_id: str, max_prefixes: int, ttl_s: float
    ) -> float | None:
        return None

    async def release_prefix(self, owner: str, prefix_id: str) -> None:
        return None

    async def put_promise(self, fingerprint: str, upstream: str, ttl_s: float) -> None:
        now = time.monotonic()
        self._expire(now)
        self._promises.pop(fingerprint, None)  # re-inserted last: the dict stays in expiry order
        if ttl_s > 0:
            self._promises[fingerprint] = (upstream, now + ttl_s)

    async def promised_upstream(self, fingerprint: str) -> str | None:
        got = self._promises.get(fingerprint)
        if got is None:
            return None
        if got[1] <= time.monotonic():
            del self._promises[fingerprint]
            return None
        return got[0]

    async def drop_promise(self, fingerprint: str) -> None:
        self._promises.pop(fingerprint, None)

    def may_hold_promises(self) -> bool:
        self._expire(time.monotonic())
        return bool(self._promises)

    def _expire(self, now: float) -> None:
        """Drop the lapsed promises at the front (insertion order is nearly expiry order:
        a longer-lived one ahead only delays the pruning behind it)."""
        promises = self._promises
        while promises:
            fp, (_, expires) = next(iter(promises.items()))
            if expires > now:
                break
            del promises[fp]

    def describe(self) -> dict[str, Any]:
        return {"backend": "local"}
