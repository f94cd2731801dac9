"""Upstreams' load from what they already publish: their Prometheus ``/metrics``.

vLLM sends no load reports on its KV event stream (prefixgate engines do:
``kv_events.EngineLoad``), but every vLLM, and every prefixgate engine, exposes its load under
vLLM's names: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges, summed
over label sets: one server may list several engines) and ``vllm:kv_cache_usage_perc``
(0 to 1, the largest over label sets). ``MetricsLoadScraper`` reads them from each openai
upstream every ``interval_s`` seconds (one request per upstream at a time, ``interval_s``
its timeout; the parsing by ``prometheus_client``'s text parser) and keeps the latest on the
upstream (``Upstream.engine_load``: ``(requests running + waiting, time.monotonic() of the
reading, interval_s)``; ``published_requests`` reads it back while fresh).

The routing policies' load (``policies.base.load``) is then the larger of this gateway's
requests in flight there and the upstream's published requests, while the reading is fresh
(``FRESH_INTERVALS`` intervals); an upstream that answers no such metrics keeps this
gateway's own count. Precise routing prefers an engine's load reports when it has them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "FRESH_INTERVALS",
    "MetricsLoadScraper",
    "PoolLoad",
    "parse_pool_metrics",
    "published_requests",
]

logger = logging.getLogger("prefixgate.gateway")

FRESH_INTERVALS = 3.0  # a reading older than this many intervals is not used
MIN_INTERVAL_S = 0.25


def published_requests(up: Any) -> int | None:
    """``up``'s requests running + waiting as its ``/metrics`` last said, ``None`` when not
    read or older than ``FRESH_INTERVALS`` intervals."""
    got = getattr(up, "engine_load", None)
    if got is None:
        return None
    n, at, interval = got
    return n if time.monotonic() - at <= FRESH_INTERVALS * interval else None


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """One upstream's published load: requests running and waiting, KV usage (0-1, ``None``
    when not published)."""

    running: int
    waiting: int
    kv_usage: float | None


def parse_pool_metrics(text: str) -> PoolLoad | None:
    """vLLM's pool metrics from a Prometheus text exposition; ``None`` when it has neither
    request gauge (not a vLLM-compatible server) or does not parse."""
    running = waiting = 0.0
    usage: float | None = None
    seen = False
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "vllm:num_requests_running":
                    running += s.value
                    seen = True
                elif s.name == "vllm:num_requests_waiting":
                    waiting += s.value
                    seen = True
                elif s.name == "vllm:kv_cache_usage_perc":
                    usage = s.value if usage is None else max(usage, s.value)
    except (ValueError, TypeError):
        return None
    if not seen:
        return None
    return PoolLoad(int(running), int(waiting), usage)


class MetricsLoadScraper:
    """Reads each openai upstream's ``/metrics`` every ``interval_s`` (module docstring).

    Args:
        router: the ``UpstreamRouter`` (its session and upstreams).
        interval_s: seconds between readings of one upstream (>= ``MIN_INTERVAL_S``).

    Raises:
        ValueError: ``interval_s`` below ``MIN_INTERVAL_S``.
    """

    def __init__(self, router: Any, interval_s: float) -> None:
        if not interval_s >= MIN_INTERVAL_S:
            raise ValueError(f"interval_s must be >= {MIN_INTERVAL_S}, got {interval_s}")
        self.router = router
        self.interval_s = float(interval_s)
        self.scrapes = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop (in the server's event loop, after the router's session opened)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            ups = [u for u in self.router.upstreams if u.dialect == "openai" and u.healthy]
            await asyncio.gather(*(self.scrape(u) for u in ups), return_exceptions=True)
            await asyncio.sleep(self.interval_s)

    async def scrape(self, up: Any) -> PoolLoad | None:
        """Read ``up``'s ``/metrics`` once; on success note ``up.engine_load``."""
        session = self.router.session
        if session is None:
            return None
        auth = up.auth or getattr(self.router, "_auth", None)
        try:
            async with session.get(
                up.url + "/metrics",
                headers={"Authorization": auth} if auth else None,
                timeout=aiohttp.ClientTimeout(total=self.interval_s),
                ssl=up.ssl,
            ) as resp:
                if resp.status != 200:
                    self.failures += 1
                    return None
                text = (await resp.read()).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError, OSError):
            self.failures += 1
            return None
        load = parse_pool_metrics(text)
        if load is None:
            self.failures += 1
            return None
        self.scrapes += 1
        up.engine_load = (load.running + load.waiting, time.monotonic(), self.interval_s)
        return load
