"""The aiohttp applications, one per mode (they share only the health/metrics routes).

* **local** — ``create_app(engine)`` serves an engine (any ``EngineClient``: ``AsyncEngine``
  in-process), or ``create_app(None)`` and ``attach_engine(app, engine)`` once it has loaded;
  until then every model route answers 503 and ``/ready`` is 503 while ``/health`` is 200.
* **upstream** — ``create_proxy_app(["http://host:port", ...])`` is a reverse proxy to other
  OpenAI-compatible servers with prefix-affinity routing (see ``upstream``). It imports no
  torch: ``pip install 'prefixgate[proxy]'`` is enough to run it.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}],
POST /v1/responses (proxy ``proxy/responses_relay.py``), POST /v1/embeddings (``--runner pooling``; upstream mode relays
it, ``proxy/token_relay.py``), POST /v1/prefixes, GET|DELETE /v1/prefixes/{id}, POST /tokenize,
POST /detokenize (relayed in upstream mode too), Gemini's /v1beta routes (``local/gemini.py``, proxy
``proxy/gemini_relay.py``; ``docs/gemini.md``), GET /health, GET /ready, GET /metrics, GET /dashboard (a live
page of the metrics, see ``dashboard``) and GET /dashboard/data. Every answer carries
``x-request-id`` (``request_id``). Run the app with ``handler_cancellation=True`` (``server.start_server`` does)
so a client that disconnects cancels its handler at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from aiohttp import web
from prefixgate.engine.protocol import EngineClient
from prefixgate.gateway import dashboard
from prefixgate.gateway.http import lifecycle, request_id
from prefixgate.gateway.http.body_limits import body_limits_middleware
from prefixgate.gateway.http.errors import (
    ERROR_CODE,
    GEMINI,
    APIError,
    Handler,
    error_middleware,
    expect_continue,
    is_gemini_path,
    route_miss,
)
from prefixgate.gateway.http.json_guard import (
    GUARD_LIMITS,
    Limits,
    json_guard_middleware,
    no_body,
)
from prefixgate.gateway.http.metrics import CONTENT_TYPE, GatewayMetrics, MetricsView
from prefixgate.gateway.http.server import FDS_PER_CONNECTION
from prefixgate.gateway.http.sse import CLIENT_LEFT
from prefixgate.gateway.local import (
    embeddings,
    gemini,
    messages,
    openai_routes,
    prefix_routes,
    responses_api,
    tokenize,
)
from prefixgate.gateway.local.cache_diagnostics import PROMPT_LOG, PromptLog
from prefixgate.gateway.local.cache_pins import CachePins
from prefixgate.gateway.local.prefixes import PrefixRegistry
from prefixgate.gateway.local.serving import LOCAL, LocalServing
from prefixgate.gateway.local.token_texts import TokenTexts
from prefixgate.gateway.proxy import gemini_relay, messages_relay, responses_relay, token_relay
from prefixgate.gateway.proxy import prefix_routes as proxy_prefix_routes
from prefixgate.gateway.proxy import routes as proxy_routes
from prefixgate.gateway.proxy.config import ProxyConfig
from prefixgate.gateway.proxy.metrics_load import MetricsLoadScraper
from prefixgate.gateway.proxy.policies import check_settings
from prefixgate.gateway.proxy.prefixes import ProxyPrefixRegistry
from prefixgate.gateway.proxy.serving import PROXY, ProxyServing
from prefixgate.gateway.proxy.upstream import Upstream, UpstreamRouter
from prefixgate.gateway.settings import SETTINGS, GatewaySettings
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.admission import AdmissionController
from prefixgate.gateway.tenancy.admission_wait import EngineWait
from prefixgate.gateway.tenancy.keys import KeyRing, KeySpec
from prefixgate.gateway.tenancy.redis_state import make_backend
from prefixgate.gateway.wire.models_dialect import client_dialect, models_route

logger = logging.getLogger("prefixgate.gateway")


def create_app(
    engine: EngineClient | None = None,
    settings: GatewaySettings | None = None,
    *,
    settings_checked: bool = False,
    key_specs: list[KeySpec] | None = None,
) -> web.Application:
    """The gateway serving a local engine.

    Args:
        engine: the engine, or ``None`` to attach it later with ``attach_engine`` (the app
            answers 503 ``model_not_ready`` until then).
        settings: serving options (defaults: ``GatewaySettings()``).
        settings_checked: the caller has run ``policies.check_settings`` on ``settings``
            (``prefixgate serve`` does, before its imports), so it is not run again.
        key_specs: ``settings.keys_file`` as the caller read it (``prefixgate serve`` does,
            before its imports), so it is not read again.

    Raises:
        TypeError: ``engine`` is a list of URLs (upstream mode is ``create_proxy_app``).
        ValueError: bad settings or keys file.
    """
    if isinstance(engine, Sequence):
        raise TypeError("create_app serves a local engine; upstream mode is create_proxy_app(urls)")
    app, st = _base_app(settings, settings_checked, key_specs)
    local = app[LOCAL] = LocalServing()
    app[PROMPT_LOG] = PromptLog()  # recent Messages prompts, for their cache diagnostics
    _add_api_routes(app, proxy_mode=False)
    gemini.add_routes(app, expect_continue)

    async def release_prefixes(app: web.Application) -> None:
        if sweeper:
            sweeper[0].cancel()
        if local.prefixes is not None:
            local.prefixes.clear()
        if local.cache_pins is not None:
            local.cache_pins.clear()

    async def sweep_prefixes() -> None:
        # With shared state, a prefix deleted through another replica is unpinned here
        # within one interval (a third of the lease TTL), not at its own TTL.
        while True:
            await asyncio.sleep(st.settings.redis_lease_ttl_s / 3)
            if local.prefixes is not None:
                try:
                    await local.prefixes.sweep()
                except Exception:  # noqa: BLE001 - a failed sweep waits for the next one
                    logger.exception("prefix sweep failed")

    sweeper: list[asyncio.Task[None]] = []

    async def start_sweeper(app: web.Application) -> None:
        if st.settings.redis_url:
            sweeper.append(asyncio.get_running_loop().create_task(sweep_prefixes()))

    app.on_startup.append(start_sweeper)
    app.on_cleanup.append(release_prefixes)
    _add_fallback_route(app)
    if engine is not None:
        attach_engine(app, engine)
    return app


def create_proxy_app(
    upstreams: Sequence[str] | ProxyConfig,
    settings: GatewaySettings | None = None,
    *,
    settings_checked: bool = False,
    key_specs: list[KeySpec] | None = None,
) -> web.Application:
    """The gateway as a reverse proxy to OpenAI-compatible ``upstreams``: base URLs (their
    models discovered from each one's ``/v1/models``), or a config file's model list
    (``proxy.config.load_config``: models, deployments, aliases, fallbacks, TLS).
    ``settings_checked``, ``key_specs``: as ``create_app``'s.

    Raises:
        ValueError: bad settings, keys file or upstream URL (none, malformed, repeated).
    """
    if isinstance(upstreams, str | bytes):
        raise TypeError("upstreams must be a list of base URLs, not one string")
    app, st = _base_app(settings, settings_checked, key_specs)
    s = st.settings
    if isinstance(upstreams, ProxyConfig):
        config: ProxyConfig | None = upstreams
        pool: list[str | Upstream] = list(upstreams.upstreams())
    else:
        config, pool = None, list(upstreams)
    router = UpstreamRouter(
        pool,
        s.balance_abs_threshold,
        s.balance_rel_threshold,
        s.health_interval_s,
        s.upstream_connect_timeout_s,
        s.upstream_timeout_s,
        cache_salt=s.upstream_cache_salt,
        auth="Bearer " + s.upstream_api_key if s.upstream_api_key else None,
        policy=s.routing,
        block_chars=s.affinity_block_chars,
        max_chars=s.affinity_max_chars,
        models=config.models if config is not None else None,
        health=s.health_policy(),
        forwards_client_keys=not s.api_keys and not s.keys_file,
    )
    if config is None and s.upstream_api_key and any(u.auth for u in router.upstreams):
        raise ValueError(
            "an upstream URL carries user:password and --upstream-api-key is set: give the "
            "upstreams one credential (one Authorization header)"
        )
    st.metrics.bind_upstreams(router.upstreams)
    router.policy.setup(s, [u.url for u in router.upstreams])  # the policy's own parts
    for collector in router.policy.collectors():
        st.metrics.registry.register(collector)
    st.model_name = st.model_name or "upstream"
    st.ready = True
    _add_api_routes(app, proxy_mode=True)
    gemini_relay.add_routes(app, expect_continue)
    app[PROXY] = ProxyServing(
        router,
        ProxyPrefixRegistry(
            router,
            st.shared,
            s.max_prefix_ttl_s,
            s.max_prefixes,
        ),
    )
    app[FDS_PER_CONNECTION] = 2  # each client connection may hold one to an upstream

    scraper = (
        MetricsLoadScraper(router, s.upstream_metrics_interval_s)
        if s.upstream_metrics_interval_s > 0
        else None
    )

    async def start(app: web.Application) -> None:
        await router.start()
        router.policy.start()
        if scraper is not None:  # upstreams' published load (vLLM's /metrics)
            scraper.start()

    async def stop(app: web.Application) -> None:
        if scraper is not None:
            await scraper.close()
        await app[PROXY].prefixes.close()  # releases upstream pins while the session is open
        await router.close()
        router.policy.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    _add_fallback_route(app)
    return app


def _base_app(
    settings: GatewaySettings | None,
    settings_checked: bool,
    key_specs: list[KeySpec] | None = None,
) -> tuple[web.Application, GatewayState]:
    """What both modes share: state, error middleware, /health, /metrics and /dashboard;
    ``settings``' routing policies' options checked unless ``settings_checked``."""
    settings = settings or GatewaySettings()
    if not settings_checked:  # each routing policy's options (settings knows only their names)
        check_settings(settings)
    admission = AdmissionController(settings.admission_config())
    metrics = GatewayMetrics()
    metrics.bind_admission(admission)
    st = GatewayState(
        settings=settings,
        keys=KeyRing.from_options(settings.api_keys, settings.keys_file, key_specs),
        admission=admission,
        metrics=metrics,
        model_name=settings.model_name or "",
        shared=make_backend(settings.redis_url, settings.redis_lease_ttl_s),
    )
    metrics.bind_state(st.shared)
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[
            lifecycle.drain_middleware,
            count_requests,
            error_middleware,
            require_key,
            dashboard.usage_middleware,
            body_limits_middleware,
            json_guard_middleware,
        ],
    )
    lifecycle.install(app)
    app.on_response_prepare.append(request_id.stamp)
    app[STATE] = st
    app[SETTINGS] = settings
    app[GUARD_LIMITS] = Limits(settings.max_request_tools, settings.max_request_values)
    app.router.add_get("/health", health, expect_handler=expect_continue)
    app.router.add_get("/version", version, expect_handler=expect_continue)
    app.router.add_get("/metrics", metrics_route, expect_handler=expect_continue)
    dashboard.install(app)

    async def start_shared(app: web.Application) -> None:
        await st.shared.start()

    async def close_shared(app: web.Application) -> None:
        await st.shared.close()

    app.on_startup.append(start_shared)
    app.on_cleanup.append(close_shared)
    return app, st


def _add_fallback_route(app: web.Application) -> None:
    """Register last: every other method and path lands here, so unknown routes (404) and
    methods (405) are answered by our handler and ``Expect`` handler, never aiohttp's
    (plain text, and a 500 for a header that is not UTF-8)."""
    app.router.add_route("*", "/{tail:.*}", _no_route, expect_handler=expect_continue)


@no_body
async def _no_route(request: web.Request) -> web.Response:
    """404 ``not_found`` for an unknown path, 405 ``method_not_allowed`` for a known path
    asked with another method (with ``Allow``): ``errors.route_miss``; in the dialect of
    ``_miss_dialect``."""
    raise await route_miss(request)


def _miss_dialect(request: web.Request) -> str:
    """The error dialect of a request no route took: on the model routes' paths
    (``/v1/models``, ``/v1/models/{model}``) the client's, as those routes answer it
    (``models_dialect.client_dialect``: a Google key's Gemini, ``anthropic-version``'s
    Anthropic); Gemini's on Gemini's paths (``errors.is_gemini_path``: a model method's
    ``/v1/models/{model}:{method}`` too); else OpenAI's."""
    path = request.path
    if is_gemini_path(path):
        return GEMINI
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return client_dialect(request)
    return "openai"


_no_route.error_dialect = _miss_dialect  # type: ignore[attr-defined]


_ROUTE_LABELS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/embeddings": "embeddings",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
_PROBES = frozenset(("/health", "/ready", "/metrics", "/version"))
CLIENT_GONE = 499  # nginx's "client closed request"


# Routes any caller may ask without a key (canonical paths): the probes (``/ready`` and
# ``/metrics`` hide per-key and upstream details from them, ``http.metrics``), the dashboard
# and the fallback route's 404/405. Every other registered route checks the key first.
OPEN_ROUTES = frozenset(
    (
        "/health",
        "/ready",
        "/metrics",
        "/version",
        "/dashboard",
        "/dashboard/dashboard.js",
        "/dashboard/data",
        "/{tail}",
    )
)


@web.middleware
async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The caller's key is checked before the route's handler runs, on every route but
    ``OPEN_ROUTES``, in both modes: a missing or unknown key is 401 ``invalid_api_key``
    before any other answer (503 while the model loads, 501 of a local-mode route in upstream
    mode, 400 of a bad body, 413). The handlers ask again for their ``Principal``: the one
    kept on the request."""
    resource = request.match_info.route.resource
    if resource is None or resource.canonical not in OPEN_ROUTES:
        request.app[STATE].keys.authenticate(request)
    return await handler(request)


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count every API request in ``prefixgate_requests_total{route, status, code}`` — the
    refusals too (401, 400, 404, 413, 429, ...: ``code`` is the OpenAI error code, ``""`` on
    success); a client gone before its answer counts as 499. Probes are not counted. ``route``
    is the API route's short name (``chat``, ``completions``, ``responses``, ``embeddings``,
    ``tokenize``, ``detokenize``, ``models``, ``prefixes``, ``messages``, ``count_tokens``,
    ``gemini`` for every Gemini route: ``/v1beta``, ``/v1/models/{model}:{method}``),
    ``other`` for any other path."""
    path = request.path
    if path in _PROBES or path.startswith("/dashboard"):
        return await handler(request)
    if path in _ROUTE_LABELS:
        route = _ROUTE_LABELS[path]
    elif is_gemini_path(path):
        route = "gemini"
    elif path.startswith(("/v1/models", "/v1/prefixes")):
        route = path.split("/")[2]
    else:
        route = "other"
    counter = request.app[STATE].metrics.requests
    t0 = time.monotonic()
    try:
        resp = await handler(request)
    except BaseException:
        ending = lifecycle.shutdown_ending(request)
        if ending is not None:  # cut by the shutdown: its ending is the answer, logged once
            counter.labels(route, str(ending), "server_shutting_down").inc()
            raise
        counter.labels(route, str(CLIENT_GONE), "client_gone").inc()
        _log_client_gone(request, time.monotonic() - t0)
        raise
    if resp.get(CLIENT_LEFT):  # a stream whose client left mid-answer: not the 200 it began
        counter.labels(route, str(CLIENT_GONE), "client_gone").inc()
        _log_client_gone(request, time.monotonic() - t0)
        return resp
    code = resp.get(ERROR_CODE) or ("" if resp.status < 400 else "client_gone")
    counter.labels(route, str(resp.status), code).inc()
    return resp


def _log_client_gone(request: web.Request, seconds: float) -> None:
    """The access line of a request whose client left before its answer (its handler was
    cancelled: aiohttp logs only answered requests), status 499, with the usage it had."""
    access = getattr(request.protocol, "access_logger", None)
    if access is not None and access.enabled:
        access.log(request, web.Response(status=CLIENT_GONE), seconds)


def attach_engine(app: web.Application, engine: EngineClient) -> None:
    """Serve ``engine`` from now on (local mode); the app becomes ready."""
    st = app[STATE]
    local = app[LOCAL]
    local.engine = engine
    local.prefixes = PrefixRegistry(
        engine, st.settings.max_prefix_ttl_s, st.settings.max_prefixes, st.shared
    )
    local.token_texts = TokenTexts(engine.tokenizer)
    local.cache_pins = CachePins(engine, local.prefixes.pinned_blocks)
    local.prefixes.breakpoints = local.cache_pins  # one pin share per key: both count
    # Retry-After's service-time estimate: requests run this many at once (decode batch).
    st.admission.concurrency = engine.config.max_num_seqs
    # Retry-After and TTFT budgets from the engine's queue and measured rates.
    st.admission.wait = EngineWait(
        engine, engine.config.max_num_seqs, engine.config.max_num_batched_tokens
    )
    if not st.model_name:
        st.model_name = default_model_name(engine)
    # the engine's stats, and under vLLM's pool metric names (an Inference Extension pool)
    st.metrics.add_engine(engine.stats, st.model_name, getattr(engine.config, "block_size", None))
    st.ready = True


def default_model_name(engine: EngineClient) -> str:
    """The served model id: the model folder's name, or ``"tiny-random"`` for the preset."""
    path = engine.config.model
    if path:
        return os.path.basename(os.path.normpath(str(path)))
    return "tiny-random"


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while the process serves HTTP (liveness)."""
    return web.json_response({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    """GET /version: ``{"version": prefixgate's installed version}`` (vLLM's route of that name,
    which tools read to tell a server's release; ``"unknown"`` from an uninstalled tree). Open
    to every caller, as vLLM's is, in both modes."""
    try:
        installed = metadata.version("prefixgate")
    except metadata.PackageNotFoundError:
        installed = "unknown"
    return web.json_response({"version": installed})


async def ready_local(request: web.Request) -> web.Response:
    """GET /ready (local mode): 200 once the model is loaded, else 503."""
    st = request.app[STATE]
    request.app[LOCAL].require_engine()
    return web.json_response(
        {
            "status": "ready",
            "mode": "local",
            "model": st.model_name,
            "state": st.shared.describe(),
        }
    )


async def ready_proxy(request: web.Request) -> web.Response:
    """GET /ready (upstream mode): 200 while an upstream is healthy, else 503. The upstreams'
    details (URLs, last errors) need a key when the gateway has keys; without one, only how
    many are healthy."""
    st = request.app[STATE]
    pool = request.app[PROXY].router.describe()
    if not any(u["healthy"] for u in pool):
        refused = sum(1 for u in pool if u["state"] == "auth_failed")
        why = f" ({refused} refused the gateway's credentials)" if refused else ""
        raise APIError(
            503, "no healthy upstream" + why, code="upstream_unavailable", retry_after=2.0
        )
    salts = {u["cache_salt"] for u in pool}
    body: dict = {
        "status": "ready",
        "mode": "upstream",
        # False: some upstream ignores cache_salt, so tenants may share its cache there;
        # None: some upstream's support is not known yet (never a yes not known)
        "tenant_isolation": False if False in salts else None if None in salts else True,
        "upstreams_healthy": sum(1 for u in pool if u["healthy"]),
        "upstreams_total": len(pool),
    }
    if _viewer(request).operator:
        body["upstreams"] = _with_kv_events(request.app[PROXY].router, pool)
        body["state"] = st.shared.describe()
    return web.json_response(body)


def _with_kv_events(router: Any, pool: list[dict]) -> list[dict]:
    """``pool`` with each upstream's ``kv_events``: ``None`` without a feed (no
    ``--upstream-kv-events`` for it, or a routing policy that reads none), else the feed's
    state as the policy reports it (``RoutingPolicy.kv_events``: ``synced``, ``hash_scheme``
    as its events showed, ``blocks`` held, ``load_reports`` received: an engine that publishes
    none, as vLLM, shows 0)."""
    feeds = router.policy.kv_events()
    return [{**u, "kv_events": feeds.get(u["url"])} for u in pool]


async def metrics_route(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text exposition, as the caller may see it (``_viewer``): all
    of it with an operator's key (``Authorization: Bearer <key>``, a scraper's
    ``bearer_token``) or on an open gateway; with a tenant's key its own per-key and
    per-tenant samples besides the aggregates; without a key the aggregates only. No
    upstream address to anyone but an operator, under any routing policy."""
    st = request.app[STATE]
    view = _viewer(request)
    body = st.metrics.render(None if view.operator else view)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _viewer(request: web.Request) -> MetricsView:
    """Who the caller is, for what it may read of the gateway's state: an operator (an
    operator's key, or anyone on an open gateway), a tenant's key (its name), or anonymous
    (no key, or one the gateway does not know); with the upstreams' addresses (URLs,
    ``host:port``, KV-event endpoints) that no line shown to a non-operator may hold."""
    st = request.app[STATE]
    try:
        principal = st.keys.authenticate(request)
    except APIError:
        principal = None
    if principal is not None and principal.operator:
        return MetricsView(operator=True)
    hidden: list[str] = []
    proxy = request.app.get(PROXY)
    if proxy is not None:
        for up in proxy.router.upstreams:
            hidden += [up.url, up.url.split("://", 1)[-1]]
    for pub, replay in st.settings.upstream_kv_events.values():
        hidden += [pub, *([replay] if replay else [])]
    return MetricsView(own=principal.name if principal else None, hidden=tuple(hidden))


# The API's routes in both modes, one table: (method, path, the handler in local mode, the
# handler in proxy mode). Gemini's routes follow them (``add_routes`` of ``local.gemini`` and
# ``proxy.gemini_relay``, one table of their own); the fallback route comes last.
_API_ROUTES: tuple[tuple[str, str, Handler, Handler], ...] = (
    ("GET", "/ready", ready_local, ready_proxy),
    ("POST", "/v1/chat/completions", openai_routes.chat_completions, proxy_routes.proxy_generate),
    ("POST", "/v1/completions", openai_routes.completions, proxy_routes.proxy_generate),
    ("POST", "/v1/responses", responses_api.create_response, responses_relay.create_response),
    ("POST", "/v1/messages", messages.create_message, messages_relay.create_message),
    ("POST", "/v1/messages/count_tokens", messages.count_tokens, messages_relay.count_tokens),
    ("POST", "/v1/embeddings", embeddings.create_embeddings, token_relay.relay_embeddings),
    ("POST", "/tokenize", tokenize.tokenize, token_relay.relay_tokens),
    ("POST", "/detokenize", tokenize.detokenize, token_relay.relay_tokens),
    (
        "GET",
        "/v1/models",
        models_route(openai_routes.list_models, gemini.list_models),
        models_route(proxy_routes.proxy_get, gemini_relay.list_models),
    ),
    (
        "GET",
        "/v1/models/{model:.+}",  # a hub id (org/name) sent unquoted, as google-genai sends it
        models_route(openai_routes.get_model, gemini.get_model),
        models_route(proxy_routes.proxy_get, gemini_relay.get_model),
    ),
    ("POST", "/v1/prefixes", prefix_routes.create_prefix, proxy_prefix_routes.create_prefix),
    ("GET", "/v1/prefixes/{prefix_id}", prefix_routes.get_prefix, proxy_prefix_routes.get_prefix),
    (
        "DELETE",
        "/v1/prefixes/{prefix_id}",
        prefix_routes.delete_prefix,
        proxy_prefix_routes.delete_prefix,
    ),
)


def _add_api_routes(app: web.Application, *, proxy_mode: bool) -> None:
    """``_API_ROUTES``' handlers of one mode on ``app``, each answering ``Expect:
    100-continue`` through ``expect_continue`` (a GET also HEAD, as ``add_get`` does)."""
    for method, path, local, proxy in _API_ROUTES:
        handler = proxy if proxy_mode else local
        if method == "GET":
            app.router.add_get(path, handler, expect_handler=expect_continue)
        else:
            app.router.add_route(method, path, handler, expect_handler=expect_continue)
