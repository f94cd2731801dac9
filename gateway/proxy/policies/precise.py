"""``precise``: each upstream scored on the KV blocks its engine really holds, from its KV
events (the scoring, tokenizing and index live in ``policies.precise_routing.PreciseRouting``,
built as ``exact`` by the policy's ``setup``); ``cache_aware`` is its fallback, so its
prefix tree is kept under this policy too.

Its lifecycle (``base.Policy``'s hooks): ``check_options`` (needs ``tokenizer``), ``setup``
(the tokenizer loaded, the index built on ``upstream_kv_events``), ``collectors`` (its and the
index's counters), ``start`` / ``close`` (the index's consumer thread), ``kv_events`` (each
feed's state), and per request ``prepare`` (tokenize), ``started`` (the prefill charge goes),
``release`` (the load charge goes) and ``prediction``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixgate.gateway.proxy.policies.base import Candidate
from prefixgate.gateway.proxy.policies.cache_aware import CacheAware
from prefixgate.gateway.proxy.policies.prompt import Route

_FEED_FIELDS = ("synced", "hash_scheme", "blocks", "load_reports")


class Precise(CacheAware):
    """``cache_aware`` until ``exact`` (a ``PreciseRouting``) is attached (``setup``, or a
    test); then every pick is scored on the exact blocks, falling back to ``cache_aware`` when
    it cannot be."""

    name = "precise"
    options = ("tokenizer", "upstream_kv_events")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exact: Any = None  # policies.precise_routing.PreciseRouting (loaded lazily)

    # ---- the gateway's lifecycle ---------------------------------------------------------------
    @classmethod
    def check_options(cls, settings: Any, chosen: bool) -> None:
        """Also: ``tokenizer`` needed when chosen; ``precise_max_load_ratio`` >= 1 and
        ``precise_overlap_weight`` > 0 always.

        Raises:
            ValueError: any of these.
        """
        super().check_options(settings, chosen)
        if chosen and not settings.tokenizer:
            raise ValueError(
                "routing precise needs the upstreams' tokenizer (tokenizer: a model folder)"
            )
        if not settings.precise_max_load_ratio >= 1.0:
            raise ValueError(
                f"precise_max_load_ratio must be >= 1, got {settings.precise_max_load_ratio}"
            )
        if not settings.precise_overlap_weight > 0:
            raise ValueError(
                f"precise_overlap_weight must be > 0, got {settings.precise_overlap_weight}"
            )

    def setup(self, settings: Any, urls: Sequence[str]) -> None:
        """``exact`` over the upstreams ``urls`` (lazy: needs ``tokenizers`` and ``jinja2``,
        not torch).

        Raises:
            ValueError: a KV event feed for a URL that is not an upstream, an unreadable
                tokenizer folder.
        """
        from prefixgate.engine.tokenizer import Tokenizer  # noqa: PLC0415
        from prefixgate.gateway.proxy.policies.precise_routing import (  # noqa: PLC0415
            PreciseRouting,
        )
        from prefixgate.gateway.proxy.urls import normalize_url  # noqa: PLC0415

        feeds = {normalize_url(u): f for u, f in settings.upstream_kv_events.items()}
        unknown = sorted(set(feeds) - set(urls))
        if unknown:
            raise ValueError(f"upstream_kv_events names URLs that are not upstreams: {unknown}")
        assert settings.tokenizer is not None  # check_options requires it
        try:
            tokenizer = Tokenizer.from_pretrained(settings.tokenizer)
        except (OSError, ValueError) as exc:
            raise ValueError(f"tokenizer {settings.tokenizer!r}: {exc}") from None
        self.exact = PreciseRouting(
            tokenizer, feeds, settings.precise_max_load_ratio, settings.precise_overlap_weight
        )

    def collectors(self) -> list[Any]:
        return [self.exact.collector()] if self.exact is not None else []

    def start(self) -> None:
        if self.exact is not None:
            self.exact.start()

    def close(self) -> None:
        if self.exact is not None:
            self.exact.close()

    def kv_events(self) -> dict[str, dict[str, Any]]:
        if self.exact is None:
            return {}
        replicas = self.exact.index.stats()["replicas"]
        return {url: {k: rep[k] for k in _FEED_FIELDS} for url, rep in replicas.items()}

    # ---- each request's ------------------------------------------------------------------------
    async def prepare(
        self, route: Route, body: dict[str, Any], path: str, salt: str | None
    ) -> Route:
        if self.exact is None:
            return route
        prepared: Route = await self.exact.prepare(route, body, path, salt)
        return prepared

    def started(self, route: Route | None) -> None:
        if self.exact is not None:
            self.exact.started(route)

    def release(self, route: Route | None) -> None:
        if self.exact is not None:
            self.exact.release(route)

    def prediction(self, route: Route | None) -> tuple[int | None, int | None] | None:
        predicted = getattr(route, "predicted_cached", None)
        if self.exact is None or route is None or not hasattr(route, "predicted_cached"):
            return None
        return predicted, getattr(route, "reported_cached", None)

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
