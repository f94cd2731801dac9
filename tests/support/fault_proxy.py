"""Proxy-mode gateways over ``FaultUpstream`` (a scripted, misbehaving upstream): the body of
the ``proxy`` fixtures of the proxy fault tests."""

from __future__ import annotations

from typing import Any, Self

from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

from examples.benchmarks.fault_upstream import FaultUpstream


class FaultProxies:
    """Opens (upstream, gateway) pairs; a ``with`` block closes all of them, newest first."""

    def __init__(self) -> None:
        self.opened: list[FaultUpstream | BackgroundServer] = []

    def start(
        self, mode: str, chunks: int, delay_s: float, settings: dict[str, Any]
    ) -> tuple[BackgroundServer, FaultUpstream]:
        """A ``FaultUpstream(mode, chunks, delay_s)`` and a proxy gateway on it built with
        ``GatewaySettings(**settings)``."""
        up = FaultUpstream(mode, chunks, delay_s).__enter__()
        self.opened.append(up)
        s = GatewaySettings(**settings)
        gw = BackgroundServer(lambda: create_proxy_app([up.url], s), access_log=True).__enter__()
        self.opened.append(gw)
        return gw, up

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for item in reversed(self.opened):
            item.close()
