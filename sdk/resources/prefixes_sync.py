"""``client.prefixes`` of the blocking ``Client`` and its ``SyncPrefixSession`` (the
parameters, ``PrefixCreateParams``, are stated once in ``prefixes.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self, Unpack

from .._blocking import Bridge, SyncResource, SyncStream
from .._options import CallOptions
from ..types import ChatCompletion, ChatCompletionChunk, Prefix, PrefixDeleted
from ._common import takes
from .prefixes import AsyncPrefixes, PrefixCreateParams, PrefixSession

__all__ = ["SyncPrefixSession", "SyncPrefixes"]


class SyncPrefixSession:
    """Blocking ``PrefixSession`` (context manager: leaving it deletes the prefix)."""

    def __init__(self, session: PrefixSession, bridge: Bridge) -> None:
        self.session = session
        self._bridge = bridge

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def create(
        self, user: str | Sequence[Mapping[str, Any]], **params: Any
    ) -> ChatCompletion | SyncStream[ChatCompletionChunk]:
        """Blocking ``PrefixSession.create`` (``params``: ``chat.completions.create``'s
        keywords, checked there)."""
        result: ChatCompletion | SyncStream[ChatCompletionChunk] = self._bridge.run(
            self.session.create, user, **params
        )
        return result

    def batch(
        self,
        users: Sequence[str | Sequence[Mapping[str, Any]]],
        *,
        progress: bool = False,
        **params: Any,
    ) -> list[ChatCompletion | Exception]:
        """Blocking ``PrefixSession.batch``."""
        result: list[ChatCompletion | Exception] = self._bridge.run(
            self.session.batch, users, progress=progress, **params
        )
        return result

    def close(self) -> None:
        """Delete the prefix."""
        self._bridge.run(self.session.close)


class SyncPrefixes(SyncResource[AsyncPrefixes]):
    """``client.prefixes`` (see ``AsyncPrefixes``)."""

    @takes(PrefixCreateParams)
    def create(self, **params: Unpack[PrefixCreateParams]) -> Prefix:
        """Blocking ``AsyncPrefixes.create``."""
        result: Prefix = self._bridge.run(self._async.create, **params)
        return result

    @takes(CallOptions)
    def get(self, prefix_id: str, **options: Unpack[CallOptions]) -> Prefix:
        """Blocking ``AsyncPrefixes.get``."""
        result: Prefix = self._bridge.run(self._async.get, prefix_id, **options)
        return result

    @takes(CallOptions)
    def delete(self, prefix_id: str, **options: Unpack[CallOptions]) -> PrefixDeleted:
        """Blocking ``AsyncPrefixes.delete``."""
        result: PrefixDeleted = self._bridge.run(self._async.delete, prefix_id, **options)
        return result

    def session(
        self,
        system_prompt: str | Sequence[Mapping[str, Any]],
        *,
        model: str,
        ttl_seconds: float = 600.0,
    ) -> SyncPrefixSession:
        """A blocking ``PrefixSession``."""
        s = self._async.session(system_prompt, model=model, ttl_seconds=ttl_seconds)
        return SyncPrefixSession(s, self._bridge)
