"""Prefix API routes: POST /v1/prefixes, GET and DELETE /v1/prefixes/{id} (see ``prefixes``)."""

from __future__ import annotations

from aiohttp import web
from prefixgate.gateway.local.prefixes import PrefixQuota
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.keys import KeySpec, effective_salt
from prefixgate.gateway.wire.prompts import check_length, render_chat
from prefixgate.gateway.wire.request_models import PrefixCreateRequest, parse
from prefixgate.gateway.wire.response_models import prefix_object


async def create_prefix(request: web.Request) -> web.Response:
    """POST /v1/prefixes {model, messages, ttl_seconds} → the prefix object (200).

    Errors: 400 bad body or a prefix that fills the context; 404 unknown model; 429 pinned
    space full (``prefix_limit_exceeded``).
    """
    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    principal = st.keys.authenticate(request)
    req = parse(PrefixCreateRequest, await request.read())
    st.check_model(req.model)
    messages = [m.as_dict() for m in req.messages]
    ids = await render_chat(
        engine.tokenizer, messages, add_generation_prompt=False, max_model_len=engine.max_model_len
    )
    check_length(len(ids), None, engine.max_model_len, "messages")
    entry = (
        await request.app[LOCAL]
        .require_prefixes()
        .create(
            messages,
            ids,
            req.ttl_seconds,
            principal.salt,
            effective_salt(principal.salt, req.cache_salt),
            owner=principal.id,
            quota=prefix_quota(
                principal.spec, st.settings, engine.stats().get("kv_blocks_total", 0)
            ),
            tenant=principal.tenant,
        )
    )
    return web.json_response(prefix_object(entry, st.model_name))


def prefix_quota(
    spec: KeySpec | None, settings: GatewaySettings, total_blocks: int
) -> PrefixQuota | None:
    """A key's share of the prefix API: its keys-file fields, else the gateway's defaults
    (``key_max_prefixes``; ``key_max_pinned_fraction`` of the engine's ``total_blocks``, at
    least 1 block). None for the open gateway's anonymous caller (one tenant: the global
    bounds apply)."""
    if spec is None:
        return None
    n = settings.key_max_prefixes if spec.max_prefixes is None else spec.max_prefixes
    if spec.max_pinned_blocks is not None:
        blocks = spec.max_pinned_blocks
    elif settings.key_max_pinned_fraction >= 1.0:
        blocks = 0
    else:
        blocks = max(1, int(settings.key_max_pinned_fraction * total_blocks))
    return PrefixQuota(n, blocks)


async def get_prefix(request: web.Request) -> web.Response:
    """GET /v1/prefixes/{id} → the prefix object; 404 when unknown or expired."""
    st = request.app[STATE]
    prefixes = request.app[LOCAL].require_prefixes()
    principal = st.keys.authenticate(request)
    entry = await prefixes.lookup(request.match_info["prefix_id"], principal.salt)
    return web.json_response(prefix_object(entry, st.model_name))


async def delete_prefix(request: web.Request) -> web.Response:
    """DELETE /v1/prefixes/{id} → ``{id, object: "prefix.deleted", deleted: true}``; 404 as GET."""
    st = request.app[STATE]
    prefixes = request.app[LOCAL].require_prefixes()
    principal = st.keys.authenticate(request)
    entry = await prefixes.remove(request.match_info["prefix_id"], principal.salt)
    return web.json_response({"id": entry.id, "object": "prefix.deleted", "deleted": True})
