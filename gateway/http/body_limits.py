"""Request-body limits, checked before a handler runs (a middleware inside ``error_middleware``).

* A declared ``Content-Length`` over ``max_body_bytes`` is answered 413 at once, before any
  of the body is read (aiohttp's own ``client_max_size`` only trips while reading, so a
  declared 100 GB body would be waited for).
* The whole body must arrive within ``body_timeout_s`` seconds, else 408 (a client sending
  one byte every few seconds holds a connection and a handler otherwise). aiohttp has no
  body timeout of its own; the body is read here (``request.read()`` caches it, so the
  handler's own ``read()`` returns it at once). A chunked body over the size limit is still
  refused by aiohttp's ``client_max_size`` while it is read (413 through ``error_middleware``).

Both answers close the connection: the rest of the body is never read.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from prefixgate.gateway.http.errors import APIError, Handler, dialect_of
from prefixgate.gateway.settings import SETTINGS


@web.middleware
async def body_limits_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """413 for a declared body over the limit; the body read within ``body_timeout_s``."""
    if request.can_read_body:
        s = request.app[SETTINGS]
        declared = request.content_length
        if declared is not None and declared > s.max_body_bytes:
            return _closing(
                request,
                APIError(
                    413,
                    f"request body too large: Content-Length {declared} exceeds the limit of "
                    f"{s.max_body_bytes} bytes",
                    code="request_too_large",
                ),
            )
        try:
            async with asyncio.timeout(s.body_timeout_s):
                await request.read()
        except TimeoutError:
            return _closing(
                request,
                APIError(
                    408,
                    f"the request body did not arrive within {s.body_timeout_s:g} s",
                    code="request_timeout",
                    type="invalid_request_error",
                ),
            )
    return await handler(request)


def _closing(request: web.Request, error: APIError) -> web.Response:
    resp = error.response(dialect_of(request))
    resp.force_close()
    return resp
