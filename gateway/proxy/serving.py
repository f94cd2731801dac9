"""What proxy mode holds beside the shared state: the upstream pool and the prefix registry
of upstream mode (``ProxyServing``, by app key ``PROXY``)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from prefixgate.gateway.proxy.prefixes import ProxyPrefixRegistry
from prefixgate.gateway.proxy.upstream import UpstreamRouter


@dataclass(slots=True)
class ProxyServing:
    """Upstream mode's side of the app (built by ``app.create_proxy_app``)."""

    router: UpstreamRouter
    prefixes: ProxyPrefixRegistry


PROXY: web.AppKey[ProxyServing] = web.AppKey("prefixgate_proxy", ProxyServing)
