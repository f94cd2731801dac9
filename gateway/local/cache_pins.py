"""Cache breakpoints as engine pins: what a dialect's cache controls become in local mode.

An Anthropic ``cache_control`` breakpoint, an OpenAI ``prompt_cache_retention``, and a
prefix of the prefix API (``prefixes.PrefixRegistry``) are one mechanism underneath: the
KV blocks of a prompt's leading tokens pinned in the engine (``engine.pin_prefix``) for a
TTL, under the request's cache salt (so tenants never share them), charged to the key's pin
share (``PrefixQuota.max_pinned_blocks``, the prefix API's share: both count together).

``CachePins.pin_soon`` is called once a request has been answered: its prompt is then in
the prefix cache, so the pin's internal prefill is a cache hit (one token computed) and
pins the blocks before eviction can take them. A pin is keyed by ``(salt, tokens)``: the
same breakpoint seen again refreshes its TTL (a new pin replaces the old one once it holds
less than half its TTL), so a steady conversation keeps its prefix pinned without one pin
per request. Over the key's share the key's own least recently used breakpoint pins are
released first (a breakpoint is a cache hint: it never fails a request); a breakpoint
larger than the whole share, or one the engine's pinned space cannot take
(``PinLimitError``), is not pinned and its outcome says why (``outcomes``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import cachetools
from prefixgate.engine.errors import PinLimitError
from prefixgate.engine.protocol import EngineClient, PinHandle, PinRequest

logger = logging.getLogger("prefixgate.gateway")


@dataclass(slots=True)
class CachePin:
    """One pinned breakpoint.

    Attributes:
        key: ``(salt, sha256 of the token ids)``; pin: the engine's handle.
        owner: the key id charged (None: the open gateway's caller); blocks: KV blocks held.
        ttl_s: the breakpoint's TTL (seconds); last_used: ``time.monotonic()`` of its last use.
    """

    key: tuple[str | None, str]
    pin: PinHandle
    owner: str | None
    blocks: int
    ttl_s: float
    last_used: float

    def seconds_left(self) -> float:
        at = self.pin.expires_at
        return float("inf") if at is None else at - time.monotonic()


def pin_key(salt: str | None, token_ids: Sequence[int]) -> tuple[str | None, str]:
    """The registry key of a breakpoint: its salt and a digest of its token ids."""
    digest = hashlib.sha256(b",".join(str(t).encode() for t in token_ids)).hexdigest()
    return salt, digest


class CachePins:
    """Breakpoint pins of every dialect over ``engine.pin_prefix`` (module docstring).

    Args:
        engine: the engine; other_blocks: a key id → KV blocks its other pins hold (the
            prefix API's, ``PrefixRegistry.pinned_blocks``), counted in the same share.
    """

    def __init__(
        self, engine: EngineClient, other_blocks: Callable[[str], int] | None = None
    ) -> None:
        self._engine = engine
        self._other = other_blocks or (lambda owner: 0)
        self.block_size: int = engine.config.block_size
        self._pins: dict[tuple[str | None, str], CachePin] = {}
        self._inflight: set[tuple[str | None, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # key -> the last pin outcome (bounded: a diagnostics aid, not state)
        self.outcomes: cachetools.LRUCache[tuple[str | None, str], str] = cachetools.LRUCache(4096)

    def __len__(self) -> int:
        self._expire()
        return len(self._pins)

    def held_blocks(self, owner: str | None) -> int:
        """KV blocks the live breakpoint pins of ``owner`` hold."""
        self._expire()
        return sum(p.blocks for p in self._pins.values() if p.owner == owner)

    def make_room(self, owner: str, other_blocks: int, share: int) -> None:
        """Release ``owner``'s least recently used breakpoint pins until they and
        ``other_blocks`` (its prefixes, and the one being created) fit ``share`` blocks
        (a prefix of the prefix API outranks a breakpoint: that one is a hint)."""
        while self.held_blocks(owner) + other_blocks > share:
            victim = self._lru(owner, None)
            if victim is None:
                return
            self._drop(victim)

    def live(self, salt: str | None, token_ids: Sequence[int]) -> CachePin | None:
        """The live pin of this breakpoint, if any."""
        self._expire()
        return self._pins.get(pin_key(salt, token_ids))

    def pin_soon(
        self,
        runs: list[tuple[list[int], float]],
        salt: str | None,
        owner: str | None,
        share_blocks: int,
    ) -> None:
        """Pin each ``(token ids, ttl_s)`` run in the background (runs under one full block
        are skipped); ``share_blocks`` is the owner's pin share (0 = unlimited)."""
        runs = [(ids, ttl) for ids, ttl in runs if len(ids) >= self.block_size]
        if not runs:
            return
        task = asyncio.get_running_loop().create_task(
            self._pin_all(runs, salt, owner, share_blocks)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for the pins in progress (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _pin_all(
        self, runs: list[tuple[list[int], float]], salt: str | None, owner: str | None, share: int
    ) -> None:
        for ids, ttl in runs:
            key = pin_key(salt, ids)
            if key in self._inflight:
                continue
            self._inflight.add(key)
            try:
                self.outcomes[key] = await self._pin(key, ids, ttl, salt, owner, share)
            except Exception as exc:  # noqa: BLE001 - a breakpoint never fails a request
                logger.warning("cache breakpoint pin failed: %r", exc)
                self.outcomes[key] = "error"
            finally:
                self._inflight.discard(key)

    async def _pin(
        self,
        key: tuple[str | None, str],
        ids: list[int],
        ttl: float,
        salt: str | None,
        owner: str | None,
        share: int,
    ) -> str:
        """Pin one breakpoint; returns its outcome: ``pinned``, ``refreshed``, ``kept``
        (live with more than half its TTL left), ``over_share``, ``pinned_space_full``."""
        self._expire()
        now = time.monotonic()
        old = self._pins.get(key)
        if old is not None and old.seconds_left() > max(old.ttl_s, ttl) / 2:
            old.last_used = now
            return "kept"
        blocks = len(ids) // self.block_size
        if share and owner is not None:
            if blocks > share:
                return "over_share"
            while self._used(owner, old) + blocks > share:
                victim = self._lru(owner, old)
                if victim is None:
                    return "over_share"
                self._drop(victim)
        try:
            pin = await self._engine.pin_prefix(PinRequest(ids, ttl, cache_salt=salt))
        except PinLimitError:
            return "pinned_space_full"
        if old is not None and self._pins.get(key) is old:
            self._drop(old)
        self._pins[key] = CachePin(
            key, pin, owner, pin.num_tokens // self.block_size, ttl, time.monotonic()
        )
        return "refreshed" if old is not None else "pinned"

    def _used(self, owner: str, replaced: CachePin | None) -> int:
        mine = sum(p.blocks for p in self._pins.values() if p.owner == owner and p is not replaced)
        return mine + self._other(owner)

    def _lru(self, owner: str, keep: CachePin | None) -> CachePin | None:
        mine = [p for p in self._pins.values() if p.owner == owner and p is not keep]
        return min(mine, key=lambda p: p.last_used) if mine else None

    def _drop(self, entry: CachePin) -> None:
        if self._pins.get(entry.key) is entry:
            del self._pins[entry.key]
        try:
            self._engine.unpin_prefix(entry.pin.id)
        except (KeyError, ValueError):
            pass  # already released by the engine (its TTL, or revoked)

    def _expire(self) -> None:
        """Forget the pins the engine no longer holds (TTL passed, or revoked)."""
        for entry in list(self._pins.values()):
            try:
                self._engine.get_pin(entry.pin.id)
            except KeyError:
                self._pins.pop(entry.key, None)

    def clear(self) -> None:
        """Cancel the pins in progress (the engine releases a pin nobody awaits) and release
        every breakpoint pin (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        for entry in list(self._pins.values()):
            self._drop(entry)
