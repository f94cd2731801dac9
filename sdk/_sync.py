"""``Client``: the blocking twin of ``AsyncClient``, same surface, same behaviour.

It runs an ``AsyncClient`` on an event loop in a background thread (an anyio blocking portal)
and calls into it, so limits, retries, streaming and batches behave exactly as in the async
client; several threads may share one ``Client`` (its concurrency limit is then shared too).
Streams come back as ``SyncStream`` (iterator + context manager).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Self, TypeVar

import anyio.from_thread

from ._client import AsyncClient
from .resources.prefixes import PrefixSession
from .streaming import AsyncStream
from .types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelInfo,
    ModelList,
    Prefix,
    PrefixDeleted,
)

__all__ = ["Client", "SyncStream"]

T = TypeVar("T")


class SyncStream(Generic[T]):
    """Blocking iterator (and context manager) over an ``AsyncStream``.

    Breaking out of the ``for`` loop or leaving the ``with`` block closes the response.
    """

    def __init__(self, stream: AsyncStream[T], portal: anyio.from_thread.BlockingPortal) -> None:
        self._stream = stream
        self._portal = portal

    @property
    def response(self):
        """The underlying ``httpx.Response``."""
        return self._stream.response

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._portal.call(self._stream.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Close the response and free the concurrency slot (idempotent)."""
        self._portal.call(self._stream.close)


class _Bridge:
    """Runs coroutines of the wrapped client on the portal and wraps what comes back."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal) -> None:
        self._portal = portal

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        result = self._portal.call(functools.partial(fn, *args, **kwargs))
        if isinstance(result, AsyncStream):
            return SyncStream(result, self._portal)
        return result


class SyncChatCompletions:
    """``client.chat.completions`` (see ``AsyncChatCompletions`` for the parameters)."""

    def __init__(self, client: AsyncClient, bridge: _Bridge) -> None:
        self._async = client.chat.completions
        self._bridge = bridge

    def create(self, **params: Any) -> ChatCompletion | SyncStream[ChatCompletionChunk]:
        """Blocking ``AsyncChatCompletions.create``."""
        return self._bridge.run(self._async.create, **params)

    def batch(
        self, requests: Sequence[Mapping[str, Any]], *, progress: bool = False
    ) -> list[ChatCompletion | Exception]:
        """Blocking ``AsyncChatCompletions.batch`` (runs concurrently under the limit)."""
        return self._bridge.run(self._async.batch, requests, progress=progress)


class SyncChat:
    """``client.chat``."""

    def __init__(self, client: AsyncClient, bridge: _Bridge) -> None:
        self.completions = SyncChatCompletions(client, bridge)


class SyncCompletions:
    """``client.completions`` (see ``AsyncCompletions``)."""

    def __init__(self, client: AsyncClient, bridge: _Bridge) -> None:
        self._async = client.completions
        self._bridge = bridge

    def create(self, **params: Any) -> Completion | SyncStream[Completion]:
        """Blocking ``AsyncCompletions.create``."""
        return self._bridge.run(self._async.create, **params)

    def batch(
        self, requests: Sequence[Mapping[str, Any]], *, progress: bool = False
    ) -> list[Completion | Exception]:
        """Blocking ``AsyncCompletions.batch``."""
        return self._bridge.run(self._async.batch, requests, progress=progress)


class SyncModels:
    """``client.models`` (see ``AsyncModels``)."""

    def __init__(self, client: AsyncClient, bridge: _Bridge) -> None:
        self._async = client.models
        self._bridge = bridge

    def list(self, **options: Any) -> ModelList:
        """Blocking ``AsyncModels.list``."""
        return self._bridge.run(self._async.list, **options)

    def retrieve(self, model: str, **options: Any) -> ModelInfo:
        """Blocking ``AsyncModels.retrieve``."""
        return self._bridge.run(self._async.retrieve, model, **options)


class SyncPrefixSession:
    """Blocking ``PrefixSession`` (context manager: leaving it deletes the prefix)."""

    def __init__(self, session: PrefixSession, bridge: _Bridge) -> None:
        self.session = session
        self._bridge = bridge

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def create(
        self, user: str | Sequence[Mapping[str, Any]], **params: Any
    ) -> ChatCompletion | SyncStream[ChatCompletionChunk]:
        """Blocking ``PrefixSession.create``."""
        return self._bridge.run(self.session.create, user, **params)

    def batch(
        self, users: Sequence[str | Sequence[Mapping[str, Any]]], **params: Any
    ) -> list[ChatCompletion | Exception]:
        """Blocking ``PrefixSession.batch``."""
        return self._bridge.run(self.session.batch, users, **params)

    def close(self) -> None:
        """Delete the prefix."""
        self._bridge.run(self.session.close)


class SyncPrefixes:
    """``client.prefixes`` (see ``AsyncPrefixes``)."""

    def __init__(self, client: AsyncClient, bridge: _Bridge) -> None:
        self._async = client.prefixes
        self._bridge = bridge

    def create(self, **params: Any) -> Prefix:
        """Blocking ``AsyncPrefixes.create``."""
        return self._bridge.run(self._async.create, **params)

    def get(self, prefix_id: str, **options: Any) -> Prefix:
        """Blocking ``AsyncPrefixes.get``."""
        return self._bridge.run(self._async.get, prefix_id, **options)

    def delete(self, prefix_id: str, **options: Any) -> PrefixDeleted:
        """Blocking ``AsyncPrefixes.delete``."""
        return self._bridge.run(self._async.delete, prefix_id, **options)

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


class Client:
    """Blocking client; takes exactly ``AsyncClient``'s arguments (see there).

    Call ``close()`` (or use ``with Client(...) as client``) to stop its background thread.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, **kwargs: Any):
        self._exit = contextlib.ExitStack()
        self._portal = self._exit.enter_context(anyio.from_thread.start_blocking_portal())
        try:
            self._async = AsyncClient(base_url, api_key, **kwargs)
        except BaseException:
            self._exit.close()
            raise
        bridge = _Bridge(self._portal)
        self.base_url = self._async.base_url
        self.api_key = self._async.api_key
        self.chat = SyncChat(self._async, bridge)
        self.completions = SyncCompletions(self._async, bridge)
        self.models = SyncModels(self._async, bridge)
        self.prefixes = SyncPrefixes(self._async, bridge)
        self._closed = False

    @property
    def async_client(self) -> AsyncClient:
        """The wrapped ``AsyncClient`` (lives on the background loop)."""
        return self._async

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool and stop the background thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._async.close)
        finally:
            self._exit.close()
