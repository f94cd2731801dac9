"""The blocking bridge under ``Client``: an ``AsyncClient`` runs on an event loop in a daemon
thread (an anyio blocking portal); ``Bridge`` calls into it and wraps what comes back, so
streams become ``SyncStream`` (iterator + context manager) and ``with_streaming_response``
bodies ``SyncAPIResponse``. The blocking resources (``resources/*_sync.py``) are built on it.

Lifetime, as openai-python's blocking client (which needs no thread): the thread starts on
the first call (a client never used starts none) and stops, after closing the connection
pool, at ``Bridge.close()`` (``Client.close()``), when the last object that can call into it
(client, copy, resource, stream) is garbage-collected, or at interpreter exit, whichever comes
first (``weakref.finalize``); the last two say ``ResourceWarning: unclosed Client``. The thread
is a daemon: an unclosed client never keeps a process from exiting. Any number of threads may
call one bridge at once. A call made inside a running event loop raises ``RuntimeError``
naming ``AsyncClient`` (it would block that loop).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from typing import Any, Generic, Protocol, Self, TypeVar

import anyio
import httpx
from anyio.from_thread import BlockingPortal

from ._response import (
    APIResponse,
    AsyncAPIResponse,
    ResponseMethods,
    _ResponseInfo,
    call_in_mode,
)
from .streaming import AsyncStream

__all__ = [
    "Bridge",
    "SyncAPIResponse",
    "SyncResource",
    "SyncResponseContextManager",
    "SyncStream",
]


class _AsyncResource(Protocol):
    """What ``SyncResource`` reads of its async twin besides the methods it bridges."""

    @property
    def raw_methods(self) -> tuple[str, ...]: ...

    @property
    def streamed_methods(self) -> tuple[str, ...]: ...


T = TypeVar("T")
R = TypeVar("R", bound=_AsyncResource)

_JOIN_TIMEOUT_S = 10.0  # most seconds close() waits for the loop thread to finish


def refuse_in_event_loop() -> None:
    """Raise ``RuntimeError`` when the calling thread runs an event loop (asyncio or trio):
    a blocking call there would stall every task of that loop."""
    try:
        anyio.get_current_task()
    except RuntimeError:  # no event loop in this thread: blocking is fine
        return
    raise RuntimeError(
        "prefixgate.sdk.Client blocks, and this thread runs an event loop: use "
        "prefixgate.sdk.AsyncClient here (await client.chat.completions.create(...)), or "
        "call the blocking Client from a worker thread (anyio.to_thread.run_sync)"
    )


class _LoopThread:
    """The daemon thread and its event loop; shared by a ``Bridge`` and its finalizer, so it
    never refers back to the bridge (the bridge stays collectable)."""

    def __init__(self, on_stop: Callable[[], Awaitable[None]]) -> None:
        self._on_stop = on_stop
        self._lock = threading.RLock()
        self._portal: BlockingPortal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def portal(self) -> BlockingPortal:
        """The running portal, started on first use. Raises ``RuntimeError`` once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this Client is closed")
            if self._portal is None:
                ready: Future[BlockingPortal] = Future()
                thread = threading.Thread(
                    target=self._run, args=(ready,), name="prefixgate-client-loop", daemon=True
                )
                thread.start()
                self._portal = ready.result()
                self._thread = thread
            return self._portal

    def _run(self, ready: Future[BlockingPortal]) -> None:
        try:
            anyio.run(self._serve, ready, backend="asyncio")
        except BaseException as exc:  # a failed start reaches the caller of portal()
            if not ready.done():
                ready.set_exception(exc)

    async def _serve(self, ready: Future[BlockingPortal]) -> None:
        async with BlockingPortal() as portal:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            ready.set_result(portal)
            await self._stop.wait()
            with anyio.CancelScope(shield=True):
                # Calls still in flight (another thread's, or one a Ctrl-C left behind) are
                # cancelled, so they free their slots and responses, then the pool closes.
                await portal.stop(cancel_remaining=True)
                await self._on_stop()

    def shut_down(self, unclosed: bool) -> None:
        """Close the pool and stop the thread (idempotent, from any thread). ``unclosed``:
        called by the finalizer (collection or exit), so warn."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and thread is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop is already gone
                pass
            else:
                if threading.current_thread() is not thread:
                    thread.join(_JOIN_TIMEOUT_S)
        if unclosed:
            warnings.warn(
                "unclosed prefixgate.sdk.Client: call close() or use `with Client(...)`",
                ResourceWarning,
                stacklevel=2,
            )


class SyncStream(Generic[T]):
    """Blocking iterator (and context manager) over an ``AsyncStream``.

    Breaking out of the ``for`` loop or leaving the ``with`` block closes the response.
    """

    def __init__(self, stream: AsyncStream[T], bridge: Bridge) -> None:
        self._stream = stream
        self._bridge = bridge

    @property
    def response(self) -> httpx.Response:
        """The underlying ``httpx.Response``."""
        return self._stream.response

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[T]:
        return self._bridge.iterate(self._stream, self._stream.close)

    def close(self) -> None:
        """Close the response and free the concurrency slot (idempotent)."""
        self._bridge.call(self._stream.close)


class SyncAPIResponse(_ResponseInfo, Generic[T]):
    """Blocking ``AsyncAPIResponse`` (``with_streaming_response``): the body is read on demand;
    leaving the ``with`` block closes it."""

    def __init__(self, response: AsyncAPIResponse[T], bridge: Bridge):
        self._async = response
        self._bridge = bridge
        self.http_response = response.http_response

    def parse(self) -> T:
        """The typed result (a ``SyncStream`` for ``stream=True``)."""
        result: T = self._bridge.run(self._async.parse)
        return result

    def read(self) -> bytes:
        result: bytes = self._bridge.call(self._async.read)
        return result

    def text(self) -> str:
        result: str = self._bridge.call(self._async.text)
        return result

    def json(self) -> Any:
        return self._bridge.call(self._async.json)

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        source = self._async.iter_bytes(chunk_size)
        return self._bridge.iterate(source, source.aclose)

    def iter_text(self, chunk_size: int | None = None) -> Iterator[str]:
        source = self._async.iter_text(chunk_size)
        return self._bridge.iterate(source, source.aclose)

    def iter_lines(self) -> Iterator[str]:
        source = self._async.iter_lines()
        return self._bridge.iterate(source, source.aclose)

    def close(self) -> None:
        """Close the response and free the call's concurrency slot (idempotent)."""
        self._bridge.call(self._async.close)


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
    """Runs coroutines of the wrapped client on its loop thread and wraps what comes back.

    Args:
        on_stop: awaited on the loop before it stops (the ``AsyncClient``'s ``close``).
    """

    def __init__(self, on_stop: Callable[[], Awaitable[None]]) -> None:
        self._thread = _LoopThread(on_stop)
        self._finalizer = weakref.finalize(self, self._thread.shut_down, True)

    def call(self, fn: Callable[..., Awaitable[Any]], /, *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` on the loop thread, its result as is.

        Raises:
            RuntimeError: called inside a running event loop, or after ``close()``.
        """
        refuse_in_event_loop()
        return self._thread.portal().call(functools.partial(fn, *args, **kwargs))

    def run(self, fn: Callable[..., Awaitable[Any]], /, *args: Any, **kwargs: Any) -> Any:
        """``call`` whose streams come back blocking (``SyncStream``)."""
        return self._wrap(self.call(fn, *args, **kwargs))

    def iterate(self, source: Any, close: Callable[[], Awaitable[Any]]) -> Iterator[Any]:
        """The items of the async iterator ``source``, one blocking call each; ``close`` is
        awaited when the iteration ends, breaks or fails."""
        interrupted = False
        try:
            while True:
                try:
                    item = self.call(source.__anext__)
                except StopAsyncIteration:
                    return
                except KeyboardInterrupt:  # the call may still run on the loop, holding the
                    interrupted = True  # response: closing must not wait on it
                    raise
                yield item
        finally:
            if interrupted:
                try:  # the loop's stop cancels what is left of both at exit
                    self._thread.portal().start_task_soon(close)
                except RuntimeError:  # the client is closed already
                    pass
            else:
                self.call(close)

    def close(self) -> None:
        """Close the pool (``on_stop``) and stop the thread; idempotent, no warning."""
        if self._finalizer.detach() is not None:
            self._thread.shut_down(False)

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
                response = self.call(call_in_mode, "streaming", fn, *args, **kwargs)
                return SyncAPIResponse(response, self)

            return SyncResponseContextManager(open_response)

        call.__doc__ = fn.__doc__
        return call

    def _wrap(self, result: Any) -> Any:
        if isinstance(result, AsyncStream):
            return SyncStream(result, self)
        if isinstance(result, APIResponse) and isinstance(result._parsed, AsyncStream):
            result._parsed = SyncStream(result._parsed, self)
        return result


class SyncResource(Generic[R]):
    """A blocking resource over its async twin ``R`` (``_async``), run through ``_bridge``;
    ``with_raw_response`` / ``with_streaming_response`` bridge the methods the async twin
    names in its ``raw_methods`` / ``streamed_methods``."""

    def __init__(self, resource: R, bridge: Bridge) -> None:
        self._async = resource
        self._bridge = bridge
        self.with_raw_response = ResponseMethods(resource, resource.raw_methods, bridge.raw)
        self.with_streaming_response = ResponseMethods(
            resource, resource.streamed_methods, bridge.streamed
        )
