"""Server-sent events (SSE) as the OpenAI API streams them.

Each event is ``data: <json>\\n\\n``, the stream ends with ``data: [DONE]\\n\\n``
(https://html.spec.whatwg.org/multipage/server-sent-events.html; OpenAI's streaming format).
Every event is written to the socket as it is produced: no compression, ``Cache-Control:
no-cache`` and ``X-Accel-Buffering: no`` so proxies (nginx) do not buffer either. A comment
line (``: keep-alive``) is sent while waiting for the first token so idle proxies and clients
keep the connection open.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def encode_event(obj: dict[str, Any]) -> bytes:
    """One SSE ``data:`` event holding ``obj`` as compact JSON (bytes, UTF-8)."""
    return encode_data(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def encode_data(payload: bytes) -> bytes:
    """One SSE ``data:`` event of an already serialized (single-line JSON) ``payload``."""
    return b"data: " + payload + b"\n\n"


class SSEWriter:
    """Writes SSE events of one response; ``last_write`` is the monotonic time of the last one.

    Raises (from every write): ``ConnectionResetError`` when the client has gone away.
    """

    __slots__ = ("request", "response", "last_write", "keepalive_bytes")

    def __init__(self, request: web.Request, keepalive: bytes = KEEPALIVE) -> None:
        self.request = request
        self.keepalive_bytes = keepalive  # what ``keepalive`` sends (a dialect may differ)
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.last_write = time.monotonic()

    async def open(self) -> None:
        """Send the status line and headers."""
        await self.response.prepare(self.request)
        self.last_write = time.monotonic()

    async def send(self, obj: dict[str, Any]) -> None:
        """Send one ``data:`` event."""
        await self.write(encode_event(obj))

    async def keepalive(self) -> None:
        """Send a comment line (ignored by SSE parsers), or the writer's own keep-alive."""
        await self.write(self.keepalive_bytes)

    async def write(self, data: bytes) -> None:
        """Send raw bytes (already SSE-framed)."""
        await self.response.write(data)
        self.last_write = time.monotonic()

    async def done(self) -> None:
        """Send ``data: [DONE]`` and end the response."""
        await self.response.write(DONE)
        await self.response.write_eof()


CLIENT_LEFT: web.ResponseKey[bool] = web.ResponseKey("prefixgate_client_left", bool)


def client_left(response: web.StreamResponse) -> web.StreamResponse:
    """Mark a streamed ``response`` its client left before its end (a write raised
    ``ConnectionResetError``): the request counter and the access log then record it as
    ``499 client_gone``, not as the ``200`` the stream began with. Returns ``response``."""
    response[CLIENT_LEFT] = True
    return response


async def end_stream(response: web.StreamResponse, last: bytes | None = None) -> web.StreamResponse:
    """End a streamed ``response``: write ``last`` (its closing or error event; None:
    nothing more), then the end of the body; a client that left meanwhile is marked
    (``client_left``). Returns ``response``."""
    try:
        if last is not None:
            await response.write(last)
        await response.write_eof()
    except ConnectionResetError:
        return client_left(response)
    return response


def client_gone(request: web.Request) -> bool:
    """True when the client's connection is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()
