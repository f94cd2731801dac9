"""Prefix API routes of upstream mode: POST /v1/prefixes, GET and DELETE /v1/prefixes/{id}
(see ``proxy_prefixes``). Same bodies, answers and errors as local mode (``routes_prefixes``)."""

from __future__ import annotations

from aiohttp import web
from prefixgate.gateway.proxy.prefixes import HeadersFor, ProxyPrefixRegistry
from prefixgate.gateway.proxy.routes import upstream_headers
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import effective_salt
from prefixgate.gateway.wire.request_models import PrefixCreateRequest, parse
from prefixgate.gateway.wire.response_models import prefix_object


def _registry(request: web.Request) -> ProxyPrefixRegistry:
    return request.app[PROXY].prefixes


def _headers_for(request: web.Request, st: GatewayState) -> HeadersFor:
    return lambda up: upstream_headers(request, st, up)


async def create_prefix(request: web.Request) -> web.Response:
    """POST /v1/prefixes {model, messages, ttl_seconds, cache_salt?} → the prefix object.

    Errors: 400 bad body or ``ttl_seconds``; 404 unknown model; 429 ``prefix_limit_exceeded``
    (this key's ``max_prefixes``, the gateway's, or the upstream's pinned space); 502/503
    ``upstream_unavailable``.
    """
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    req = parse(PrefixCreateRequest, await request.read())
    spec = principal.spec
    per_key = 0
    if spec is not None:
        per_key = st.settings.key_max_prefixes if spec.max_prefixes is None else spec.max_prefixes
    entry = await _registry(request).create(
        req.model,
        [m.as_dict() for m in req.messages],
        req.ttl_seconds,
        principal.salt,
        effective_salt(principal.salt, req.cache_salt),
        _headers_for(request, st),
        owner=principal.id,
        key_max_prefixes=per_key,
    )
    return web.json_response(prefix_object(entry, entry.model))


async def get_prefix(request: web.Request) -> web.Response:
    """GET /v1/prefixes/{id} → the prefix object; 404 when unknown, expired or another key's."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    entry = await _registry(request).lookup(request.match_info["prefix_id"], principal.salt)
    return web.json_response(prefix_object(entry, entry.model))


async def delete_prefix(request: web.Request) -> web.Response:
    """DELETE /v1/prefixes/{id} (here, on every replica, and its pin on the upstream) →
    ``{id, object: "prefix.deleted", deleted: true}``; 404 as GET."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    entry = await _registry(request).remove(
        request.match_info["prefix_id"], principal.salt, _headers_for(request, st)
    )
    return web.json_response({"id": entry.id, "object": "prefix.deleted", "deleted": True})
