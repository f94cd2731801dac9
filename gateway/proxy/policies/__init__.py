"""Routing policies of upstream mode (``--routing NAME``): one class per policy behind one
protocol (``RoutingPolicy``: route, pick, learn and the hooks of its lifecycle, ``base``),
registered here by name.

Adding a policy: a new module with a ``Policy`` subclass naming itself (``name = "..."``),
one line in ``REGISTRY`` and its name in ``settings.ROUTING_POLICIES`` (what ``GatewaySettings``
checks ``routing`` against; tests/test_architecture.py holds the two equal).
"""

from __future__ import annotations

from typing import Any

from prefixgate.gateway.proxy.policies.base import Candidate, Policy, RoutingPolicy
from prefixgate.gateway.proxy.policies.cache_aware import CACHE_THRESHOLD, CacheAware, PrefixTree
from prefixgate.gateway.proxy.policies.least_loaded import LeastLoaded
from prefixgate.gateway.proxy.policies.precise import Precise
from prefixgate.gateway.proxy.policies.prompt import (
    Route,
    affinity_key,
    prompt_blocks,
    prompt_text,
    salted_affinity_key,
)
from prefixgate.gateway.proxy.policies.rendezvous import Rendezvous
from prefixgate.gateway.proxy.policies.round_robin import RoundRobin

REGISTRY: dict[str, type[Policy]] = {
    p.name: p for p in (CacheAware, Rendezvous, RoundRobin, LeastLoaded, Precise)
}
POLICIES = tuple(REGISTRY)  # the names --routing takes; the first is the default


def check_policy(name: str) -> str:
    """``name`` if it is a registered policy (``--routing``).

    Raises:
        ValueError: any other name (the message lists the policies).
    """
    if name not in REGISTRY:
        raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {name!r}")
    return name


def check_settings(settings: Any) -> None:
    """Validate a ``GatewaySettings``' routing: a registered ``routing``, and each policy's
    options (``Policy.check_options``: the chosen one's needs, another's options unset).

    Raises:
        ValueError: an unknown policy, or options a policy refuses.
    """
    chosen = REGISTRY[check_policy(settings.routing)]
    for cls in REGISTRY.values():
        cls.check_options(settings, cls is chosen)


def make_policy(name: str, **options: Any) -> Policy:
    """A new policy object of the registered ``name`` (``options``: ``Policy``'s arguments).

    Raises:
        ValueError: an unknown name.
    """
    return REGISTRY[check_policy(name)](**options)


__all__ = [
    "CACHE_THRESHOLD",
    "POLICIES",
    "REGISTRY",
    "Candidate",
    "PrefixTree",
    "Policy",
    "Route",
    "RoutingPolicy",
    "affinity_key",
    "check_policy",
    "check_settings",
    "make_policy",
    "prompt_blocks",
    "prompt_text",
    "salted_affinity_key",
]
