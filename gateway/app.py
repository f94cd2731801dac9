"""The aiohttp applications, one per mode (they share only the health/metrics routes).

* **local** — ``create_app(engine)`` serves an engine (any ``EngineClient``: ``AsyncEngine``
  in-process), or ``create_app(None)`` and ``attach_engine(app, engine)`` once it has loaded;
  until then every model route answers 503 and ``/ready`` is 503 while ``/health`` is 200.
* **upstream** — ``create_proxy_app(["http://host:port", ...])`` is a reverse proxy to other
  OpenAI-compatible servers with prefix-affinity routing (see ``upstream``). It imports no
  torch: ``pip install 'prefixgate[proxy]'`` is enough to run it.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}],
POST /v1/responses, POST /v1/prefixes, GET|DELETE /v1/prefixes/{id}, POST /tokenize,
POST /detokenize (local mode), GET /health, GET /ready, GET /metrics. Every answer carries
``x-request-id`` (``request_id``). Run the app with ``handler_cancellation=True`` (``server.start_server`` does)
so a client that disconnects cancels its handler at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from aiohttp import web
from prefixgate.engine.protocol import EngineClient
from prefixgate.gateway import (
    lifecycle,
    request_id,
    responses_api,
    routes_openai,
    routes_prefixes,
    routes_tokenize,
    routes_upstream,
)
from prefixgate.gateway.admission import AdmissionController
from prefixgate.gateway.auth import KeyRing
from prefixgate.gateway.errors import APIError, error_middleware
from prefixgate.gateway.limits import body_limits_middleware
from prefixgate.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from prefixgate.gateway.prefixes import PrefixRegistry
from prefixgate.gateway.renderers import TokenTexts
from prefixgate.gateway.state import STATE, GatewaySettings, GatewayState
from prefixgate.gateway.upstream import UpstreamRouter


def create_app(
    engine: EngineClient | None = None, settings: GatewaySettings | None = None
) -> web.Application:
    """The gateway serving a local engine.

    Args:
        engine: the engine, or ``None`` to attach it later with ``attach_engine`` (the app
            answers 503 ``model_not_ready`` until then).
        settings: serving options (defaults: ``GatewaySettings()``).

    Raises:
        TypeError: ``engine`` is a list of URLs (upstream mode is ``create_proxy_app``).
        ValueError: bad settings or keys file.
    """
    if isinstance(engine, Sequence):
        raise TypeError("create_app serves a local engine; upstream mode is create_proxy_app(urls)")
    app, st = _base_app(settings)
    app.router.add_get("/ready", ready_local)
    r = app.router
    r.add_post("/v1/chat/completions", routes_openai.chat_completions)
    r.add_post("/v1/completions", routes_openai.completions)
    r.add_post("/v1/responses", responses_api.create_response)
    r.add_post("/tokenize", routes_tokenize.tokenize)
    r.add_post("/detokenize", routes_tokenize.detokenize)
    r.add_get("/v1/models", routes_openai.list_models)
    r.add_get("/v1/models/{model}", routes_openai.get_model)
    r.add_post("/v1/prefixes", routes_prefixes.create_prefix)
    r.add_get("/v1/prefixes/{prefix_id}", routes_prefixes.get_prefix)
    r.add_delete("/v1/prefixes/{prefix_id}", routes_prefixes.delete_prefix)

    async def release_prefixes(app: web.Application) -> None:
        if st.prefixes is not None:
            st.prefixes.clear()

    app.on_cleanup.append(release_prefixes)
    if engine is not None:
        attach_engine(app, engine)
    return app


def create_proxy_app(
    upstreams: Sequence[str], settings: GatewaySettings | None = None
) -> web.Application:
    """The gateway as a reverse proxy to OpenAI-compatible ``upstreams`` (base URLs).

    Raises:
        ValueError: bad settings, keys file or upstream URL (none, malformed, repeated).
    """
    if isinstance(upstreams, str | bytes):
        raise TypeError("upstreams must be a list of base URLs, not one string")
    app, st = _base_app(settings)
    s = st.settings
    router = UpstreamRouter(
        list(upstreams),
        s.balance_abs_threshold,
        s.balance_rel_threshold,
        s.health_interval_s,
        s.upstream_connect_timeout_s,
        s.upstream_timeout_s,
    )
    if s.upstream_api_key and any(u.auth for u in router.upstreams):
        raise ValueError(
            "an upstream URL carries user:password and --upstream-api-key is set: give the "
            "upstreams one credential (one Authorization header)"
        )
    st.router = router
    st.metrics.bind_upstreams(router.upstreams)
    st.model_name = st.model_name or "upstream"
    st.ready = True
    r = app.router
    r.add_get("/ready", ready_proxy)
    r.add_post("/v1/chat/completions", routes_upstream.proxy_generate)
    r.add_post("/v1/completions", routes_upstream.proxy_generate)
    r.add_post("/v1/responses", responses_api.responses_unsupported)
    r.add_get("/v1/models", routes_upstream.proxy_get)
    r.add_get("/v1/models/{model}", routes_upstream.proxy_get)
    r.add_route("*", "/v1/prefixes", _no_prefixes)
    r.add_route("*", "/v1/prefixes/{prefix_id}", _no_prefixes)

    async def start(app: web.Application) -> None:
        await router.start()

    async def stop(app: web.Application) -> None:
        await router.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def _base_app(settings: GatewaySettings | None) -> tuple[web.Application, GatewayState]:
    """What both modes share: state, error middleware, /health and /metrics."""
    settings = settings or GatewaySettings()
    admission = AdmissionController(settings.admission_config())
    metrics = GatewayMetrics()
    metrics.bind_admission(admission)
    st = GatewayState(
        settings=settings,
        keys=KeyRing.from_options(settings.api_keys, settings.keys_file),
        admission=admission,
        metrics=metrics,
        model_name=settings.model_name or "",
    )
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[lifecycle.drain_middleware, error_middleware, body_limits_middleware],
    )
    lifecycle.install(app)
    app.on_response_prepare.append(request_id.stamp)
    app[STATE] = st
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_route)
    return app, st


def attach_engine(app: web.Application, engine: EngineClient) -> None:
    """Serve ``engine`` from now on (local mode); the app becomes ready."""
    st = app[STATE]
    st.engine = engine
    st.prefixes = PrefixRegistry(engine, st.settings.max_prefix_ttl_s, st.settings.max_prefixes)
    st.token_texts = TokenTexts(engine.tokenizer)
    st.metrics.add_engine(engine.stats)
    # Retry-After's service-time estimate: requests run this many at once (decode batch).
    st.admission.concurrency = engine.config.max_num_seqs
    if not st.model_name:
        st.model_name = default_model_name(engine)
    st.ready = True


def default_model_name(engine: EngineClient) -> str:
    """The served model id: the model folder's name, or ``"tiny-random"`` for the preset."""
    path = engine.config.model
    if path:
        return os.path.basename(os.path.normpath(str(path)))
    return "tiny-random"


async def _no_prefixes(request: web.Request) -> web.Response:
    # 501: clients (the SDK's PrefixSession) then fall back to sending the full messages.
    raise APIError(
        501,
        "the prefix API is not available in upstream mode; send the full "
        "messages (prefix affinity keeps a system prompt on one upstream)",
        code="unsupported_in_upstream_mode",
        type="invalid_request_error",
    )


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while the process serves HTTP (liveness)."""
    return web.json_response({"status": "ok"})


async def ready_local(request: web.Request) -> web.Response:
    """GET /ready (local mode): 200 once the model is loaded, else 503."""
    st = request.app[STATE]
    st.require_engine()
    return web.json_response({"status": "ready", "mode": "local", "model": st.model_name})


async def ready_proxy(request: web.Request) -> web.Response:
    """GET /ready (upstream mode): 200 while an upstream is healthy, else 503."""
    st = request.app[STATE]
    assert st.router is not None
    pool = st.router.describe()
    if not any(u["healthy"] for u in pool):
        raise APIError(503, "no healthy upstream", code="upstream_unavailable", retry_after=2.0)
    return web.json_response({"status": "ready", "mode": "upstream", "upstreams": pool})


async def metrics_route(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text exposition."""
    st = request.app[STATE]
    return web.Response(body=st.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
