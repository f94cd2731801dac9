"""Explicit prefix API: leading chat messages rendered once, their KV blocks pinned.

``POST /v1/prefixes {model, messages, ttl_seconds}`` renders the leading messages with the
chat template (no generation prompt: more messages follow), tokenizes them and pins the
KV blocks of those tokens through ``engine.pin_prefix`` for ``ttl_seconds``. A chat request
carrying ``prefix_id`` plus only its new messages is rendered as the whole conversation
(prefix messages + new ones), so its token ids are exactly those of sending every message,
and its leading full blocks are served by the prefix cache from the pinned blocks.

The pin is made on the rendered prefix minus its last token: a tokenizer may merge the
prefix's last characters with the text that follows, so only the tokens before that
boundary are sure to reappear at the head of every conversation built on the prefix.

A prefix belongs to the cache salt of the key that created it: other tenants get 404 for it
(as for an unknown or expired id). The engine owns the pin and its TTL (one clock,
``time.monotonic()``): the registry asks ``engine.get_pin`` whether an entry's pin is still
held and forgets the entry once it is not (expired, or revoked for a request that needed the
blocks); ``expires_at`` in the API is that same expiry shown in Unix seconds. A create whose
caller goes away while the engine pins (client disconnect) is the engine's to release
(``AsyncEngine.pin_prefix`` unpins a pin nobody awaits any more). Creates in progress count
against ``max_prefixes``; a 429's ``Retry-After`` is the time until the next live prefix expires.

Each key has its own share (``PrefixQuota``: most live prefixes, most pinned KV blocks, from
the keys file or the gateway's defaults), so one tenant can never take the whole pinned space
and lock the others out; over its share a key gets 429 ``prefix_limit_exceeded`` with the
time until its own next prefix expires, and a prefix larger than the whole share is a 400.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol

from prefixgate.engine.errors import PinLimitError
from prefixgate.engine.protocol import EngineClient, PinHandle, PinRequest
from prefixgate.gateway.http.errors import APIError, not_found, shown
from prefixgate.gateway.tenancy.shared_state import LocalState, StateBackend, published_prefix


@dataclass(slots=True)
class PrefixEntry:
    """One registered prefix.

    Attributes:
        id: public id (``"pfx-..."``).
        messages: the leading messages as ``{"role", "content"}`` dicts.
        prompt_tokens: tokens of the rendered prefix.
        pinned_tokens: tokens handed to ``engine.pin_prefix``.
        created_at: Unix seconds.
        salt: the salt of the creating key (its owner).
        owner: the creating key's id (its quota), None for an open gateway.
        pinned_blocks: KV blocks of the pin, as counted against the owner's quota.
        pin: the engine's ``PrefixPin`` (``.id``, ``.expires_at`` in ``time.monotonic()``
            seconds: the one clock of the prefix's life).
        tools: OpenAI function tools the prefix was rendered with (Gemini's cachedContents
            may hold tools), None for none.
        display_name: a caller's label (Gemini's ``displayName``).
        pinned_ids: the token ids handed to ``engine.pin_prefix`` (``renew`` pins them again).
        cache_salt: the engine cache salt of the pin; tenant: the key's tenant (its charge).
        updated_at: Unix seconds of the last create or renew; expires_unix: the expiry in
            Unix seconds as computed then (one stable value to show; the engine's pin holds
            the real TTL on its own clock).
    """

    id: str
    messages: list[dict[str, str]]
    prompt_tokens: int
    pinned_tokens: int
    created_at: int
    salt: str | None
    pin: PinHandle
    owner: str | None = None
    pinned_blocks: int = 0
    published: bool = False  # written to the shared state (Redis) for the other replicas
    tools: list[dict[str, Any]] | None = None
    display_name: str | None = None
    pinned_ids: list[int] | None = None
    cache_salt: str | None = None
    tenant: str | None = None
    updated_at: int = 0
    expires_unix: float = 0.0  # the expiry in Unix seconds as fixed at create/renew

    @property
    def expires_at(self) -> float:
        """The engine pin's expiry in Unix seconds (for the API; ``inf`` for no expiry)."""
        return time.time() + self.seconds_left()

    def seconds_left(self) -> float:
        """Seconds until the engine's pin lapses (``inf`` when it never does)."""
        at = self.pin.expires_at
        return float("inf") if at is None else at - time.monotonic()


def _pin_blocks(pin: Any, blocks: int, block_size: int) -> int:
    """Full KV blocks a pin holds: from its ``num_tokens`` when it has one, else ``blocks``."""
    num = getattr(pin, "num_tokens", None)
    return num // block_size if isinstance(num, int) else blocks


class BreakpointShare(Protocol):
    """The cache breakpoint pins of the keys (``cache_pins.CachePins``), as the registry
    counts them in a key's pin share."""

    def held_blocks(self, owner: str | None) -> int: ...

    def make_room(self, owner: str, other_blocks: int, share: int) -> None: ...


@dataclass(slots=True)
class PrefixQuota:
    """One key's share of the prefix API (0 = unlimited).

    Attributes:
        max_prefixes: most live prefixes of the key.
        max_pinned_blocks: most KV blocks its live prefixes pin (each prefix counted with
            its full blocks, ``pinned tokens // block_size``; shared blocks counted each time).
    """

    max_prefixes: int = 0
    max_pinned_blocks: int = 0


@dataclass(slots=True)
class SharedPrefix:
    """A prefix registered on another gateway replica, read from the shared state (Redis).

    It carries the messages (a chat on it is rendered as the whole conversation, as on the
    creating replica) but no pin on this replica's engine: its blocks are cached here by the
    first request that uses it.
    """

    id: str
    messages: list[dict[str, str]]
    prompt_tokens: int
    created_at: int
    salt: str | None
    expires_at: float  # Unix seconds
    owner: str | None = None  # the creating key's id (its max_prefixes)
    tools: list[dict[str, Any]] | None = None
    display_name: str | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> SharedPrefix:
        return cls(
            id=record["id"],
            messages=record["messages"],
            prompt_tokens=int(record["prompt_tokens"]),
            created_at=int(record["created"]),
            salt=record["salt"],
            expires_at=float(record["expires_at"]),
            owner=record.get("owner"),
            tools=record.get("tools"),
            display_name=record.get("display_name"),
        )


class PrefixRegistry:
    """Prefixes by id over ``engine.pin_prefix`` / ``engine.unpin_prefix``, published to the
    other gateway replicas through ``shared`` (``--redis-url``).

    Args:
        engine: the engine (its ``pin_prefix`` / ``unpin_prefix``).
        max_ttl_s: longest ``ttl_seconds`` accepted (seconds).
        max_prefixes: most live prefixes on this replica (over it: 429).
        shared: the state backend (``LocalState``: this replica only).
    """

    def __init__(
        self,
        engine: EngineClient,
        max_ttl_s: float = 86_400.0,
        max_prefixes: int = 1024,
        shared: StateBackend | None = None,
    ) -> None:
        self._engine = engine
        self._shared: StateBackend = shared if shared is not None else LocalState()
        self.max_ttl_s = max_ttl_s
        self.max_prefixes = max_prefixes
        self._entries: dict[str, PrefixEntry] = {}
        # ids whose pin the engine revoked before its TTL (it needed the blocks): salt, so
        # their owner is told so instead of "unknown or expired"; the latest MAX_REVOKED only
        self._revoked: dict[str, str | None] = {}
        self._pending = 0  # creates awaiting their pin
        self._pending_by_owner: dict[str, tuple[int, int]] = {}  # owner -> (creates, blocks)
        self.block_size: int = engine.config.block_size
        # the key's cache breakpoint pins (cache_pins.CachePins), in the same share: a prefix
        # that needs room releases the key's least recently used breakpoints first
        self.breakpoints: BreakpointShare | None = None

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    async def create(
        self,
        messages: list[dict[str, str]],
        token_ids: list[int],
        ttl_s: float,
        salt: str | None,
        cache_salt: str | None = None,
        owner: str | None = None,
        quota: PrefixQuota | None = None,
        tenant: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        display_name: str | None = None,
    ) -> PrefixEntry:
        """Pin ``token_ids`` (the rendered ``messages``, with ``tools`` when given) for
        ``ttl_s`` seconds, charged to ``tenant`` (the key's name: under ``fair`` its pinned
        blocks count against its share); ``display_name`` is kept as the caller's label.

        ``salt`` is the owner's (the key's) salt, checked by ``get``/``delete``;
        ``cache_salt`` the engine cache salt of the pin (default: ``salt``). Chat requests
        hit the pinned blocks when they use the same cache salt. ``owner`` (a key id) is
        held to ``quota`` when both are given.

        Raises:
            APIError: 400 on a ttl over ``max_ttl_s`` or an empty prefix; 429
                ``prefix_limit_exceeded`` when the pinned space (engine's
                ``max_pinned_fraction``), the prefix count, or the owner's quota is
                exhausted; 400 ``prefix_too_large`` when the prefix alone exceeds the quota.
        """
        self._expire()
        if ttl_s > self.max_ttl_s:
            raise APIError(400, f"ttl_seconds must be <= {self.max_ttl_s:g}", param="ttl_seconds")
        if len(token_ids) < 2:
            raise APIError(400, "the prefix renders to fewer than 2 tokens", param="messages")
        prefix_id = "pfx-" + secrets.token_hex(12)
        counted = None  # the key's max_prefixes counted across replicas: 0.0, or None
        if owner is not None and quota is not None:
            await self._forget_deleted_elsewhere(owner)
        # True while a count of this prefix may sit in the shared state: given back when the
        # create fails or is cancelled (also while the reservation itself is in flight).
        reserved = False
        try:
            if owner is not None and quota is not None and quota.max_prefixes:
                if self._shared.shares_prefixes:
                    reserved = True
                    counted = await self._shared.reserve_prefix(
                        owner, prefix_id, quota.max_prefixes, ttl_s
                    )
                if counted is not None and counted > 0:
                    reserved = False  # refused: nothing was counted
                    raise APIError(
                        429,
                        f"this key holds its limit of live prefixes across replicas "
                        f"(max_prefixes={quota.max_prefixes}); delete one or wait for one "
                        "to expire",
                        code="prefix_limit_exceeded",
                        retry_after=counted,
                    )
            return await self._create(
                prefix_id,
                messages,
                token_ids,
                ttl_s,
                salt,
                cache_salt,
                owner,
                quota,
                count=counted is None,
                tenant=tenant,
                tools=tools,
                display_name=display_name,
            )
        except BaseException:
            if reserved and owner is not None:
                await self._shared.release_prefix(owner, prefix_id)
            raise

    async def _forget_deleted_elsewhere(self, owner: str) -> None:
        """Unpin ``owner``'s published prefixes that the shared state no longer holds
        (deleted on another replica), so its quota here counts only live ones."""
        for entry in [e for e in self._entries.values() if e.owner == owner and e.published]:
            record = await self._shared.get_prefix(entry.id)
            if record is None and self._shared.shares_prefixes:  # Redis answered: none
                if self._entries.get(entry.id) is entry:
                    self._drop(entry)

    async def sweep(self) -> int:
        """Unpin every published prefix of this replica that the shared state no longer
        holds (deleted through another replica), so its KV blocks are freed within one sweep
        rather than at its TTL; returns how many were dropped. Nothing when the state is not
        shared or the store does not answer."""
        published = [e for e in self._entries.values() if e.published]
        if not published or not self._shared.shares_prefixes:
            return 0
        live = await self._shared.live_prefixes([e.id for e in published])
        if live is None:
            return 0
        dropped = 0
        for entry in published:
            if entry.id not in live and self._entries.get(entry.id) is entry:
                self._drop(entry)
                dropped += 1
        return dropped

    async def _create(
        self,
        prefix_id: str,
        messages: list[dict[str, str]],
        token_ids: list[int],
        ttl_s: float,
        salt: str | None,
        cache_salt: str | None,
        owner: str | None,
        quota: PrefixQuota | None,
        count: bool,
        tenant: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        display_name: str | None = None,
    ) -> PrefixEntry:
        """``create`` once the key's prefix count is reserved across replicas (``count``
        False) or left to this replica (``count`` True)."""
        if len(self._entries) + self._pending >= self.max_prefixes:
            raise APIError(
                429,
                f"too many live prefixes (max {self.max_prefixes}); delete some",
                code="prefix_limit_exceeded",
                retry_after=self._next_expiry(),
            )
        pinned = token_ids[:-1]
        blocks = len(pinned) // self.block_size
        if owner is not None and quota is not None:
            if self.breakpoints is not None and quota.max_pinned_blocks:
                mine = sum(e.pinned_blocks for e in self._entries.values() if e.owner == owner)
                pending = self._pending_by_owner.get(owner, (0, 0))[1]
                self.breakpoints.make_room(owner, mine + pending + blocks, quota.max_pinned_blocks)
            self._check_quota(owner, quota, blocks, count=count)
        self._pending += 1
        if owner is not None:
            n, b = self._pending_by_owner.get(owner, (0, 0))
            self._pending_by_owner[owner] = (n + 1, b + blocks)
        try:
            pin = await self._pin(
                pinned,
                ttl_s,
                cache_salt=salt if cache_salt is None else cache_salt,
                tenant=tenant,
                param="messages",
            )
        finally:
            self._pending -= 1
            if owner is not None:
                n, b = self._pending_by_owner.pop(owner)
                if n > 1:
                    self._pending_by_owner[owner] = (n - 1, b - blocks)
        now = int(time.time())
        entry = PrefixEntry(
            id=prefix_id,
            messages=messages,
            prompt_tokens=len(token_ids),
            pinned_tokens=len(pinned),
            created_at=int(time.time()),
            salt=salt,
            pin=pin,
            owner=owner,
            pinned_blocks=_pin_blocks(pin, blocks, self.block_size),
            tools=tools,
            display_name=display_name,
            pinned_ids=pinned,
            cache_salt=salt if cache_salt is None else cache_salt,
            tenant=tenant,
            updated_at=now,
            expires_unix=time.time() + ttl_s,
        )
        self._entries[entry.id] = entry
        if self._shared.shares_prefixes:
            record = {
                "id": entry.id,
                "messages": messages,
                "prompt_tokens": entry.prompt_tokens,
                "created": entry.created_at,
                "salt": salt,
                "expires_at": entry.expires_at,
                "owner": owner,
                "tools": tools,
                "display_name": display_name,
            }
            try:
                await self._shared.put_prefix(entry.id, record, entry.seconds_left())
            except BaseException:  # cancelled (client gone): nobody will know its id
                self._drop(entry)
                await self._shared.delete_prefix(entry.id)  # in case it was written
                raise
            entry.published = self._shared.shares_prefixes  # False: Redis failed meanwhile
        return entry

    async def lookup(self, prefix_id: str, salt: str | None) -> PrefixEntry | SharedPrefix:
        """The live prefix ``prefix_id`` of this salt, registered on this replica or (with
        shared state) on any other. A published prefix the shared state no longer holds was
        deleted on another replica: its pin here is released.

        Raises:
            APIError: 404 ``prefix_not_found`` when unknown, expired or another tenant's.
        """
        self._expire()
        entry = self._entries.get(prefix_id)
        record, withdrawn = await published_prefix(self._shared, prefix_id)
        if withdrawn and entry is not None and entry.published:
            self._drop(entry)
            entry = None
        elif record is not None and entry is None and record.get("salt") == salt:
            return SharedPrefix.from_record(record)
        if entry is None:
            raise self._missing(prefix_id, salt)
        return self.get(prefix_id, salt)

    async def remove(self, prefix_id: str, salt: str | None) -> PrefixEntry | SharedPrefix:
        """Delete ``prefix_id`` on every replica (unpinned here when registered here).

        Raises:
            APIError: 404 as ``lookup``.
        """
        entry = await self.lookup(prefix_id, salt)
        if isinstance(entry, PrefixEntry):
            self._drop(entry)
        await self._shared.delete_prefix(prefix_id)
        if entry.owner is not None:
            await self._shared.release_prefix(entry.owner, prefix_id)
        return entry

    def owned(self, salt: str | None) -> list[PrefixEntry]:
        """The live prefixes of this replica created by a key of ``salt``, oldest first."""
        self._expire()
        return sorted(
            (e for e in self._entries.values() if e.salt == salt), key=lambda e: e.created_at
        )

    async def renew(self, prefix_id: str, salt: str | None, ttl_s: float) -> PrefixEntry:
        """Give ``prefix_id`` a new life of ``ttl_s`` seconds from now: its tokens are pinned
        again for ``ttl_s`` (the blocks are cached: no prefill), then the old pin released.

        Raises:
            APIError: 404 as ``get`` (a prefix of another replica cannot be renewed here);
                400 for a ttl over ``max_ttl_s``; 429 ``prefix_limit_exceeded`` when the
                pinned space cannot hold the second pin for that moment.
        """
        entry = self.get(prefix_id, salt)
        if ttl_s > self.max_ttl_s:
            raise APIError(400, f"ttl must be <= {self.max_ttl_s:g} s", param="ttl")
        assert entry.pinned_ids is not None  # every entry of this replica keeps them
        pin = await self._pin(
            entry.pinned_ids,
            ttl_s,
            cache_salt=entry.cache_salt,
            tenant=entry.tenant,
            param="ttl",
        )
        if self._entries.get(prefix_id) is not entry:  # deleted meanwhile: keep it deleted
            self._engine.unpin_prefix(pin.id)
            raise self._missing(prefix_id, salt)
        old, entry.pin = entry.pin, pin
        entry.updated_at = int(time.time())
        entry.expires_unix = time.time() + ttl_s
        try:
            self._engine.unpin_prefix(old.id)
        except (KeyError, ValueError):
            pass  # it lapsed meanwhile
        if entry.published:
            record = await self._shared.get_prefix(entry.id)
            if record is not None:
                record["expires_at"] = entry.expires_at
                await self._shared.put_prefix(entry.id, record, entry.seconds_left())
        return entry

    def pinned_blocks(self, owner: str) -> int:
        """KV blocks the live prefixes of ``owner`` pin (its share, ``max_pinned_blocks``,
        also holds its cache breakpoints: ``cache_pins.CachePins``)."""
        self._expire()
        return sum(e.pinned_blocks for e in self._entries.values() if e.owner == owner)

    def _check_quota(self, owner: str, quota: PrefixQuota, blocks: int, count: bool = True) -> None:
        """Raise 429 (or 400 for a prefix over the whole share) when ``owner`` would exceed
        its quota with one more prefix of ``blocks`` KV blocks (its ``max_prefixes`` on this
        replica only when ``count``: else the shared state counted it)."""
        mine = [e for e in self._entries.values() if e.owner == owner]
        n, b = self._pending_by_owner.get(owner, (0, 0))
        if count and quota.max_prefixes and len(mine) + n >= quota.max_prefixes:
            raise APIError(
                429,
                f"this key has {len(mine) + n} live prefixes, its limit "
                f"(max_prefixes={quota.max_prefixes}); delete one or wait for one to expire",
                code="prefix_limit_exceeded",
                retry_after=self._next_expiry(mine),
            )
        if quota.max_pinned_blocks and blocks > quota.max_pinned_blocks:
            raise APIError(
                400,
                f"this prefix pins {blocks} KV blocks, more than this key may pin in all "
                f"(max_pinned_blocks={quota.max_pinned_blocks}); send a shorter prefix",
                param="messages",
                code="prefix_too_large",
            )
        held = sum(e.pinned_blocks for e in mine) + b
        if self.breakpoints is not None:
            held += self.breakpoints.held_blocks(owner)
        if quota.max_pinned_blocks and held + blocks > quota.max_pinned_blocks:
            raise APIError(
                429,
                f"this key's live prefixes pin {held} KV blocks; {blocks} more would exceed "
                f"its limit (max_pinned_blocks={quota.max_pinned_blocks}); delete a prefix "
                "or wait for one to expire",
                code="prefix_limit_exceeded",
                retry_after=self._next_expiry(mine),
            )

    def get(self, prefix_id: str, salt: str | None) -> PrefixEntry:
        """The live prefix ``prefix_id`` of this salt.

        Raises:
            APIError: 404 ``prefix_not_found`` when unknown, expired or another tenant's.
        """
        self._expire()
        entry = self._entries.get(prefix_id)
        if entry is None or entry.salt != salt:
            raise self._missing(prefix_id, salt)
        return entry

    def delete(self, prefix_id: str, salt: str | None) -> PrefixEntry:
        """Unpin and forget ``prefix_id``. Raises APIError 404 as ``get``."""
        entry = self.get(prefix_id, salt)
        self._drop(entry)
        return entry

    def clear(self) -> None:
        """Unpin every prefix (shutdown)."""
        for entry in list(self._entries.values()):
            self._drop(entry)

    async def _pin(
        self,
        token_ids: list[int],
        ttl_s: float,
        *,
        cache_salt: str | None,
        tenant: str | None,
        param: str,
    ) -> PinHandle:
        """``engine.pin_prefix`` with its refusals as API errors.

        Raises:
            APIError: 429 ``prefix_limit_exceeded`` (``Retry-After``: the next expiry) when
                the pinned space is full; 400 naming ``param`` for any other ``ValueError``.
        """
        try:
            return await self._engine.pin_prefix(
                PinRequest(token_ids, ttl_s, cache_salt=cache_salt, tenant=tenant)
            )
        except PinLimitError as exc:
            raise APIError(
                429,
                f"pinned prefix space is full: {exc}. Delete a prefix or wait for one to expire",
                code="prefix_limit_exceeded",
                retry_after=self._next_expiry(),
            ) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    def _next_expiry(self, entries: list[PrefixEntry] | None = None) -> float:
        """Seconds until the next of ``entries`` (default: every live prefix) expires (60
        when there is none: the pinned space is then held by pins this registry does not
        know, e.g. the engine's own, or by creates in progress)."""
        live = list(self._entries.values()) if entries is None else entries
        if not live:
            return 60.0
        soonest = min(e.seconds_left() for e in live)
        return 60.0 if soonest == float("inf") else max(1.0, soonest)

    def _drop(self, entry: PrefixEntry) -> None:
        self._entries.pop(entry.id, None)
        try:
            self._engine.unpin_prefix(entry.pin.id)
        except (KeyError, ValueError):
            pass  # already released by the engine (its TTL)

    def _expire(self) -> None:
        """Forget the entries whose pin the engine no longer holds (its TTL, or revoked)."""
        for entry in list(self._entries.values()):
            try:
                self._engine.get_pin(entry.pin.id)
            except KeyError:
                del self._entries[entry.id]
                if entry.seconds_left() > 0:  # gone before its TTL: the engine revoked it
                    self._revoked[entry.id] = entry.salt
                    while len(self._revoked) > MAX_REVOKED:
                        del self._revoked[next(iter(self._revoked))]

    def _missing(self, prefix_id: str, salt: str | None) -> APIError:
        """404 for a prefix this salt cannot use: ``prefix_revoked`` when its pin was revoked
        for room (its owner only), else ``prefix_not_found``."""
        if prefix_id in self._revoked and self._revoked[prefix_id] == salt:
            return not_found(
                f"prefix {shown(prefix_id)} was revoked before its TTL: the engine needed its "
                "KV blocks for running requests (a pin gives way under memory pressure); "
                "register it again",
                param="prefix_id",
                code="prefix_revoked",
            )
        return _not_found(prefix_id)


MAX_REVOKED = 1024
"""Revoked prefix ids remembered for their ``prefix_revoked`` answer (the latest)."""


def _not_found(prefix_id: str) -> APIError:
    return not_found(
        f"prefix {shown(prefix_id)} not found (unknown or expired)",
        param="prefix_id",
        code="prefix_not_found",
    )
