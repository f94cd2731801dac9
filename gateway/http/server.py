"""Running the app: ``start_server`` in the current loop, ``BackgroundServer`` in a thread.

Both bind to the given host (127.0.0.1 by default) and port (0 = a free port chosen by the
OS) and run with ``handler_cancellation=True``, so a client that disconnects cancels its
request handler (and with it the engine request or the upstream call). Connections are
bounded and timed as ``protocol`` describes (header timeout, header sizes, open connections
under the open-file limit, protocol errors as OpenAI error objects), from the app's
``GatewaySettings``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prefixgate.gateway.http import lifecycle
from prefixgate.gateway.http.access_log import AccessLogger
from prefixgate.gateway.http.connections import GatewayRunner, fd_budget
from prefixgate.gateway.settings import SETTINGS


@dataclass(slots=True)
class RunningServer:
    """A started server: its runner and its base URL (``http://host:port``)."""

    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, finish or cancel handlers, run the app's cleanup."""
        await self.runner.cleanup()

    async def drain(self, grace_s: float) -> dict[str, Any]:
        """Graceful shutdown (``lifecycle.drain``): stop accepting, give in-flight requests
        ``grace_s`` seconds, end the rest explicitly, then ``stop()``. Returns ``drain``'s
        summary."""
        summary = await lifecycle.drain(self.runner.app, self.runner, grace_s)
        await self.stop()
        return summary


async def start_server(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    shutdown_timeout_s: float = 5.0,
    access_log: bool = False,
) -> RunningServer:
    """Start serving ``app`` on ``host:port`` in the running loop; ``access_log`` writes one
    line per request to the ``prefixgate.access`` logger (:mod:`prefixgate.gateway.http.access_log`).

    Raises:
        OSError: when the address cannot be bound.
    """
    runner = GatewayRunner(
        app,
        handler_cancellation=True,
        access_log=logging.getLogger("prefixgate.access") if access_log else None,
        access_log_class=AccessLogger,
        shutdown_timeout=shutdown_timeout_s,
        **connection_options(app),
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return RunningServer(runner, host, bound)


# Open files one client connection costs: 1, or 2 in upstream mode (its upstream connection).
FDS_PER_CONNECTION: web.AppKey[int] = web.AppKey("prefixgate_fds_per_connection", int)


def connection_options(app: web.Application) -> dict[str, Any]:
    """aiohttp server options from the app's settings: header timeout (``keepalive_timeout``),
    lingering after an unread body, the connection bound (at most what the open-file limit
    allows: two descriptors per connection in upstream mode)."""
    s = app.get(SETTINGS)
    if s is None:
        return {"max_connections": fd_budget()}
    per_connection = app.get(FDS_PER_CONNECTION, 1)
    return {
        "keepalive_timeout": s.header_timeout_s,
        "lingering_time": 2.0,
        "max_connections": min(s.max_connections, fd_budget(per_connection)),
    }


class BackgroundServer:
    """Serves an app from a daemon thread with its own event loop (tests, benchmarks).

    ``make_app`` runs inside that loop (so engines and sessions bind to it). Use as a context
    manager; ``url`` is the base URL; ``call(coro_fn)`` runs a coroutine function in the
    server's loop and returns its result; ``access_log`` as ``start_server``'s.
    """

    def __init__(
        self,
        make_app: Callable[[], web.Application | Awaitable[web.Application]],
        host: str = "127.0.0.1",
        port: int = 0,
        access_log: bool = False,
    ) -> None:
        self._make_app = make_app
        self._host = host
        self._port = port
        self._access_log = access_log
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="prefixgate-server"
        )
        self.server: RunningServer | None = None
        self.app: web.Application | None = None

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        try:
            self.call(self._start, timeout=120)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _start(self) -> None:
        made = self._make_app()
        app = made if isinstance(made, web.Application) else await made
        self.app = app
        self.server = await start_server(app, self._host, self._port, access_log=self._access_log)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def call(self, fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 60) -> Any:
        """Run ``fn()`` (a coroutine function) in the server's loop; return its result."""
        fut: Future = asyncio.run_coroutine_threadsafe(fn(), self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        """Stop the server and the thread (idempotent)."""
        if not self._thread.is_alive():
            return
        if self.server is not None:
            self.call(self.server.stop, timeout=30)
            self.server = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
