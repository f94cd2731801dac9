"""SDK test helpers: asyncio backend for anyio tests, a fake sleep, a loopback aiohttp server."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
import pytest
import respx
from aiohttp import web
from prefixgate.sdk import AsyncClient, RetryPolicy


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeSleep:
    """Records requested waits (seconds) instead of sleeping; yields to the loop once."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await anyio.sleep(0)


@pytest.fixture
def fake_sleep() -> FakeSleep:
    return FakeSleep()


BASE = "http://test.local/v1"
MSG = [{"role": "user", "content": "hi"}]  # a one-message chat
OK = {"id": "c1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}}]}


def completion_body(message: dict, finish: str = "stop", **choice: Any) -> dict:
    """A ``chat.completion`` body (id ``chatcmpl-1``, model ``m``) with one choice: ``message``,
    ``finish`` as its finish reason and the ``choice`` fields (``logprobs``)."""
    one = {"index": 0, "message": message, "finish_reason": finish, **choice}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [one],
    }


def mock_chat(json: dict = OK) -> respx.Route:
    """Mock ``POST {BASE}/chat/completions`` (inside ``@respx.mock``) to answer 200 with
    ``json``; returns the route (its ``calls`` are what was sent)."""
    return respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, json=json))


async def sent_chat(client: AsyncClient, **params: Any) -> httpx.Request:
    """The request ``client`` sends for one chat completion (model ``m``, ``MSG``) with
    ``params``, answered by ``mock_chat()`` (call inside ``@respx.mock``)."""
    route = mock_chat()
    await client.chat.completions.create(model="m", messages=MSG, **params)
    return route.calls[0].request


@pytest.fixture
def make_client(fake_sleep: FakeSleep) -> Callable[..., AsyncClient]:
    """Client factory on ``BASE`` with the fake sleep, a fixed clock and a seeded jitter."""

    def make(**kwargs) -> AsyncClient:
        policy = kwargs.pop(
            "retry_policy",
            RetryPolicy(
                max_retries=kwargs.pop("max_retries", 2),
                sleep=fake_sleep,
                clock=lambda: 1_000_000.0,
                rng=random.Random(0),
            ),
        )
        return AsyncClient(kwargs.pop("base_url", BASE), retry_policy=policy, **kwargs)

    return make


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """``await serve(routes)`` starts an aiohttp app on 127.0.0.1:<free port>; returns base_url.

    ``routes`` maps ``(method, path)`` to a handler. Runners are cleaned up at teardown.
    """
    runners: list[web.AppRunner] = []

    async def start(routes: dict[tuple[str, str], Handler]) -> str:
        app = web.Application()
        for (method, path), handler in routes.items():
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for runner in runners:
        await runner.cleanup()
