"""The protocol every routing policy follows (``RoutingPolicy``: route, pick, learn, and
the hooks of its lifecycle) and the base class the built-in policies share (``Policy``: the
imbalance rule, the least loaded candidate, hooks that do nothing).

A policy owns its lifecycle; the gateway calls the same hooks of whichever policy it runs:
``check_options(settings, chosen)`` (``GatewaySettings`` validation), ``setup(settings,
urls)``, ``collectors()``, ``start()`` / ``close()`` (the app's startup and cleanup),
``kv_events()`` (``/ready``), and per request ``prepare`` (in the handler, before admission),
``started`` (the upstream's answer began), ``release`` (the request left its upstream) and
``prediction`` (the access line's ``predicted=``).

A policy sees upstreams only as ``Candidate`` (URL, rendezvous seed, requests in flight,
weight), so it imports nothing of the pool that holds them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from prefixgate.gateway.proxy.metrics_load import published_requests
from prefixgate.gateway.proxy.policies.prompt import Route, affinity_key, salted_affinity_key


class Candidate(Protocol):
    """What a policy reads of an upstream (``proxy.upstream.Upstream`` is one)."""

    @property
    def url(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def weight(self) -> float: ...
    @property
    def cache_misses(self) -> int: ...
    @cache_misses.setter
    def cache_misses(self, value: int) -> None: ...


class RoutingPolicy(Protocol):
    """One way to choose an upstream (``--routing NAME``; registered in ``policies``).

    ``route(body, salt, model)`` says what the policy needs of a request (``Route``);
    ``pick(route, candidates)`` chooses among the healthy upstreams that serve its model
    (at least one; ``route`` None for a request without a prompt); ``learn(up, route,
    cached, prompt_tokens)`` hears what the chosen upstream reported cached (tokens).
    """

    name: ClassVar[str]

    def route(self, body: Any, salt: str | None, model: str | None = None) -> Route: ...

    def pick(self, route: Route | None, candidates: Sequence[Candidate]) -> Candidate: ...

    def learn(
        self, up: Candidate, route: Route | None, cached: int, prompt_tokens: int
    ) -> None: ...

    def setup(self, settings: Any, urls: Sequence[str]) -> None: ...

    def collectors(self) -> list[Any]: ...

    def start(self) -> None: ...

    def close(self) -> None: ...

    def kv_events(self) -> dict[str, dict[str, Any]]: ...

    async def prepare(
        self, route: Route, body: dict[str, Any], path: str, salt: str | None
    ) -> Route: ...

    def started(self, route: Route | None) -> None: ...

    def release(self, route: Route | None) -> None: ...

    def prediction(self, route: Route | None) -> tuple[int | None, int | None] | None: ...


@dataclass(eq=False)
class Policy:
    """Shared parts of the built-in policies.

    Args:
        abs_threshold, rel_threshold: the imbalance rule over in-flight requests: imbalanced
            when ``max - min > abs_threshold`` and ``max > rel_threshold * min`` (SGLang's
            defaults 64 and 1.5).
        block_chars, max_chars: the affinity key's blocks (characters) and its longest text.
    """

    name: ClassVar[str] = ""
    # the gateway settings only this policy reads (refused under another one)
    options: ClassVar[tuple[str, ...]] = ()

    abs_threshold: int = 64
    rel_threshold: float = 1.5
    block_chars: int = 64
    max_chars: int = 4096
    _turn: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False)

    def route(self, body: Any, salt: str | None, model: str | None = None) -> Route:
        """The request's salted affinity key (no prompt blocks: only ``cache_aware`` reads
        them)."""
        key = affinity_key(body, self.block_chars, self.max_chars)
        return Route(salted_affinity_key(key, salt), [], model)

    def pick(self, route: Route | None, candidates: Sequence[Candidate]) -> Candidate:
        raise NotImplementedError

    def learn(self, up: Candidate, route: Route | None, cached: int, prompt_tokens: int) -> None:
        """Nothing to learn (only ``cache_aware`` keeps state of what was cached where)."""

    # ---- lifecycle: the gateway's --------------------------------------------------------------
    @classmethod
    def check_options(cls, settings: Any, chosen: bool) -> None:
        """Validate ``settings`` (a ``GatewaySettings``) for this policy, the one ``chosen``
        by ``routing`` or not.

        Raises:
            ValueError: one of this policy's ``options`` set while another policy routes.
        """
        if chosen:
            return
        for name in cls.options:
            if getattr(settings, name):
                raise ValueError(f"{name} is used by routing {cls.name} only")

    def setup(self, settings: Any, urls: Sequence[str]) -> None:
        """Build what the policy needs of ``settings`` (a ``GatewaySettings``) over the
        upstreams' ``urls`` (nothing here)."""

    def collectors(self) -> list[Any]:
        """The policy's prometheus collectors, registered by the app (none here)."""
        return []

    def start(self) -> None:
        """The app started (nothing to start here)."""

    def close(self) -> None:
        """The app stops (nothing to close here)."""

    def kv_events(self) -> dict[str, dict[str, Any]]:
        """Upstream URL -> the state of its engine's KV event feed (``/ready``): none here."""
        return {}

    # ---- lifecycle: each request's ---------------------------------------------------------------
    async def prepare(
        self, route: Route, body: dict[str, Any], path: str, salt: str | None
    ) -> Route:
        """The request's ``route`` with what the policy learns of its parsed ``body``
        (``path``: the route, ``salt``: its effective cache salt), in the handler before
        admission; ``route`` itself here."""
        return route

    def started(self, route: Route | None) -> None:
        """The chosen upstream's answer began (nothing here)."""

    def release(self, route: Route | None) -> None:
        """The request left its upstream: answered, failed, or moved on (nothing here)."""

    def prediction(self, route: Route | None) -> tuple[int | None, int | None] | None:
        """``(predicted, reported)`` cached prompt tokens of the request on its upstream
        (the access line's ``predicted=`` / ``cached=``); None: the policy predicts none."""
        return None

    def turn(self) -> int:
        """The next value of a counter (round-robin turns, tie rotation)."""
        return next(self._turn)

    def least(self, candidates: Sequence[Candidate]) -> Candidate:
        """The least loaded candidate (in flight per unit of weight); ties rotate."""
        start = self.turn() % len(candidates)
        return min([*candidates[start:], *candidates[:start]], key=load)

    def imbalanced(self, candidates: Sequence[Candidate], least: Candidate) -> bool:
        """The imbalance rule (see the class docstring) over in-flight requests."""
        lo = least.in_flight
        hi = max(u.in_flight for u in candidates)
        return hi - lo > self.abs_threshold and hi > self.rel_threshold * lo


def load(u: Candidate) -> float:
    """In-flight requests per unit of weight (weight 1: the in-flight count itself): this
    gateway's requests in flight on ``u``, or the requests its engine publishes running and
    waiting (``metrics_load.published_requests``, every client's) when that is more."""
    n = u.in_flight
    published = published_requests(u)
    if published is not None and published > n:
        n = published
    return n / u.weight if u.weight != 1 else n
