"""Prefix API routes: POST /v1/prefixes, GET and DELETE /v1/prefixes/{id} (see ``prefixes``)."""

from __future__ import annotations

from aiohttp import web
from prefixgate.gateway.auth import effective_salt
from prefixgate.gateway.prompts import check_length, render_chat
from prefixgate.gateway.schemas import PrefixCreateRequest, parse
from prefixgate.gateway.state import STATE


async def create_prefix(request: web.Request) -> web.Response:
    """POST /v1/prefixes {model, messages, ttl_seconds} → the prefix object (200).

    Errors: 400 bad body or a prefix that fills the context; 404 unknown model; 429 pinned
    space full (``prefix_limit_exceeded``).
    """
    st = request.app[STATE]
    engine = st.require_engine()
    principal = st.keys.authenticate(request)
    req = parse(PrefixCreateRequest, await request.read())
    st.check_model(req.model)
    messages = [m.as_dict() for m in req.messages]
    ids = await render_chat(engine.tokenizer, messages, add_generation_prompt=False)
    check_length(len(ids), None, engine.max_model_len, "messages")
    entry = await st.require_prefixes().create(
        messages,
        ids,
        req.ttl_seconds,
        principal.salt,
        effective_salt(principal.salt, req.cache_salt),
    )
    return web.json_response(entry.public(st.model_name))


async def get_prefix(request: web.Request) -> web.Response:
    """GET /v1/prefixes/{id} → the prefix object; 404 when unknown or expired."""
    st = request.app[STATE]
    prefixes = st.require_prefixes()
    principal = st.keys.authenticate(request)
    entry = prefixes.get(request.match_info["prefix_id"], principal.salt)
    return web.json_response(entry.public(st.model_name))


async def delete_prefix(request: web.Request) -> web.Response:
    """DELETE /v1/prefixes/{id} → ``{id, object: "prefix.deleted", deleted: true}``; 404 as GET."""
    st = request.app[STATE]
    prefixes = st.require_prefixes()
    principal = st.keys.authenticate(request)
    entry = prefixes.delete(request.match_info["prefix_id"], principal.salt)
    return web.json_response({"id": entry.id, "object": "prefix.deleted", "deleted": True})
