"""The prefix API in upstream (proxy) mode: ``POST /v1/prefixes`` registers a prefix on the
upstream that will serve it.

The gateway always keeps the prefix's messages (its text), under a gateway id
(``"pfx-..."``), owned by the creating key's salt (another key gets 404) and counted against
that key's ``max_prefixes``. Where it lives:

* **A prefixgate upstream** (``Upstream.prefix_api``: its ``/v1/models`` cards say
  ``owned_by: "prefixgate"``): the prefix is registered through that upstream's own prefix
  API, with the creating request's effective cache salt as ``cache_salt`` (as local mode pins
  under it), and the gateway keeps ``gateway id -> (upstream URL, upstream prefix id)``. A
  chat with ``prefix_id`` is sent to that upstream with the upstream's prefix id: only the
  new messages travel. If that upstream is down, or answers 404 ``prefix_not_found`` (its
  pin was revoked, or it restarted), the prefix is registered again from the kept messages
  on a healthy upstream (the one routing picks for the prefix's text) and the chat goes
  there — or, when none can take it, the request fails with an explicit error.
* **Any other OpenAI-compatible upstream**: nothing is registered there; a chat with
  ``prefix_id`` is sent with the prefix's messages prepended to its own, routed like any
  request whose prompt starts with that text (``cache_aware`` / ``rendezvous`` affinity:
  the same prefix and salt go to the same upstream, whose automatic prefix cache holds it).

The upstream chosen for a new prefix is the one routing picks for the prefix's text and
salt, so the prefix sits where requests starting with it go anyway; the calls to the upstreams
(register, count, release) are ``proxy_prefix_placement.PrefixPlacement``. This module is the
registry: ids, owners and limits, lookup, re-registration and the shared (Redis) records.

Life: a prefix lives ``ttl_seconds`` on the gateway's clock (``expires_at``, Unix seconds);
an upstream pin has the same TTL and is released by the upstream itself when it lapses.
``DELETE`` deletes the upstream's pin too. With ``--redis-url`` (``StateBackend``
``shares_prefixes``) the registry is shared by the gateway replicas through the same
``put_prefix`` / ``get_prefix`` / ``delete_prefix`` seam as local mode: the record carries the
messages and the upstream registration (never a credential), so a prefix created on one
replica serves chats, GET and DELETE on every replica.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from prefixgate.gateway.http.errors import APIError, not_found, shown
from prefixgate.gateway.proxy.prefix_entry import ProxyPrefix
from prefixgate.gateway.proxy.prefix_placement import HeadersFor, PrefixPlacement
from prefixgate.gateway.proxy.upstream import Route, Upstream, UpstreamRouter
from prefixgate.gateway.tenancy.shared_state import StateBackend, published_prefix

__all__ = ["HeadersFor", "ProxyPrefix", "ProxyPrefixRegistry"]


class ProxyPrefixRegistry:
    """Prefixes of upstream mode by gateway id (see the module docstring).

    Args:
        router: the upstream pool (its session, health and routing policy).
        shared: the state backend (``RedisState`` shares the registry with other replicas).
        max_ttl_s: longest ``ttl_seconds`` accepted (seconds).
        max_prefixes: most live prefixes created on this replica (over it: 429).
    """

    def __init__(
        self,
        router: UpstreamRouter,
        shared: StateBackend,
        max_ttl_s: float = 86_400.0,
        max_prefixes: int = 1024,
    ) -> None:
        self._router = router
        self._placement = PrefixPlacement(router)
        self._shared = shared
        self.max_ttl_s = max_ttl_s
        self.max_prefixes = max_prefixes
        self._entries: dict[str, ProxyPrefix] = {}
        self._pending: dict[str | None, int] = {}  # owner -> creates in progress
        # prefix id -> (lock, users): one re-registration of a prefix at a time
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    async def create(
        self,
        model: str,
        messages: list[dict[str, Any]],
        ttl_s: float,
        salt: str | None,
        cache_salt: str | None,
        headers_for: HeadersFor,
        owner: str | None = None,
        key_max_prefixes: int = 0,
    ) -> ProxyPrefix:
        """Register ``messages`` for ``ttl_s`` seconds on the upstream routing picks for them.

        Raises:
            APIError: 400 ``ttl_seconds`` over ``max_ttl_s``; 404 ``model_not_found`` when every
                upstream listed its models and none has ``model``; 429
                ``prefix_limit_exceeded`` over this replica's or the key's
                (``key_max_prefixes``, 0 = none) live prefixes; the upstream's own 4xx
                (bad messages, its pinned space full) as it answered; 502/503
                ``upstream_unavailable`` when no upstream could take it.
        """
        self._expire()
        if ttl_s > self.max_ttl_s:
            raise APIError(400, f"ttl_seconds must be <= {self.max_ttl_s:g}", param="ttl_seconds")
        pending = sum(self._pending.values())
        if len(self._entries) + pending >= self.max_prefixes:
            raise APIError(
                429,
                f"too many live prefixes (max {self.max_prefixes}); delete some",
                code="prefix_limit_exceeded",
                retry_after=self._next_expiry(list(self._entries.values())),
            )
        prefix_id = "pfx-" + secrets.token_hex(12)
        # counted as in progress from here: the checks above and the key's own count hold
        # for the creates that pass them while this one awaits
        self._pending[owner] = self._pending.get(owner, 0) + 1
        try:
            reserved = False
            if owner is not None and key_max_prefixes:
                reserved = await self._reserve(owner, prefix_id, key_max_prefixes, ttl_s)
        except BaseException:
            self._unpend(owner)
            raise
        now = time.time()
        entry = ProxyPrefix(
            id=prefix_id,
            model=model,
            messages=messages,
            prompt_tokens=0,
            created_at=int(now),
            expires_at=now + ttl_s,
            salt=salt,
            cache_salt=cache_salt,
            owner=owner,
        )
        try:
            await self._placement.place(entry, headers_for, first=True)
        except BaseException:
            if reserved and owner is not None:
                await self._shared.release_prefix(owner, prefix_id)
            raise
        finally:
            self._unpend(owner)
        self._entries[entry.id] = entry
        try:
            await self._publish(entry)
        except BaseException:  # cancelled (client gone): nobody will know its id
            self._entries.pop(entry.id, None)
            await self._shared.delete_prefix(entry.id)  # in case it was written
            if reserved and owner is not None:
                await self._shared.release_prefix(owner, prefix_id)
            await self._placement.release(entry, headers_for)
            raise
        return entry

    def _unpend(self, owner: str | None) -> None:
        self._pending[owner] -= 1
        if not self._pending[owner]:
            del self._pending[owner]

    async def _reserve(self, owner: str, prefix_id: str, limit: int, ttl_s: float) -> bool:
        """Count a new prefix (already in ``_pending``) against ``owner``'s ``limit``: across
        replicas in the shared state when it answers (True: reserved there), else on this
        replica's own prefixes (False).

        Raises:
            APIError: 429 ``prefix_limit_exceeded`` when the key holds ``limit`` prefixes.
        """
        wait = None
        if self._shared.shares_prefixes:
            try:
                wait = await self._shared.reserve_prefix(owner, prefix_id, limit, ttl_s)
            except BaseException:  # cancelled with the answer unknown: give it back
                await self._shared.release_prefix(owner, prefix_id)
                raise
        if wait is not None and wait <= 0:
            return True
        mine = [e for e in self._entries.values() if e.owner == owner]
        held = len(mine) + self._pending.get(owner, 0) - 1  # the others in progress
        if wait is None and held < limit:
            return False
        raise APIError(
            429,
            f"this key holds its limit of live prefixes (max_prefixes={limit}, across "
            "replicas when shared); delete one or wait for one to expire",
            code="prefix_limit_exceeded",
            retry_after=self._next_expiry(mine) if wait is None else wait,
        )

    async def lookup(self, prefix_id: str, salt: str | None) -> ProxyPrefix:
        """The live prefix ``prefix_id`` of this salt, created on this replica or (with
        shared state) on any other.

        Raises:
            APIError: 404 ``prefix_not_found`` when unknown, expired or another key's.
        """
        self._expire()
        entry = self._entries.get(prefix_id)
        record, withdrawn = await published_prefix(self._shared, prefix_id)
        if withdrawn and entry is not None and entry.published:  # deleted on another replica
            self._entries.pop(prefix_id, None)
            entry = None
        elif record is not None and entry is None:
            try:
                entry = ProxyPrefix.from_record(record)
            except (KeyError, TypeError, ValueError):
                entry = None
        elif record is not None and entry is not None:
            entry.upstream = record.get("upstream")  # another replica re-registered it
            entry.upstream_id = record.get("upstream_id")
        if entry is None or entry.salt != salt or entry.seconds_left() <= 0:
            raise _not_found(prefix_id)
        return entry

    def owned(self, salt: str | None) -> list[ProxyPrefix]:
        """The live prefixes of this replica created by a key of ``salt``, oldest first."""
        self._expire()
        return sorted(
            (e for e in self._entries.values() if e.salt == salt and e.seconds_left() > 0),
            key=lambda e: e.created_at,
        )

    async def remove(
        self, prefix_id: str, salt: str | None, headers_for: HeadersFor
    ) -> ProxyPrefix:
        """Delete ``prefix_id`` here, on every replica, and its pin on its upstream.

        Raises:
            APIError: 404 as ``lookup``.
        """
        entry = await self.lookup(prefix_id, salt)
        self._entries.pop(entry.id, None)
        await self._shared.delete_prefix(entry.id)
        if entry.owner is not None:
            await self._shared.release_prefix(entry.owner, entry.id)
        await self._placement.release(entry, headers_for)
        return entry

    def holder(self, entry: ProxyPrefix) -> Upstream | None:
        """The healthy upstream holding ``entry``'s pin, else None."""
        if entry.upstream is None:
            return None
        up = self._router.find(entry.upstream)
        return up if up is not None and up.healthy else None

    async def replace(
        self, entry: ProxyPrefix, lost_id: str | None, headers_for: HeadersFor
    ) -> None:
        """Register ``entry`` again from its messages (its upstream died, or lost the pin
        ``lost_id``) on the upstream routing picks now; one re-registration per prefix at a
        time (a concurrent caller finds it done and takes its result).

        Raises:
            APIError: as ``create`` when no upstream can take it.
        """
        lock, users = self._locks.get(entry.id, (asyncio.Lock(), 0))
        self._locks[entry.id] = (lock, users + 1)
        try:
            async with lock:
                current = self._entries.get(entry.id)
                if self._shared.shares_prefixes:
                    record = await self._shared.get_prefix(entry.id)
                    if record is not None:
                        current = ProxyPrefix.from_record(record)
                if current is not None and current.upstream_id != lost_id:
                    entry.upstream, entry.upstream_id = current.upstream, current.upstream_id
                    if self.holder(entry) is not None:
                        return  # done meanwhile by another request
                if entry.seconds_left() <= 0:
                    raise _not_found(entry.id)
                entry.upstream = entry.upstream_id = None
                await self._placement.place(entry, headers_for, first=False)
                local = self._entries.get(entry.id)
                if local is not None and local is not entry:
                    local.upstream, local.upstream_id = entry.upstream, entry.upstream_id
                await self._publish(entry)
        finally:
            lock, users = self._locks[entry.id]
            if users == 1:
                del self._locks[entry.id]
            else:
                self._locks[entry.id] = (lock, users - 1)

    async def close(self) -> None:
        """Release the upstream pins of this replica's prefixes (shutdown) unless they are
        shared with other replicas."""
        entries = list(self._entries.values())
        self._entries.clear()
        if self._shared.shares_prefixes or self._router.session is None:
            return
        await asyncio.gather(
            *(self._placement.release(e, _fixed(e.headers)) for e in entries if e.upstream),
            return_exceptions=True,
        )

    def route(self, entry: ProxyPrefix) -> Route:
        """The routing of the prefix's own text under its cache salt (what a request starting
        with it is routed by; see ``PrefixPlacement.route``)."""
        return self._placement.route(entry)

    async def _publish(self, entry: ProxyPrefix) -> None:
        if self._shared.shares_prefixes:
            await self._shared.put_prefix(entry.id, entry.record(), entry.seconds_left())
            entry.published = self._shared.shares_prefixes  # False: Redis failed meanwhile

    def _expire(self) -> None:
        now = time.time()
        for entry in [e for e in self._entries.values() if e.expires_at <= now]:
            del self._entries[entry.id]  # the upstream's pin lapses on its own clock

    @staticmethod
    def _next_expiry(entries: list[ProxyPrefix]) -> float:
        if not entries:
            return 60.0
        return max(1.0, min(e.seconds_left() for e in entries))


def _fixed(headers: dict[str, str]) -> HeadersFor:
    """The same ``headers`` for any upstream."""
    return lambda up: headers


def _not_found(prefix_id: str) -> APIError:
    return not_found(
        f"prefix {shown(prefix_id)} not found (unknown or expired)",
        param="prefix_id",
        code="prefix_not_found",
    )
