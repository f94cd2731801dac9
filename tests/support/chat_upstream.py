"""A proxy-mode gateway over a one-route upstream whose ``POST /v1/chat/completions`` a test
writes itself (for answers the stub upstream does not give: odd statuses, bodies, encodings)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import httpx
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings


def chat_app(
    chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
    models: list[str] | None = None,
) -> Callable[[], web.Application]:
    """An upstream's app factory: ``chat`` as its ``POST /v1/chat/completions`` and, given
    ``models``, a ``GET /v1/models`` listing them (``object: model``)."""

    async def model_list(request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model"} for m in models or []]
        return web.json_response({"object": "list", "data": data})

    def upstream() -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        if models is not None:
            app.router.add_get("/v1/models", model_list)
        return app

    return upstream


@contextmanager
def proxy_over_chat(
    chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
    models: list[str] | None = None,
) -> Iterator[httpx.Client]:
    """Serve ``chat_app(chat, models)`` and a proxy gateway (default settings) over it, both on
    loopback; yield an ``httpx.Client`` on the gateway (10 s timeout)."""
    with (
        BackgroundServer(chat_app(chat, models)) as up,
        BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw,
        httpx.Client(base_url=gw.url, timeout=10) as http,
    ):
        yield http
