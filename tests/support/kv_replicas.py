"""aidreams-260k replicas that publish KV events, for the precise-routing integration tests:
the servers (``yield from serve_kv_replicas(...)`` in a module fixture), their event feeds,
and random text from a small vocabulary of words."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prefixgate.gateway.app import create_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.settings import GatewaySettings

WORDS = "the cat sat on a warm mat while rain fell over quiet hills and old towns".split()


def random_text(rng: random.Random, n: int) -> str:
    """``n`` words drawn from ``WORDS`` with ``rng``, joined by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def serve_kv_replicas(
    model_path: str,
    model_name: str,
    block_size: int,
    num_kv_blocks: int,
    extras: Sequence[Mapping[str, Any]],
) -> Iterator[list[BackgroundServer]]:
    """Yield one ``BackgroundServer`` (127.0.0.1, free port) per entry of ``extras``: an
    ``AsyncEngine`` of ``model_path`` (``block_size`` tokens a block, ``num_kv_blocks`` blocks,
    KV events on a free loopback TCP port, plus the entry's ``EngineConfig`` fields) served as
    ``model_name``; shut the engines down and close the servers after."""
    from prefixgate.engine.async_engine import AsyncEngine
    from prefixgate.engine.config import EngineConfig

    servers = []
    for extra in extras:

        def make(extra: Mapping[str, Any] = extra):
            engine = AsyncEngine(
                EngineConfig(
                    model=model_path,
                    block_size=block_size,
                    num_kv_blocks=num_kv_blocks,
                    kv_events="tcp://127.0.0.1:*",
                    **extra,
                )
            )
            return create_app(engine, GatewaySettings(model_name=model_name))

        servers.append(BackgroundServer(make).__enter__())
    yield servers
    for srv in servers:
        srv.call(srv.app[LOCAL].engine.shutdown)
        srv.close()


def kv_feeds(servers: Sequence[BackgroundServer]) -> dict[str, tuple[str, str | None]]:
    """Each server's URL -> its engine's KV event endpoints ``(events, replay or None)``."""
    out = {}
    for srv in servers:
        pub = srv.app[LOCAL].engine.engine.kv_events
        out[srv.url] = (pub.endpoint, pub.replay_endpoint)
    return out
