"""Hypothesis settings every fuzz over a live server shares: the same examples on every run
(``derandomize``), no example database, no deadline (a server's answer time is not the
property under test) and no health checks (strategies that build large bodies are slow on
purpose)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def live_server_settings(max_examples: int) -> settings:
    """The settings of a derandomized fuzz of ``max_examples`` requests to a live server."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
