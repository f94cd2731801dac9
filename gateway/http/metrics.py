"""Prometheus metrics of the gateway (``GET /metrics``), via prometheus-client.

Latencies are measured at the gateway, in seconds, from the moment the request was admitted:
TTFT (time to first token), TPOT (time per output token after the first, per choice:
``(t_last - t_first) / (tokens - 1)``) and E2E latency. Engine state (running and waiting
requests, KV blocks, prefix-cache hit rate) is read from ``engine.stats()`` at scrape time.
Names follow vLLM's ``vllm:`` metrics where one exists, under a ``prefixgate_`` prefix.
Each app gets its own ``CollectorRegistry``, so several gateways can live in one process.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prefixgate.engine.malloc import heap_in_use
from prefixgate.gateway.http.request_account import RequestAccount
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# histogram bucket bounds, in seconds; both histograms start with the same fine buckets
_FINE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05)
_LATENCY_BUCKETS = (*_FINE_BUCKETS, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (*_FINE_BUCKETS, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _PoolMetrics(Collector):
    """vLLM's metric names, semantics and units for the engine's load and KV cache, read from
    ``engine.stats()`` on every scrape, so a prefixgate engine can join a pool whose endpoint
    picker scores model servers by vLLM's names (Kubernetes Gateway API Inference Extension:
    llm-d's router, Dynamo's): ``vllm:num_requests_running`` (requests in the running
    batch), ``vllm:num_requests_waiting`` (requests waiting, preempted ones included),
    ``vllm:kv_cache_usage_perc`` (KV blocks in use / blocks in the pool, 0 to 1: vLLM's
    ``BlockPool.get_usage``, where cached free blocks count as free) and
    ``vllm:cache_config_info`` (value 1; labels ``block_size``, ``num_gpu_blocks``,
    ``enable_prefix_caching``, as vLLM's ``CacheConfig`` info metric; ``num_gpu_blocks`` is
    the pool's blocks on any device). Labels ``model_name`` (the served name) and ``engine``
    (``"0"``), as vLLM's."""

    def __init__(
        self, stats: Callable[[], dict[str, Any] | None], model_name: str, block_size: int
    ) -> None:
        self._stats = stats
        self._labels = {"model_name": model_name, "engine": "0"}
        self._block_size = block_size

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(name, doc, labels=list(self._labels))
        fam.add_metric(list(self._labels.values()), value)
        return fam

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            stats = self._stats()
        except Exception:  # noqa: BLE001 - a scrape never fails because of the engine
            stats = None
        if not stats:
            return
        running, waiting = stats.get("num_running"), stats.get("num_waiting")
        if isinstance(running, int):
            yield self._gauge(
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                running,
            )
        if isinstance(waiting, int):
            yield self._gauge(
                "vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting
            )
        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        if isinstance(used, int) and isinstance(total, int) and total > 0:
            yield self._gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                used / total,
            )
            info = {
                **self._labels,
                "block_size": str(self._block_size),
                "num_gpu_blocks": str(total),
                "enable_prefix_caching": "True",
            }
            fam = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=list(info),
            )
            fam.add_metric(list(info.values()), 1.0)
            yield fam


class _ProcessHeap(Collector):
    """``prefixgate_process_heap_bytes``: glibc malloc's bytes in use in this process
    (``mallinfo2``: ``uordblks + hblkhd``; ``engine.malloc.heap_in_use``), read on every
    scrape. Beside RSS it tells memory allocated through malloc (torch's CPU tensors,
    oneDNN's primitives) from CPython's own object arenas and from freed memory the
    allocator keeps. Absent where the libc has no ``mallinfo2`` (never reported as 0)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        heap = heap_in_use()
        if heap is not None:
            yield GaugeMetricFamily(
                "prefixgate_process_heap_bytes",
                "bytes glibc malloc has handed out and not had back in this process (mallinfo2)",
                value=heap,
            )


class _EngineStats(Collector):
    """Gauges read from ``engine.stats()`` on every scrape."""

    _GAUGES = {
        "num_running": ("prefixgate_engine_running_requests", "requests running in the engine"),
        "num_waiting": ("prefixgate_engine_waiting_requests", "requests waiting in the engine"),
        "kv_blocks_used": ("prefixgate_kv_blocks_used", "KV blocks in use (ref count > 0)"),
        "kv_blocks_total": ("prefixgate_kv_blocks_total", "KV blocks in the pool"),
        "kv_blocks_free": ("prefixgate_kv_blocks_free", "KV blocks free (cached or empty)"),
        "kv_blocks_cached_free": (
            "prefixgate_kv_blocks_cached_free",
            "free KV blocks still holding a cached prefix",
        ),
        "pinned_blocks": ("prefixgate_kv_blocks_pinned", "KV blocks held by prefix pins"),
        "prefix_cache_hit_rate": (
            "prefixgate_prefix_cache_hit_rate",
            "prefix-cache hits / queries, in tokens",
        ),
        "prefix_cache_queries": (
            "prefixgate_prefix_cache_queries_tokens",
            "prompt tokens looked up in the prefix cache",
        ),
        "prefix_cache_hits": (
            "prefixgate_prefix_cache_hits_tokens",
            "prompt tokens served from the prefix cache",
        ),
        "num_preemptions": ("prefixgate_engine_preemptions", "requests preempted so far"),
        "num_displacements": (
            "prefixgate_engine_displacements",
            "running requests preempted for a waiting one (priority / fair) so far",
        ),
        "queued_prefill_tokens": (
            "prefixgate_engine_queued_prefill_tokens",
            "prompt tokens still to prefill (waiting and running requests)",
        ),
        "prefill_tokens_per_s": (
            "prefixgate_engine_prefill_tokens_per_second",
            "measured prefill rate (exponentially weighted over steps; absent until measured)",
        ),
        "decode_tokens_per_s": (
            "prefixgate_engine_decode_tokens_per_second",
            "measured decode rate (exponentially weighted over steps; absent until measured)",
        ),
    }

    # counters (exposed with the ``_total`` suffix), present with speculative decoding on:
    # vLLM's ``vllm:spec_decode_*`` names
    _COUNTERS = {
        "spec_decode_num_drafts": (
            "prefixgate_spec_decode_num_drafts",
            "verify steps of speculative decoding (one per request per step with drafts)",
        ),
        "spec_decode_num_draft_tokens": (
            "prefixgate_spec_decode_num_draft_tokens",
            "draft tokens proposed by speculative decoding",
        ),
        "spec_decode_num_accepted_tokens": (
            "prefixgate_spec_decode_num_accepted_tokens",
            "draft tokens accepted by the verification",
        ),
        "anticipation_waits": (
            "prefixgate_engine_anticipation_waits",
            "waits before a step for an idle tenant's next request (fair policy)",
        ),
        "anticipation_hits": (
            "prefixgate_engine_anticipation_hits",
            "anticipation waits that the tenant's next request ended",
        ),
        "anticipation_wait_s": (
            "prefixgate_engine_anticipation_wait_seconds",
            "seconds the engine loop spent in anticipation waits",
        ),
    }

    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            stats = self._stats()
        except Exception:  # noqa: BLE001 - a scrape never fails because of the engine
            stats = None
        if not stats:
            return
        for key, (name, doc) in self._GAUGES.items():
            value = stats.get(key)
            if isinstance(value, int | float):
                yield GaugeMetricFamily(name, doc, value=float(value))
        for key, (name, doc) in self._COUNTERS.items():
            value = stats.get(key)
            if isinstance(value, int | float):
                yield CounterMetricFamily(name, doc, value=float(value))
        tenants = stats.get("tenants")
        if isinstance(tenants, dict) and tenants:
            yield from self._tenant_families(tenants)

    _TENANT_GAUGES = {
        "served_input_tokens": (
            "prefixgate_tenant_served_input_tokens",
            "prompt tokens the engine admitted per tenant (API key name)",
        ),
        "served_output_tokens": (
            "prefixgate_tenant_served_output_tokens",
            "output tokens the engine generated per tenant",
        ),
        "num_waiting": (
            "prefixgate_tenant_engine_waiting_requests",
            "requests waiting in the engine per tenant",
        ),
        "num_running": (
            "prefixgate_tenant_engine_running_requests",
            "requests running in the engine per tenant",
        ),
        "virtual_counter": (
            "prefixgate_tenant_virtual_counter",
            "fair-share (VTC) counter per tenant: weighted tokens served / tenant weight",
        ),
    }

    def _tenant_families(self, tenants: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
        for key, (name, doc) in self._TENANT_GAUGES.items():
            fam = GaugeMetricFamily(name, doc, labels=["tenant"])
            for tenant, row in sorted(tenants.items()):
                value = row.get(key) if isinstance(row, dict) else None
                if isinstance(value, int | float):
                    fam.add_metric([str(tenant)], float(value))
            yield fam


class _TenantQueue(Collector):
    """Requests each tenant has in the gateway's admission queue (read on every scrape)."""

    def __init__(self, admission: Any) -> None:
        self._admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        fam = GaugeMetricFamily(
            "prefixgate_tenant_queue_requests",
            "requests per tenant (API key name) in the admission queue",
            labels=["tenant"],
        )
        for tenant, n in sorted(
            self._admission.queued_by_tenant.items(), key=lambda kv: str(kv[0])
        ):
            fam.add_metric(["" if tenant is None else tenant], float(n))
        yield fam


class GatewayMetrics:
    """The gateway's metrics on a private registry; ``render()`` gives the exposition text."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        latency = functools.partial(Histogram, registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.ttft = latency(
            "prefixgate_time_to_first_token_seconds",
            "TTFT at the gateway (proxy mode: streamed answers only)",
        )
        self.tpot = Histogram(
            "prefixgate_time_per_output_token_seconds",
            "TPOT per choice (after the first token; proxy mode: streamed answers of one choice)",
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = latency(
            "prefixgate_e2e_request_latency_seconds", "end-to-end request latency at the gateway"
        )
        self.requests = counter(
            "prefixgate_requests",
            "answered requests by route, HTTP status and OpenAI error code ('' on success)",
            ["route", "status", "code"],
        )
        self.prompt_tokens = counter(
            "prefixgate_prompt_tokens",
            "prompt tokens admitted (proxy mode: as the upstreams reported them)",
        )
        self.generation_tokens = counter(
            "prefixgate_generation_tokens",
            "tokens generated (proxy mode: as the upstreams reported)",
        )
        self.cached_tokens = counter(
            "prefixgate_cached_prompt_tokens",
            "prompt tokens served from the prefix cache (proxy mode: as the upstreams reported)",
        )
        self.queue_depth = gauge(
            "prefixgate_queue_depth", "requests admitted and waiting for their first token"
        )
        self.queued_tokens = gauge(
            "prefixgate_queue_prompt_tokens", "prompt tokens of the queued requests"
        )
        self.running = gauge("prefixgate_running_requests", "requests admitted and generating")
        self.tokens_per_s = gauge(
            "prefixgate_generation_tokens_per_second",
            f"tokens generated per second over the last {window_s:g} s",
        )
        self.upstream_requests = counter(
            "prefixgate_upstream_requests",
            "requests forwarded per upstream and status",
            ["upstream", "status"],
        )
        self.upstream_healthy = gauge(
            "prefixgate_upstream_healthy",
            "1 when the upstream is in rotation (neither ejected nor down)",
            ["upstream"],
        )
        self.upstream_ejections = gauge(
            "prefixgate_upstream_ejections",
            "the upstream's ejection multiplier: ejections by consecutive failures, less one "
            "per calm ejection time",
            ["upstream"],
        )
        self.upstream_in_flight = gauge(
            "prefixgate_upstream_in_flight", "requests in flight per upstream", ["upstream"]
        )
        self.key_requests = counter(
            "prefixgate_key_requests",
            "API requests (POST /v1/... and /v1beta/...) finished per API key name (never the key)",
            ["key"],
        )
        self.key_tokens = counter(
            "prefixgate_key_tokens",
            "prompt and completion tokens per API key name (the usage answered)",
            ["key", "kind"],
        )
        self.state_backend_up = gauge(
            "prefixgate_state_backend_up",
            "1 while the shared state (Redis with --redis-url; always 1 in-process) is "
            "reachable; 0 while limits fall back to this replica's own",
        )
        self.state_fallbacks = gauge(
            "prefixgate_state_fallback_requests",
            "requests admitted on this replica's local limits because Redis was unreachable",
        )
        self.registry.register(_ProcessHeap())
        self._window = window_s
        # (monotonic time, cumulative generated tokens) at each scrape, over the window
        self._marks: list[tuple[float, float]] = [(time.monotonic(), 0.0)]
        self._generated = 0.0

    def add_engine(
        self,
        stats: Callable[[], dict[str, Any] | None],
        model_name: str | None = None,
        block_size: int | None = None,
    ) -> None:
        """Expose ``stats()`` of the engine (read at scrape time); with ``model_name`` and
        ``block_size`` also under vLLM's pool metric names (``_PoolMetrics``)."""
        self.registry.register(_EngineStats(stats))
        if model_name is not None and block_size is not None:
            self.registry.register(_PoolMetrics(stats, model_name, block_size))

    def add_generated(self, n: int) -> None:
        """Count ``n`` generated tokens (feeds the counter and the tokens/s gauge)."""
        if n:
            self.generation_tokens.inc(n)
            self._generated += n

    def count_key_request(self, acct: RequestAccount) -> None:
        """Count one finished API request against its key's name and its usage's tokens
        (tokens not known are not counted); nothing for a request with no key (a 401)."""
        if acct.key_name is None:
            return
        self.key_requests.labels(acct.key_name).inc()
        if acct.prompt_tokens:
            self.key_tokens.labels(acct.key_name, "prompt").inc(acct.prompt_tokens)
        if acct.completion_tokens:
            self.key_tokens.labels(acct.key_name, "completion").inc(acct.completion_tokens)

    def bind_admission(self, admission: Any) -> None:
        """Read queue depth, queued tokens and running requests from the admission controller."""
        self.queue_depth.set_function(lambda: admission.queued_requests)
        self.registry.register(_TenantQueue(admission))
        self.queued_tokens.set_function(lambda: admission.queued_tokens)
        self.running.set_function(lambda: admission.in_flight - admission.queued_requests)

    def bind_upstreams(self, upstreams: Any) -> None:
        """Read each upstream's health and in-flight count at scrape time."""
        for up in upstreams:
            self.upstream_healthy.labels(up.url).set_function(_reader(up, "healthy"))
            self.upstream_ejections.labels(up.url).set_function(_reader(up.health, "ejections"))
            self.upstream_in_flight.labels(up.url).set_function(_reader(up, "in_flight"))

    def bind_state(self, backend: Any) -> None:
        """Read the shared-state backend's reachability and fallback count at scrape time."""
        self.state_backend_up.set_function(lambda: 1.0 if backend.up else 0.0)
        self.state_fallbacks.set_function(lambda: float(getattr(backend, "fallbacks", 0)))

    def render(self, view: MetricsView | None = None) -> bytes:
        """The Prometheus text exposition of every metric, as ``view`` may see it
        (``visible_exposition``; None: an operator's, everything)."""
        now = time.monotonic()
        self._marks.append((now, self._generated))
        while len(self._marks) > 2 and now - self._marks[1][0] >= self._window:
            self._marks.pop(0)
        t0, g0 = self._marks[0]
        self.tokens_per_s.set((self._generated - g0) / (now - t0) if now > t0 else 0.0)
        text = generate_latest(self.registry)
        return text if view is None or view.operator else visible_exposition(text, view)


# Families that name a tenant, a key or an upstream (its URL): whole to operators only.
PRIVATE_FAMILIES = ("prefixgate_key_", "prefixgate_tenant_", "prefixgate_upstream_")
# Of those, the families whose samples a key may see for itself (labelled with its name).
OWN_FAMILIES = ("prefixgate_key_", "prefixgate_tenant_")
# Labels whose values are upstream addresses, in any family (a routing policy's included).
ADDRESS_LABELS = ("upstream", "replica")
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class MetricsView:
    """Who reads ``/metrics``: an ``operator`` (everything), a tenant's key (``own``: its
    name — its own samples of the per-key and per-tenant families), or an anonymous caller
    (``own`` None). ``hidden``: strings no line shown to a non-operator may hold (the
    upstreams' addresses)."""

    operator: bool = False
    own: str | None = None
    hidden: tuple[str, ...] = ()


def visible_exposition(text: bytes, view: MetricsView) -> bytes:
    """What a non-operator ``view`` sees of a Prometheus text exposition: no per-upstream
    family, no sample labelled with an address (``ADDRESS_LABELS``), no line holding a
    ``hidden`` string; of the per-key and per-tenant families only the samples whose
    ``key`` / ``tenant`` label is ``view.own`` (none, and no ``# HELP`` / ``# TYPE``, to
    an anonymous caller)."""
    own = _escaped(view.own) if view.own is not None else None
    hidden = tuple(h.encode() for h in view.hidden if h)
    keep = []
    for line in text.split(b"\n"):
        comment = line.startswith((b"# HELP ", b"# TYPE "))
        name = line[7:] if comment else line
        if any(h in line for h in hidden) or name.startswith(b"prefixgate_upstream_"):
            continue
        labels = {} if comment or b"{" not in line else dict(_LABEL.findall(line))
        if any(label.encode() in labels for label in ADDRESS_LABELS):
            continue
        if name.startswith(tuple(p.encode() for p in OWN_FAMILIES)):
            if own is None:
                continue
            mine = labels.get(b"key", labels.get(b"tenant"))
            if not comment and mine != own:
                continue
        keep.append(line)
    return b"\n".join(keep)


def public_exposition(text: bytes) -> bytes:
    """An anonymous caller's exposition (``visible_exposition`` with no key): without the
    samples, ``# HELP`` and ``# TYPE`` lines of ``PRIVATE_FAMILIES``, nor any sample
    labelled with an upstream address."""
    return visible_exposition(text, MetricsView())


def _escaped(value: str) -> bytes:
    """A label value as the text exposition writes it (backslash, quote, newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").encode()


def _reader(obj: object, attr: str) -> Callable[[], float]:
    """A gauge's function: ``obj.attr`` as a float, read at scrape time."""
    return lambda: float(getattr(obj, attr))
