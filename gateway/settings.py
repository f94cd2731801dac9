"""The gateway's options (``GatewaySettings``: the serving ones; engine options live in
``EngineConfig``), their groups (``AdmissionConfig``, ``HealthPolicy``) and the app key every
room reads them by. Every room may import this module; it imports none of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aiohttp import web

# The names of the registries the settings check (the rooms above hold what they name; a test
# holds each equal to its registry): ``proxy.policies.POLICIES`` (the first is the default),
# ``wire.tool_parsers.PARSERS``, and the ``--upstream-cache-salt`` modes.
ROUTING_POLICIES = ("cache_aware", "rendezvous", "round_robin", "least_loaded", "precise")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
CACHE_SALT_MODES = ("auto", "on", "off")  # --upstream-cache-salt


def _require_at_least(config: object, low: int, *names: str) -> None:
    """Raise ``ValueError`` naming the first of the fields ``names`` of ``config`` below
    ``low`` (NaN included)."""
    for name in names:
        value = getattr(config, name)
        if not value >= low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def _require_positive(config: object, *names: str) -> None:
    """Raise ``ValueError`` naming the first of the fields ``names`` of ``config`` that is
    not > 0 (NaN included)."""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(slots=True)
class AdmissionConfig:
    """Bounds of the admission queue.

    Attributes:
        max_queued_requests: most requests waiting for their first token.
        max_queued_tokens: most prompt tokens (sum) waiting for prefill.
        max_running: most requests admitted at once, queued or generating (0 = unbounded).
    """

    max_queued_requests: int = 256
    max_queued_tokens: int = 262_144
    max_running: int = 0

    def __post_init__(self) -> None:
        _require_at_least(self, 1, "max_queued_requests", "max_queued_tokens")
        _require_at_least(self, 0, "max_running")


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """The health knobs of a proxy's upstream pool (``prefixgate serve`` flags of the same
    names, ``GatewaySettings`` fields; see the module docstring).

    Attributes:
        consecutive_failures: gateway failures in a row that eject an upstream (>= 1).
        base_ejection_s: seconds of the first ejection; the n-th lasts n times as long (> 0).
        max_ejection_s: the longest ejection (seconds, >= base_ejection_s).
        max_ejection_percent: most of the pool (%) out of rotation after a passive ejection
            (0..100; 0: answers never eject, only the active checks take an upstream out).
        interval_s: seconds between two active checks of one upstream (> 0).
        timeout_s: seconds an active check waits for its answer (> 0).
        unhealthy_threshold: failed checks in a row that mark an upstream down (>= 1).
        healthy_threshold: passed checks in a row that bring a down upstream back (>= 1).

    Raises:
        ValueError: a value out of its range (the message names it).
    """

    consecutive_failures: int = 3
    base_ejection_s: float = 10.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 50.0
    interval_s: float = 1.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2

    def __post_init__(self) -> None:
        _require_at_least(
            self, 1, "consecutive_failures", "unhealthy_threshold", "healthy_threshold"
        )
        _require_positive(self, "base_ejection_s", "interval_s", "timeout_s")
        if not self.max_ejection_s >= self.base_ejection_s:
            raise ValueError(
                f"max_ejection_s must be >= base_ejection_s, got {self.max_ejection_s}"
            )
        if not 0.0 <= self.max_ejection_percent <= 100.0:
            raise ValueError(
                f"max_ejection_percent must be in [0, 100], got {self.max_ejection_percent}"
            )

    def ejectable(self, out_after: int, pool: int) -> bool:
        """Whether ``out_after`` upstreams of ``pool`` may be out of rotation after one
        more passive ejection (at most ``max_ejection_percent`` of the pool)."""
        return out_after <= math.floor(pool * self.max_ejection_percent / 100.0 + 1e-9)


@dataclass(slots=True)
class GatewaySettings:
    """Options of the gateway (the serving ones; engine options live in EngineConfig).

    Attributes:
        model_name: the id served in ``/v1/models`` and accepted in ``model`` (default: the
            model folder's name, or ``"tiny-random"``); answers name it.
        model_aliases: more ids served beside ``model_name`` (vLLM's several
            ``--served-model-name``): listed in ``/v1/models`` and accepted in ``model``;
            answers name ``model_name``, as vLLM's name the first of its names.
        api_keys: keys accepted without limits (``--api-key``).
        keys_file: keys file with per-key limits and salts (see ``auth``).
        max_body_bytes: largest request body (bytes); larger → 413.
        max_request_tools: most tools in one request, any dialect (400 ``too_many_tools``).
        max_request_values: most JSON values other than numbers in one request body
            (objects, arrays, strings, keys, booleans, nulls; 400 ``too_many_values``).
        max_queued_requests, max_queued_tokens, max_running: admission bounds (see
            ``AdmissionConfig``).
        keepalive_s: seconds between SSE keep-alive comments while no token comes.
        poll_s: seconds between client-disconnect checks while waiting (non-streaming).
        max_prefix_ttl_s: longest ``ttl_seconds`` of a prefix; max_prefixes: most live ones.
        key_max_prefixes, key_max_pinned_fraction: each key's default share of the prefix
            API — live prefixes, and KV blocks pinned as a fraction of all KV blocks (a key's
            ``max_prefixes`` / ``max_pinned_blocks`` in the keys file override them).
        upstream_timeout_s: idle timeout of one upstream request: longest wait for the
            answer's first byte and between two reads of it (seconds, 0 = none); a stream
            that stalls this long ends with an error event.
        upstream_connect_timeout_s: connect timeout to an upstream (seconds).
        upstream_api_key: bearer key sent to the upstreams (None: the client's header is
            passed through when the gateway has no keys of its own).
        upstream_cache_salt: whether the upstreams take ``cache_salt`` (tenant isolation):
            ``"auto"`` (detected: prefixgate and vLLM do), ``"on"``, ``"off"``.
        health_interval_s: seconds between two active health checks of each upstream
            (``GET /health``); its ``/v1/models`` is read every 5 of them.
        health_check_timeout_s: seconds an active health check waits for its answer.
        unhealthy_threshold, healthy_threshold: failed checks in a row that mark an upstream
            down, passed checks in a row that bring it back.
        upstream_consecutive_failures: gateway failures in a row (refused or reset
            connection, 502/503/504, an answer cut or not in its shape) that eject an
            upstream (outlier detection, ``proxy.health``).
        upstream_base_ejection_s, upstream_max_ejection_s: the first ejection's seconds
            (the n-th lasts n times as long) and the longest.
        upstream_max_ejection_percent: most of the pool (%) out of rotation after an
            ejection by failures (0: answers never eject; the health checks still do).
        affinity_block_chars: characters per "block" of the prompt for prefix affinity.
        affinity_max_chars: at most this many leading characters are hashed.
        balance_abs_threshold, balance_rel_threshold: SGLang router's load-imbalance rule:
            route to the least loaded upstream when ``max - min > abs`` and
            ``max > rel * min`` (in-flight requests).
        header_timeout_s: seconds a connection may take to send a request's headers, counted
            from the connection's start or the end of its previous response (aiohttp's
            ``keepalive_timeout``: idle keep-alive connections close after it too).
        body_timeout_s: seconds a request may take to send its whole body (408 beyond).
        max_connections: most open client connections; beyond, a connection is answered
            503 ``too_many_connections`` and closed (also bounded by the open-file limit).
        shutdown_grace_s: on SIGTERM, seconds in-flight requests get to finish before
            streams are ended with an error event and other requests with a 503.
        tool_call_parser: how ``tool_choice="auto"`` answers are parsed (``hermes``,
            ``llama3_json``, ``mistral``; ``None``: "auto" is refused with a 400).
        dashboard_sample_s: seconds between two samples of ``/dashboard``'s charts.
        dashboard_window_s: seconds of samples ``/dashboard`` keeps (a ring buffer).
        routing: upstream mode's routing policy: ``cache_aware`` (default), ``rendezvous``,
            ``round_robin``, ``least_loaded`` or ``precise`` (``proxy.policies``; each
            policy validates its own options, ``Policy.check_options``).
        tokenizer: the upstreams' model folder, whose tokenizer and chat template
            ``precise`` routing tokenizes with (needed by it, refused otherwise).
        upstream_kv_events: upstream URL -> ``(PUB endpoint, replay endpoint or None)`` of
            its engine's KV events (``precise`` only; an upstream without one makes routing
            fall back to ``cache_aware``).
        upstream_metrics_interval_s: seconds between readings of each upstream's
            ``/metrics`` for its published load (vLLM's ``vllm:num_requests_*``;
            ``proxy.metrics_load``); 0: not read (>= 0.25 otherwise).
        precise_max_load_ratio: ``precise``'s bound on imbalance, judged per request: no
            upstream above this many times the mean in-flight load (the least loaded always
            qualifies), >= 1.
        precise_overlap_weight: ``precise``'s weight of prefill tokens against the tokens
            held by requests in flight (Dynamo's ``overlap_score_weight``), > 0.
        redis_url: share per-key limits, concurrency slots, prefixes and usage counters
            with every gateway replica on this Redis (None: in-process state; see
            ``redis_state``).
        redis_lease_ttl_s: seconds a concurrency slot outlives a replica that died holding
            it (leases are renewed every third of it while their request runs).
        trust_pool_headers: read the Gateway API Inference Extension's hint headers
            (``x-gateway-inference-fairness-id`` → tenant, ``x-gateway-inference-objective``
            → priority; ``tenancy.pool_hints``); off: they are ignored. Only for an engine
            pod behind an inference gateway that sets them.
        objective_priority: an ``InferenceObjective``'s name → the engine's request priority
            (lower first) when ``trust_pool_headers`` is on.
    """

    model_name: str | None = None
    model_aliases: list[str] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)
    keys_file: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_request_tools: int = 128
    max_request_values: int = 131_072
    max_queued_requests: int = 256
    max_queued_tokens: int = 262_144
    max_running: int = 0
    keepalive_s: float = 5.0
    poll_s: float = 0.25
    max_prefix_ttl_s: float = 86_400.0
    max_prefixes: int = 1024
    key_max_prefixes: int = 64
    key_max_pinned_fraction: float = 0.125
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 5.0
    upstream_api_key: str | None = None
    upstream_cache_salt: str = "auto"
    health_interval_s: float = 1.0
    health_check_timeout_s: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2
    upstream_consecutive_failures: int = 3
    upstream_base_ejection_s: float = 10.0
    upstream_max_ejection_s: float = 300.0
    upstream_max_ejection_percent: float = 50.0
    affinity_block_chars: int = 64
    affinity_max_chars: int = 4096
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    header_timeout_s: float = 15.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096
    shutdown_grace_s: float = 5.0
    tool_call_parser: str | None = None
    dashboard_sample_s: float = 2.0
    dashboard_window_s: float = 300.0
    routing: str = "cache_aware"
    tokenizer: str | None = None
    upstream_kv_events: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    upstream_metrics_interval_s: float = 2.0
    precise_max_load_ratio: float = 1.3
    precise_overlap_weight: float = 1.0
    redis_url: str | None = None
    redis_lease_ttl_s: float = 10.0
    trust_pool_headers: bool = False
    objective_priority: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [self.model_name, *self.model_aliases]
        if self.model_aliases and self.model_name is None:
            raise ValueError("model_aliases needs model_name (the first served name)")
        for name in names:
            if name is not None and (not isinstance(name, str) or not name.strip()):
                raise ValueError(f"a served model name must be a non-empty string, got {name!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"served model names given twice: {names}")
        for name, prio in self.objective_priority.items():
            if not isinstance(name, str) or not name.strip() or name != name.strip():
                raise ValueError(f"objective_priority: bad objective name {name!r}")
            if isinstance(prio, bool) or not isinstance(prio, int) or not -(2**31) <= prio < 2**31:
                raise ValueError(
                    f"objective_priority of {name}: must be a 32-bit integer, got {prio!r}"
                )
        if self.objective_priority and not self.trust_pool_headers:
            raise ValueError("objective_priority needs trust_pool_headers (--trust-pool-headers)")
        _require_at_least(self, 1024, "max_body_bytes")
        if self.max_request_tools < 0 or self.max_request_values < 1024:
            raise ValueError("max_request_tools must be >= 0 and max_request_values >= 1024")
        _require_positive(
            self,
            "keepalive_s",
            "poll_s",
            "health_interval_s",
            "max_prefix_ttl_s",
            "header_timeout_s",
            "body_timeout_s",
            "dashboard_sample_s",
            "redis_lease_ttl_s",
        )
        if self.dashboard_window_s < self.dashboard_sample_s:
            raise ValueError("dashboard_window_s must be >= dashboard_sample_s")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(
                f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}"
            )
        self.health_policy()  # ValueError on a knob out of its range
        if self.upstream_cache_salt not in CACHE_SALT_MODES:
            raise ValueError(
                f"upstream_cache_salt must be auto, on or off, got {self.upstream_cache_salt!r}"
            )
        _require_at_least(self, 1, "max_connections")
        _require_at_least(self, 0, "shutdown_grace_s", "upstream_timeout_s")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {self.tool_call_parser!r}; choose one of "
                f"{sorted(TOOL_CALL_PARSERS)}"
            )
        _require_at_least(self, 0, "key_max_prefixes")
        if not 0.0 <= self.key_max_pinned_fraction <= 1.0:
            raise ValueError(
                f"key_max_pinned_fraction must be in [0, 1], got {self.key_max_pinned_fraction}"
            )
        if self.affinity_block_chars < 1 or self.affinity_max_chars < 1:
            raise ValueError("affinity_block_chars and affinity_max_chars must be >= 1")
        if self.balance_rel_threshold < 1.0 or self.balance_abs_threshold < 0:
            raise ValueError("balance_rel_threshold must be >= 1 and balance_abs_threshold >= 0")
        if self.upstream_metrics_interval_s != 0 and not self.upstream_metrics_interval_s >= 0.25:
            raise ValueError(
                "upstream_metrics_interval_s must be 0 (off) or >= 0.25, got "
                f"{self.upstream_metrics_interval_s}"
            )

    def health_policy(self) -> HealthPolicy:
        """The upstream health knobs as a ``HealthPolicy``.

        Raises:
            ValueError: a knob out of its range.
        """
        return HealthPolicy(
            consecutive_failures=self.upstream_consecutive_failures,
            base_ejection_s=self.upstream_base_ejection_s,
            max_ejection_s=self.upstream_max_ejection_s,
            max_ejection_percent=self.upstream_max_ejection_percent,
            interval_s=self.health_interval_s,
            timeout_s=self.health_check_timeout_s,
            unhealthy_threshold=self.unhealthy_threshold,
            healthy_threshold=self.healthy_threshold,
        )

    def admission_config(self) -> AdmissionConfig:
        """The admission bounds as an AdmissionConfig."""
        return AdmissionConfig(self.max_queued_requests, self.max_queued_tokens, self.max_running)


SETTINGS: web.AppKey[GatewaySettings] = web.AppKey("prefixgate_settings", GatewaySettings)
