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
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from prefixgate.engine.errors import PinLimitError
from prefixgate.engine.protocol import EngineClient, PinHandle
from prefixgate.gateway.errors import APIError, not_found, shown


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
        pin: the engine's ``PrefixPin`` (``.id``, ``.expires_at`` in ``time.monotonic()``
            seconds: the one clock of the prefix's life).
    """

    id: str
    messages: list[dict[str, str]]
    prompt_tokens: int
    pinned_tokens: int
    created_at: int
    salt: str | None
    pin: PinHandle

    @property
    def expires_at(self) -> float:
        """The engine pin's expiry in Unix seconds (for the API; ``inf`` for no expiry)."""
        return time.time() + self.seconds_left()

    def seconds_left(self) -> float:
        """Seconds until the engine's pin lapses (``inf`` when it never does)."""
        at = self.pin.expires_at
        return float("inf") if at is None else at - time.monotonic()

    def public(self, model: str) -> dict[str, Any]:
        """The prefix object returned by the API."""
        return {
            "id": self.id,
            "object": "prefix",
            "model": model,
            "created": self.created_at,
            "prompt_tokens": self.prompt_tokens,
            "expires_at": int(self.expires_at),
        }


class PrefixRegistry:
    """Prefixes by id over ``engine.pin_prefix`` / ``engine.unpin_prefix``.

    Args:
        engine: the engine (its ``pin_prefix`` / ``unpin_prefix``).
        max_ttl_s: longest ``ttl_seconds`` accepted (seconds).
        max_prefixes: most live prefixes (over it: 429).
    """

    def __init__(
        self, engine: EngineClient, max_ttl_s: float = 86_400.0, max_prefixes: int = 1024
    ) -> None:
        self._engine = engine
        self.max_ttl_s = max_ttl_s
        self.max_prefixes = max_prefixes
        self._entries: dict[str, PrefixEntry] = {}
        self._pending = 0  # creates awaiting their pin

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
    ) -> PrefixEntry:
        """Pin ``token_ids`` (the rendered ``messages``) for ``ttl_s`` seconds.

        ``salt`` is the owner's (the key's) salt, checked by ``get``/``delete``;
        ``cache_salt`` the engine cache salt of the pin (default: ``salt``). Chat requests
        hit the pinned blocks when they use the same cache salt.

        Raises:
            APIError: 400 on a ttl over ``max_ttl_s`` or an empty prefix; 429
                ``prefix_limit_exceeded`` when the pinned space (engine's
                ``max_pinned_fraction``) or the prefix count is exhausted.
        """
        self._expire()
        if ttl_s > self.max_ttl_s:
            raise APIError(400, f"ttl_seconds must be <= {self.max_ttl_s:g}", param="ttl_seconds")
        if len(token_ids) < 2:
            raise APIError(400, "the prefix renders to fewer than 2 tokens", param="messages")
        if len(self._entries) + self._pending >= self.max_prefixes:
            raise APIError(
                429,
                f"too many live prefixes (max {self.max_prefixes}); delete some",
                code="prefix_limit_exceeded",
                retry_after=self._next_expiry(),
            )
        pinned = token_ids[:-1]
        self._pending += 1
        try:
            pin = await self._engine.pin_prefix(
                pinned, ttl_s, cache_salt=salt if cache_salt is None else cache_salt
            )
        except ValueError as exc:
            if isinstance(exc, PinLimitError):
                raise APIError(
                    429,
                    f"pinned prefix space is full: {exc}. Delete a prefix or wait for one to expire",
                    code="prefix_limit_exceeded",
                    retry_after=self._next_expiry(),
                ) from None
            raise APIError(400, str(exc), param="messages") from None
        finally:
            self._pending -= 1
        entry = PrefixEntry(
            id="pfx-" + secrets.token_hex(12),
            messages=messages,
            prompt_tokens=len(token_ids),
            pinned_tokens=len(pinned),
            created_at=int(time.time()),
            salt=salt,
            pin=pin,
        )
        self._entries[entry.id] = entry
        return entry

    def get(self, prefix_id: str, salt: str | None) -> PrefixEntry:
        """The live prefix ``prefix_id`` of this salt.

        Raises:
            APIError: 404 ``prefix_not_found`` when unknown, expired or another tenant's.
        """
        self._expire()
        entry = self._entries.get(prefix_id)
        if entry is None or entry.salt != salt:
            raise not_found(
                f"prefix {shown(prefix_id)} not found (unknown or expired)",
                param="prefix_id",
                code="prefix_not_found",
            )
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

    def _next_expiry(self) -> float:
        """Seconds until the next live prefix expires (60 when none is live here: the pinned
        space is then held by pins this registry does not know, e.g. the engine's own)."""
        if not self._entries:
            return 60.0
        soonest = min(e.seconds_left() for e in self._entries.values())
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
