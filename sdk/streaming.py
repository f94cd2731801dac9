"""Server-sent events: the line parser and the typed chunk stream of ``stream=True`` calls.

Parsing follows the WHATWG HTML "Server-sent events" event-stream grammar (see ``SSEDecoder``).
Lines are split on bytes (not with ``str.splitlines``, which would also break a JSON payload
at a raw U+2028 or form feed), then decoded as UTF-8. The OpenAI API ends a stream with
``data: [DONE]``; a stream that ends without it was cut short and raises.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

import anyio
import httpx

from .errors import APIConnectionError, APIError, APIResponseValidationError, APITimeoutError

__all__ = ["ServerSentEvent", "SSEDecoder", "AsyncStream"]

T = TypeVar("T")


@dataclass(slots=True)
class ServerSentEvent:
    """One dispatched event: ``event`` name (None: the default "message"), joined ``data``."""

    data: str
    event: str | None = None
    id: str | None = None
    retry: int | None = None
    """The last ``retry`` announced (milliseconds); recorded only, this client never
    reconnects."""

    def json(self) -> Any:
        """``data`` decoded as JSON (raises ``json.JSONDecodeError``)."""
        return json.loads(self.data)


_BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark, dropped at the start of a stream
_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEDecoder:
    """Incremental event-stream parser: ``feed(bytes)`` returns the events completed so far.

    The WHATWG HTML standard, section 9.2.6 "Interpreting an event stream", step by step: one
    leading UTF-8 byte-order mark is dropped (even when split across reads); lines end in
    CRLF, LF or CR (a CRLF split across two reads is one line end); a line starting with
    ``:`` is a comment; ``name:value`` with one optional space after the colon, a line with
    no colon is a field with an empty value; ``data`` lines append to the data buffer (joined
    with LF); ``event`` sets the type (empty: the default ``"message"``, reported as None);
    ``id`` sets the last event id (kept across events, ignored when it holds NUL); ``retry``
    with only ASCII digits is recorded (this client never reconnects, so it has no effect);
    other fields are ignored; a blank line dispatches the event unless its data buffer is
    empty (an event with no ``data`` line is dropped, a ``data:`` with an empty value is an
    event with empty data); at the end of the stream an unfinished event is discarded.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._at_start = True
        self._pending_cr = False
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None

    @property
    def mid_event(self) -> bool:
        """True when bytes of an event not yet dispatched were received (a truncated end)."""
        return bool(self._buf or self._data or self._event)

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Parse ``chunk`` (any split of the byte stream); return the dispatched events."""
        data = self._buf + chunk
        if self._at_start:
            if len(data) < len(_BOM) and _BOM.startswith(data):
                self._buf = data  # maybe the start of a BOM: wait for more bytes
                return []
            if data.startswith(_BOM):
                data = data[len(_BOM) :]
            self._at_start = False
        if self._pending_cr and data:
            self._pending_cr = False
            if data[0] == 0x0A:  # the LF of a CRLF split across two reads
                data = data[1:]
        out: list[ServerSentEvent] = []
        start = 0
        for match in _LINE_END.finditer(data):
            event = self.feed_line(data[start : match.start()].decode("utf-8", errors="replace"))
            if event is not None:
                out.append(event)
            start = match.end()
            if match.group() == b"\r" and start == len(data):
                self._pending_cr = True
        self._buf = data[start:]
        return out

    def flush(self) -> list[ServerSentEvent]:
        """End of stream: an unfinished event is discarded (the standard's rule); returns []."""
        self._buf = b""
        self._data = []
        self._event = None
        return []

    def feed_line(self, line: str) -> ServerSentEvent | None:
        """Process one line (without its terminator); return an event on a blank line."""
        if not line:
            if not self._data:
                self._event = None  # an event with no data is not dispatched
                return None
            event = ServerSentEvent("\n".join(self._data), self._event, self._id, self._retry)
            self._data = []
            self._event = None
            return event
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value or None
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self._retry = int(value)
        return None


@dataclass(eq=False)
class AsyncStream(Generic[T]):
    """Async iterator (and async context manager) of typed chunks from an SSE response.

    Leaving the ``async with`` block, breaking out of ``async for`` or calling ``close()``
    closes the HTTP response (the connection is not reused mid-body) and frees the client's
    concurrency slot. A stream is never retried once created: a failure mid-stream raises
    ``APIConnectionError`` (``APITimeoutError`` when no chunk arrives within
    ``idle_timeout`` seconds), and so does a body that ends before ``data: [DONE]``; an ``{"error": ...}`` event raises ``APIError``; a chunk that
    is JSON but not an object of the chunk's shape raises ``APIResponseValidationError``.
    """

    response: httpx.Response
    cast: Callable[[Any], T]
    """Builds one chunk from its decoded JSON (raises TypeError/ValueError on a wrong shape)."""
    idle_timeout: float | None = field(default=None, kw_only=True)
    """Seconds to wait for each chunk (None: no limit)."""
    on_close: Callable[[], None] | None = field(default=None, kw_only=True)
    """Called once when the stream closes (frees the client's concurrency slot)."""
    end_events: frozenset[str] | None = field(default=None, kw_only=True)
    """A stream without ``data: [DONE]`` (the Responses API's): the event ``type``s that end
    it (``response.completed``, ...); it closes after yielding one, and a body that ends
    before one was cut short. None: the stream ends with ``data: [DONE]``."""
    _closed: bool = field(default=False, init=False)
    _iterator: AsyncIterator[T] | None = field(default=None, init=False)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[T]:
        # A fresh generator per loop: when an ``async for`` exits early the loop drops it, the
        # event loop's async-generator finalizer runs its ``finally`` and the stream closes,
        # even while the caller still holds this object.
        return self._loop()

    async def __anext__(self) -> T:
        """The next chunk (``StopAsyncIteration`` at the end); for manual iteration."""
        return await self._source().__anext__()

    def _source(self) -> AsyncIterator[T]:
        if self._iterator is None:
            self._iterator = self._iterate()
        return self._iterator

    async def _loop(self) -> AsyncIterator[T]:
        source = self._source()
        try:
            while True:
                try:
                    item = await source.__anext__()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            with anyio.CancelScope(shield=True):
                await source.aclose()  # type: ignore[attr-defined]
                await self.close()

    async def close(self) -> None:
        """Close the response and free the slot (idempotent, safe under cancellation)."""
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self.response.aclose()
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _events(self) -> AsyncGenerator[ServerSentEvent, None]:
        decoder = SSEDecoder()
        async for chunk in self.response.aiter_bytes():
            for event in decoder.feed(chunk):
                yield event
        decoder.flush()

    async def _iterate(self) -> AsyncIterator[T]:
        events = self._events()
        try:
            while True:
                try:
                    with anyio.fail_after(self.idle_timeout):
                        sse = await events.__anext__()
                except StopAsyncIteration:
                    # Every OpenAI-compatible stream ends with ``data: [DONE]`` (or, with
                    # ``end_events``, one of those): a body that closes before it was cut short
                    # (a proxy, a crash, a drop), never a success.
                    final = (
                        "`data: [DONE]`"
                        if self.end_events is None
                        else " / ".join(f"`{e}`" for e in sorted(self.end_events))
                    )
                    raise APIConnectionError(
                        f"Stream ended before its final {final} event: the answer is truncated.",
                        self.response.request,
                    ) from None
                except TimeoutError:
                    raise APITimeoutError(
                        f"No stream chunk within {self.idle_timeout} s.", self.response.request
                    ) from None
                except httpx.TimeoutException as exc:
                    raise APITimeoutError(request=self.response.request) from exc
                except httpx.TransportError as exc:
                    raise APIConnectionError(
                        f"Stream broken: {exc!r}", self.response.request
                    ) from exc
                if sse.data.startswith("[DONE]"):
                    return
                try:
                    data = sse.json()
                except json.JSONDecodeError as exc:
                    raise APIError(
                        f"Stream event is not JSON: {sse.data[:200]!r}", self.response.request
                    ) from exc
                if sse.event == "error" or (isinstance(data, dict) and "error" in data):
                    err = data.get("error") if isinstance(data, dict) else None
                    msg = err.get("message") if isinstance(err, dict) else str(err or data)
                    raise APIError(f"Stream error: {msg}", self.response.request, body=data)
                try:
                    item = self.cast(data)
                except (TypeError, ValueError) as exc:  # a chunk that is not the promised shape
                    raise APIResponseValidationError(
                        f"Unexpected stream chunk shape: {exc}", self.response, body=data
                    ) from exc
                yield item
                if self.end_events is not None and isinstance(data, dict):
                    if data.get("type") in self.end_events:
                        return
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()
                await self.close()
