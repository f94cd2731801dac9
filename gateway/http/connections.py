"""HTTP/1 connections of the gateway: bounded, timed, and failing with OpenAI error objects.

aiohttp's own knobs where it has them, a thin subclass where it has none:

* **header timeout** — aiohttp's ``keepalive_timeout``: a connection whose next request's
  headers are not complete that many seconds after it opened (or after its previous
  response) is closed. aiohttp arms that timer at connection start and does not re-arm it on
  partial data, so a client sending one header byte every few seconds is closed on time.
* **header sizes** — aiohttp's ``max_line_size``, ``max_field_size``, ``max_headers``.
* **open connections** — aiohttp has no bound: ``GatewayServer`` refuses a connection beyond
  ``max_connections`` with a raw ``503`` error object and closes it, before any parsing.
  ``fd_budget()`` keeps that bound under the process's open-file limit (raised to its hard
  limit by ``raise_nofile_limit()``), so files (model weights) can still be opened under a
  connection flood.
* **protocol errors** — aiohttp's parser errors (bad request line, a TLS hello on the HTTP
  port, broken chunked framing, oversized or too many headers) never reach a middleware:
  aiohttp answers them from ``RequestHandler.handle_error`` with plain text. The subclass
  ``GatewayRequestHandler`` overrides that method to answer an OpenAI error object
  (431 for oversized/too many headers, 400 for the rest, 500 for an unhandled failure).
  A parser error met inside a body whose request already has its handler (undecodable
  ``Content-Encoding`` data arriving after the headers) fails that body at once, so the
  handler answers 400 now instead of waiting for the body timeout.

The request-level limits (declared ``Content-Length`` over the limit → 413 at once, body
timeout → 408) live in ``limits``.
"""

from __future__ import annotations

import json
import logging
import resource
import uuid
from typing import Any

from aiohttp import web
from aiohttp.http import RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from prefixgate.gateway.http import request_id
from prefixgate.gateway.http.errors import APIError, dialect_of_path, retry_after_headers

logger = logging.getLogger("prefixgate.gateway")

# File descriptors kept free for everything but client sockets: model files, upstream
# connections' overhead, logs, the event loop's own, worker threads' imports.
FD_RESERVE = 256


def raise_nofile_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most 2**20); return the new soft
    limit. Never raises: a platform without it keeps its limit."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        target = min(target, 1 << 20)
        if soft == resource.RLIM_INFINITY or soft >= target:
            return soft if soft != resource.RLIM_INFINITY else 1 << 20
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.info("open-file limit raised from %d to %d", soft, target)
        return target
    except (ValueError, OSError) as exc:  # pragma: no cover - platform dependent
        logger.warning("cannot raise the open-file limit: %s", exc)
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def fd_budget(fds_per_connection: int = 1) -> int:
    """Client connections the current soft open-file limit allows, ``FD_RESERVE`` kept free
    (at least 1). ``fds_per_connection`` is 2 in upstream mode (a client socket and its
    upstream socket)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, (soft - FD_RESERVE) // max(1, fds_per_connection))


def _raw_error(error: APIError) -> bytes:
    """A complete HTTP/1.1 response of ``error`` (``Connection: close``, a fresh
    ``x-request-id``) as bytes."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{request_id.HEADER}: {uuid.uuid4().hex}\r\n"
        "Connection: close\r\n"
    )
    if error.retry_after is not None:
        head += "".join(f"{k}: {v}\r\n" for k, v in retry_after_headers(error.retry_after).items())
    return head.encode() + b"\r\n" + body


_REASONS = {503: "Service Unavailable"}
_REFUSAL_LINGER_S = 1.0

_REFUSAL = APIError(
    503,
    "too many open connections to this server; retry shortly",
    code="too_many_connections",
    retry_after=1.0,
)


class GatewayRequestHandler(RequestHandler):
    """aiohttp's connection protocol with a connection bound and OpenAI error objects for
    the errors aiohttp raises before any handler runs (see the module docstring)."""

    __slots__ = ("refused", "_open_body")

    def connection_made(self, transport: Any) -> None:  # noqa: D401 - aiohttp's hook
        server = self._manager
        limit = getattr(server, "max_connections", 0)
        if isinstance(server, GatewayServer) and limit and len(server.connections) >= limit:
            self.refused = True
            server.refused += 1
            # Answer, half-close, and drop what the client sends meanwhile; closing at once
            # with its request unread would reset the connection before it reads the answer.
            transport.write(_raw_error(_REFUSAL))
            if transport.can_write_eof():
                transport.write_eof()
            self._loop.call_later(_REFUSAL_LINGER_S, transport.close)
            return
        self.refused = False
        self._open_body: StreamReader | None = None  # the body of the last request parsed
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if getattr(self, "refused", False):
            return  # never started: nothing of aiohttp's to tear down
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if getattr(self, "refused", False):
            return
        queued = len(self._messages)
        super().data_received(data)
        # aiohttp queues a parser error met inside a body (undecodable Content-Encoding data,
        # broken chunked framing arriving after the headers) as if it were a next request,
        # and the request whose body it is, already with its handler, waits for the rest of
        # that body until the body timeout. Fail that body at once instead: its handler's
        # read raises and the client gets its 400 now (``errors.error_middleware``).
        for msg, payload in list(self._messages)[queued:]:
            if isinstance(msg, RawRequestMessage):
                self._open_body = payload
                continue
            # a parser error (aiohttp's error record: ``exc``, ``message``)
            body = self._open_body
            if body is not None and not body.is_eof() and body.exception() is None:
                why = (
                    _reason(getattr(msg, "exc", None)) or getattr(msg, "message", "") or "bad body"
                )
                body.set_exception(web.RequestPayloadError(why))
            self._open_body = None

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The OpenAI error object of a protocol error (aiohttp's parser) or of an exception
        no middleware answered; the connection is closed after it."""
        if isinstance(exc, LineTooLong) or (
            isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower()
        ):
            error = APIError(
                431,
                f"request headers too large: {_reason(exc)}",
                code="request_headers_too_large",
                type="invalid_request_error",
            )
        elif status == 500:
            if exc is not None:
                logger.error("unhandled error on %s", getattr(request, "path", "?"), exc_info=exc)
            error = APIError(500, "internal server error", code="internal_error")
        elif status == 504:
            error = APIError(504, "the request timed out", code="timeout", type="timeout_error")
        else:
            logger.debug("protocol error from %s: %r", getattr(request, "remote", "?"), exc)
            error = APIError(
                status,
                f"malformed HTTP request: {_reason(exc) or message or 'bad request'}",
                code="invalid_http_request",
                type="invalid_request_error",
            )
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; cannot send an error")
        try:
            path = str(request.path)
        except Exception:  # noqa: BLE001 - a request line that did not parse has no path
            path = ""
        resp = error.response(dialect_of_path(path))
        # No app hook runs for these (``request_id.stamp``): a fresh id, the client's own
        # header is not trusted from a request that did not parse.
        resp.headers[request_id.HEADER] = uuid.uuid4().hex
        resp.force_close()
        return resp


def _reason(exc: BaseException | None) -> str:
    """aiohttp's parser message on one line, at most 200 characters."""
    if exc is None:
        return ""
    text = " ".join(str(getattr(exc, "message", None) or exc).split())
    text = text.removeprefix("400, message: ")
    return text[:200]


class GatewayServer(web.Server):
    """aiohttp's ``Server`` making ``GatewayRequestHandler`` connections, at most
    ``max_connections`` open at once (0 = unbounded); ``refused`` counts refusals."""

    def __init__(self, *args: Any, max_connections: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.refused = 0

    def __call__(self) -> RequestHandler:
        return GatewayRequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """``AppRunner`` whose server is a ``GatewayServer`` (aiohttp's ``_make_server`` builds the
    app's handler the same way; only the server class and its bound differ)."""

    def __init__(self, app: web.Application, *, max_connections: int = 0, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._max_connections = max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        ours = GatewayServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            max_connections=self._max_connections,
            **server._kwargs,
        )
        return ours
