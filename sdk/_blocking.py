"""The blocking bridge under ``Client``: an ``AsyncClient`` runs on an event loop in a
background thread (an anyio blocking portal); ``Bridge`` calls into it and wraps what comes
back, so streams become ``SyncStream`` (iterator + context manager) and
``with_streaming_response`` bodies ``SyncAPIResponse``. The blocking resources
(``resources/*_sync.py``) are built on it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any, Generic, Self, TypeVar

import anyio.from_thread
import httpx

from ._response import APIResponse, AsyncAPIResponse, _ResponseInfo, call_in_mode
from .streaming import AsyncStream

__all__ = ["Bridge", "RawMethods", "SyncAPIResponse", "SyncResponseContextManager", "SyncStream"]

T = TypeVar("T")


class SyncStream(Generic[T]):
    """Blocking iterator (and context manager) over an ``AsyncStream``.

    Breaking out of the ``for`` loop or leaving the ``with`` block closes the response.
    """

    def __init__(self, stream: AsyncStream[T], portal: anyio.from_thread.BlockingPortal) -> None:
        self._stream = stream
        self._portal = portal

    @property
    def response(self) -> httpx.Response:
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


class SyncAPIResponse(_ResponseInfo, Generic[T]):
    """Blocking ``AsyncAPIResponse`` (``with_streaming_response``): the body is read on demand;
    leaving the ``with`` block closes it."""

    def __init__(self, response: AsyncAPIResponse[T], portal: anyio.from_thread.BlockingPortal):
        self._async = response
        self._portal = portal
        self.http_response = response.http_response

    def parse(self) -> T:
        """The typed result (a ``SyncStream`` for ``stream=True``)."""
        result = self._portal.call(self._async.parse)
        if isinstance(result, AsyncStream):
            return SyncStream(result, self._portal)  # type: ignore[return-value]
        return result

    def read(self) -> bytes:
        return self._portal.call(self._async.read)

    def text(self) -> str:
        return self._portal.call(self._async.text)

    def json(self) -> Any:
        return self._portal.call(self._async.json)

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        return self._iterate(self._async.iter_bytes(chunk_size))

    def iter_text(self, chunk_size: int | None = None) -> Iterator[str]:
        return self._iterate(self._async.iter_text(chunk_size))

    def iter_lines(self) -> Iterator[str]:
        return self._iterate(self._async.iter_lines())

    def close(self) -> None:
        """Close the response and free the call's concurrency slot (idempotent)."""
        self._portal.call(self._async.close)

    def _iterate(self, source: AsyncGenerator[Any, None]) -> Iterator[Any]:
        try:
            while True:
                try:
                    yield self._portal.call(source.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self._portal.call(source.aclose)


class SyncResponseContextManager(Generic[T]):
    """``with`` around a blocking ``with_streaming_response`` call: closes it on exit."""

    def __init__(self, open_response: Callable[[], SyncAPIResponse[T]]) -> None:
        self._open = open_response
        self._response: SyncAPIResponse[T] | None = None

    def __enter__(self) -> SyncAPIResponse[T]:
        self._response = self._open()
        return self._response

    def __exit__(self, *exc_info: object) -> None:
        if self._response is not None:
            self._response.close()


class Bridge:
    """Runs coroutines of the wrapped client on the portal and wraps what comes back."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal) -> None:
        self.portal = portal

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self.portal.call(functools.partial(fn, *args, **kwargs)))

    def raw(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` answered as an ``APIResponse`` (``with_raw_response``)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.run(call_in_mode, "raw", fn, *args, **kwargs)

        call.__doc__ = fn.__doc__
        return call

    def streamed(self, fn: Callable[..., Any]) -> Callable[..., SyncResponseContextManager[Any]]:
        """``fn`` as a ``with`` block of a ``SyncAPIResponse`` (``with_streaming_response``)."""

        def call(*args: Any, **kwargs: Any) -> SyncResponseContextManager[Any]:
            def open_response() -> SyncAPIResponse[Any]:
                response = self.portal.call(
                    functools.partial(call_in_mode, "streaming", fn, *args, **kwargs)
                )
                return SyncAPIResponse(response, self.portal)

            return SyncResponseContextManager(open_response)

        call.__doc__ = fn.__doc__
        return call

    def _wrap(self, result: Any) -> Any:
        if isinstance(result, AsyncStream):
            return SyncStream(result, self.portal)
        if isinstance(result, APIResponse) and isinstance(result._parsed, AsyncStream):
            result._parsed = SyncStream(result._parsed, self.portal)
        return result


class RawMethods:
    """``with_raw_response`` / ``with_streaming_response`` of a blocking resource: the named
    methods of its async twin, bridged."""

    def __init__(self, bridge: Bridge, target: Any, names: Sequence[str], streamed: bool):
        for name in names:
            method = getattr(target, name)
            setattr(self, name, bridge.streamed(method) if streamed else bridge.raw(method))
