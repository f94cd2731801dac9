"""Graceful shutdown with explicit endings (``drain``), and the middleware it relies on.

On SIGTERM the server (``drain``):

1. stops accepting: the listening sockets close; a new request on a kept-alive connection is
   answered 503 ``server_shutting_down`` (``Connection: close``);
2. lets the requests in flight finish for up to ``grace_s`` seconds;
3. then ends every request still running explicitly: its handler is cancelled (which aborts
   its engine requests or closes its upstream connection) and

   * a started stream gets its dialect's in-band error ending and its end — no ``[DONE]``,
     no ``response.completed`` / ``message_stop``, so clients raise instead of returning a
     truncated answer as complete. The ending is the one the route registered with
     ``end_streams_with`` (its renderer's ``error_event``: chat and completions ``data:
     {"error": {...}}`` as OpenAI's and vLLM's servers end a failed stream; Responses an
     ``error`` event then ``response.failed``; Messages Anthropic's ``event: error``), else
     the route's error dialect (``errors.error_event``: proxy relays);
   * a request not yet answered gets a 503 error object (code ``server_shutting_down``);

4. closes the remaining connections. The whole takes at most ``grace_s`` plus a fraction of
   a second.

``drain_middleware`` (the outermost middleware) runs each handler as a task it can end this
way; ``on_response_prepare`` remembers each request's started response.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prefixgate.gateway.http.access_log import stream_cut
from prefixgate.gateway.http.errors import APIError, Handler, dialect_of, error_event

logger = logging.getLogger("prefixgate.gateway")


class Drain:
    """The in-flight handlers of one app and its shutdown state."""

    __slots__ = ("active", "draining", "_ending")

    def __init__(self) -> None:
        self.active: set[asyncio.Task] = set()
        self.draining = False
        self._ending: asyncio.Future | None = None

    def ending(self) -> asyncio.Future:
        """Resolved when the grace period is over (created in the running loop)."""
        if self._ending is None:
            self._ending = asyncio.get_running_loop().create_future()
        return self._ending

    def end_all(self) -> None:
        """End every handler still running (step 3)."""
        fut = self.ending()
        if not fut.done():
            fut.set_result(None)


DRAIN: web.AppKey[Drain] = web.AppKey("prefixgate_drain", Drain)
_RESPONSE: web.RequestKey[web.StreamResponse] = web.RequestKey(
    "prefixgate_response", web.StreamResponse
)


_STREAM_ENDING: web.RequestKey[Callable[[APIError], bytes]] = web.RequestKey(
    "prefixgate_stream_ending"
)


def end_streams_with(request: web.Request, ending: Callable[[APIError], bytes]) -> None:
    """Register how a stream of ``request`` ends when the drain cuts it: ``ending(error)``
    gives the SSE bytes of its dialect's error ending (a renderer's ``error_event``, which
    knows the stream's state: Responses' sequence numbers, the text so far)."""
    request[_STREAM_ENDING] = ending


def install(app: web.Application) -> None:
    """Give ``app`` its ``Drain`` and remember started responses (add ``drain_middleware``
    first in the app's middlewares)."""
    app[DRAIN] = Drain()
    app.on_response_prepare.append(_remember)


async def _remember(request: web.Request, response: web.StreamResponse) -> None:
    request[_RESPONSE] = response


def shutdown_ending(request: web.Request) -> int | None:
    """The status of the explicit ending ``drain`` gives ``request`` once the grace period is
    over (200: a started stream, ended with an error event; 503: no answer yet), None while
    it is not being ended that way (a handler cancelled for another reason: its client left).
    A request ended so is logged once, by that ending, never as "client gone"."""
    drain = request.app.get(DRAIN)
    if drain is None or not drain.draining or drain._ending is None or not drain._ending.done():
        return None
    resp = request.get(_RESPONSE)
    return 200 if resp is not None and resp.prepared else 503


def shutting_down() -> APIError:
    """The 503 of a request the server will not serve because it is stopping."""
    return APIError(
        503,
        "the server is shutting down; retry on another replica or later",
        code="server_shutting_down",
        type="service_unavailable",
        retry_after=5.0,
    )


@web.middleware
async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Run ``handler`` as a task ``drain`` can end with an explicit error (see module)."""
    drain = request.app.get(DRAIN)
    if drain is None:
        return await handler(request)
    if drain.draining:
        return _closing(request, shutting_down())
    ending = drain.ending()
    task = asyncio.ensure_future(handler(request))
    drain.active.add(task)
    task.add_done_callback(drain.active.discard)
    try:
        await asyncio.wait({task, ending}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if task.done():
        return task.result()
    # The ending goes out first; the cancelled handler (aborting its engine requests, closing
    # its upstream connection) finishes in the background and ``drain`` waits for it.
    task.cancel()
    return await _end(request)


async def _end(request: web.Request) -> web.StreamResponse:
    """The explicit ending of a request cut by the shutdown."""
    error = shutting_down()
    resp = request.get(_RESPONSE)
    if resp is None or not resp.prepared:
        return _closing(request, error)
    error.message = "the server shut down before this stream finished"
    stream_cut(request, error.code)
    try:
        ending = request.get(_STREAM_ENDING)
        await resp.write(ending(error) if ending is not None else error_event(request, error))
        await resp.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # client gone, or the response already ended
    resp.force_close()
    return resp


def _closing(request: web.Request, error: APIError) -> web.Response:
    resp = error.response(dialect_of(request))
    resp.force_close()
    return resp


async def drain(app: web.Application, runner: web.BaseRunner, grace_s: float) -> dict[str, Any]:
    """Steps 1–3 of the module docstring; returns what happened (``finished``: requests that
    ended within the grace period, ``ended``: requests ended explicitly, ``seconds``)."""
    t0 = time.monotonic()
    d = app[DRAIN]
    d.draining = True
    for site in list(runner.sites):
        await site.stop()  # stop listening
    in_flight = len(d.active)
    deadline = t0 + grace_s
    while d.active and time.monotonic() < deadline:
        await asyncio.wait(set(d.active), timeout=deadline - time.monotonic())
    left = len(d.active)
    if left:
        logger.warning("grace period over: ending %d request(s) with an error", left)
    d.end_all()
    if d.active:  # handlers cleaning up after their ending was sent
        await asyncio.wait(set(d.active), timeout=0.9)
    return {"finished": in_flight - left, "ended": left, "seconds": time.monotonic() - t0}
