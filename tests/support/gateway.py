"""A real gateway on aidreams-260k for integration tests: the module-scoped ``server`` fixture's
body, the official ``openai`` client on it, and the wait for the engine to go idle."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from prefixgate.engine import AsyncEngine, EngineConfig
from prefixgate.gateway.app import create_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.settings import GatewaySettings


def serve_aidreams(
    model_path: str,
    num_kv_blocks: int = 256,
    engine_args: dict[str, Any] | None = None,
    **settings: Any,
) -> Iterator[BackgroundServer]:
    """Yield a ``BackgroundServer`` (127.0.0.1, free port) over an ``AsyncEngine`` of
    ``model_path`` with ``num_kv_blocks`` KV blocks (256; few blocks make it preempt), more
    ``EngineConfig`` fields in ``engine_args`` (e.g. speculative decoding) and
    ``GatewaySettings(poll_s=0.02, **settings)``; shut the engine down and close the server
    after, once the engine is idle and its KV block pool whole (``assert_pool_whole``, blocks
    held by prefix pins allowed): whatever the module's scenarios did, none leaked a request or
    a block. Use as ``yield from serve_aidreams(...)``."""

    def make():
        engine = AsyncEngine(
            EngineConfig(model=model_path, num_kv_blocks=num_kv_blocks, **(engine_args or {}))
        )
        return create_app(engine, GatewaySettings(poll_s=0.02, **settings))

    from conftest import assert_pool_whole

    srv = BackgroundServer(make).__enter__()
    try:
        yield srv
        wait_idle(srv, assert_pool_whole, pinned_ok=True)
    finally:
        srv.call(srv.app[LOCAL].engine.shutdown)
        srv.close()


def openai_client(server: BackgroundServer) -> openai.OpenAI:
    """The official client on ``server``'s ``/v1`` (no retries: a failure shows)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def module_server(model_name: str, name: str = "server", **settings: Any) -> Any:
    """A module-scoped fixture named ``name`` for a test module (``server =
    module_server(MODEL, ...)``): aidreams-260k served as ``model_name`` with ``settings``
    (``serve_aidreams``)."""

    @pytest.fixture(scope="module", name=name)
    def server(aidreams_path: str) -> Iterator[BackgroundServer]:
        yield from serve_aidreams(aidreams_path, model_name=model_name, **settings)

    return server


def big_and_small_servers(model_name: str) -> Any:
    """A module-scoped fixture ``servers`` for a property test (``servers =
    big_and_small_servers(MODEL)``): ``{"big": ..., "small": ...}``, aidreams-260k served as
    ``model_name`` with the ``hermes`` tool-call parser on 256 KV blocks and on 8 (exactly one
    full-context request: ``n`` over 1 preempts)."""

    @pytest.fixture(scope="module", name="servers")
    def servers(aidreams_path: str) -> Iterator[dict[str, BackgroundServer]]:
        big = serve_aidreams(aidreams_path, model_name=model_name, tool_call_parser="hermes")
        small = serve_aidreams(
            aidreams_path, num_kv_blocks=8, model_name=model_name, tool_call_parser="hermes"
        )
        yield {"big": next(big), "small": next(small)}
        for gen in (big, small):
            next(gen, None)

    return servers


def hermes_fixtures(model_name: str) -> tuple[Any, Any]:
    """A test module's module-scoped ``server`` and ``client`` fixtures, as
    ``server, client = hermes_fixtures(MODEL)``: aidreams-260k served as ``model_name`` with
    the ``hermes`` tool-call parser and 64 queued requests, and the openai client on it."""

    @pytest.fixture(scope="module", name="client")
    def client(server: BackgroundServer) -> openai.OpenAI:
        return openai_client(server)

    server = module_server(model_name, tool_call_parser="hermes", max_queued_requests=64)
    return server, client


def wait_idle(
    server: BackgroundServer,
    pool_whole: Callable[..., None],
    timeout: float = 20.0,
    *,
    pinned_ok: bool = False,
) -> None:
    """Wait up to ``timeout`` seconds for no running or waiting request, then check the block
    pool is whole (``pinned_ok``: blocks pinned by prefixes are fine)."""
    engine = server.app[LOCAL].engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        time.sleep(0.02)
    if pinned_ok:
        pool_whole(engine, pinned_ok=True)
    else:
        pool_whole(engine)
