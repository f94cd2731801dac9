"""``precise``: each upstream scored on the KV blocks its engine really holds, from its KV
events (the scoring, tokenizing and index live in ``proxy.precise_routing.PreciseRouting``,
attached as ``exact`` by ``app.create_proxy_app``); ``cache_aware`` is its fallback, so its
prefix tree is kept under this policy too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixgate.gateway.proxy.policies.base import Candidate
from prefixgate.gateway.proxy.policies.cache_aware import CacheAware
from prefixgate.gateway.proxy.policies.prompt import Route


class Precise(CacheAware):
    """``cache_aware`` until ``exact`` (a ``PreciseRouting``) is attached; then every pick
    is scored on the exact blocks, falling back to ``cache_aware`` when it cannot be."""

    name = "precise"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exact: Any = None  # proxy.precise_routing.PreciseRouting (it imports the pool)

    def pick(self, route: Route | None, candidates: Sequence[Candidate]) -> Candidate:
        if self.exact is None or route is None:
            return super().pick(route, candidates)
        return self.exact.pick(
            route, candidates, lambda: super(Precise, self).pick(route, candidates)
        )

    def learn(self, up: Candidate, route: Route | None, cached: int, prompt_tokens: int) -> None:
        if self.exact is not None:
            self.exact.learn(up, route, cached, prompt_tokens)
        super().learn(up, route, cached, prompt_tokens)
