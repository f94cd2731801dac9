"""POST /tokenize, /detokenize (vLLM's) and /v1/embeddings (OpenAI's) in upstream mode: relayed
to an upstream serving the body's model, its answer passed on as it came.

A drop-in proxy in front of vLLM relays them as LiteLLM's proxy and vLLM's router do. Each
request goes through upstream mode's one attempt loop (``routes.forward_as_is``, the chat
route's ``_Forward``): the body's ``model`` picks the upstreams serving it (a config's model
names and aliases, its upstream model ids and credentials), an unhealthy upstream is not
picked, a connection error or a 5xx moves the request to the model's next upstream; a config's
fallback models are never asked (their token ids or vectors would answer for another model).
Routing is by load only: these routes fill no cache, so the cache-aware tree learns nothing of
them. The body is forwarded as sent (the upstream judges its fields, as on chat), with the
upstream's own model id; the cache salt is not added (these routes take none).

As local mode: the key is checked first (401); ``model`` may be left out of a tokenize or
detokenize body (the one model served is meant; 400 naming ``model`` when the gateway serves
several), an embeddings body must name it; a model nobody serves is 404 ``model_not_found``,
after a malformed body's 400 (``wire.token_requests``, local mode's models), as on chat.
``/tokenize`` and ``/detokenize`` are neither admitted nor charged (local mode runs no model for
them); ``/v1/embeddings`` is admitted as a generation is (the key's limits, the gateway's queue)
on an estimate of its input tokens (no tokenizer here: ~4 bytes a token) and charged the input
tokens its answer's ``usage`` reports.

The answer: the upstream's status and JSON body once checked (``answers.answer_model``: a
``count`` and ``tokens``, a ``prompt``, a list of embeddings; garbage or an HTML page is a
502, as on chat); an upstream error reworded as every relay's (``redact.upstream_error``); an
upstream without the route (404 with no error object, 405, 501: a plain OpenAI server has no
``/tokenize``) 501 ``unsupported_for_model`` naming it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.http.request_account import account
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.routes import forward_as_is
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import UpstreamRouter
from prefixgate.gateway.proxy.usage import admit_call, end_call
from prefixgate.gateway.state import STATE
from prefixgate.gateway.wire.request_models import load_json, parse
from prefixgate.gateway.wire.token_requests import (
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from pydantic import BaseModel

_BODIES: dict[str, type[BaseModel]] = {
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/embeddings": EmbeddingRequest,
}


async def relay_tokens(request: web.Request) -> web.StreamResponse:
    """POST /tokenize and /detokenize in upstream mode (module docstring): not admitted, not
    charged, as in local mode.

    Raises:
        APIError: 401, 400 naming a field, 404 ``model_not_found``; the upstream's error;
            501 ``unsupported_for_model``; 502 / 503 when no upstream answered.
    """
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    parsed, route = await _routed(request)
    return await forward_as_is(request, principal, parsed, route)


async def relay_embeddings(request: web.Request) -> web.StreamResponse:
    """POST /v1/embeddings in upstream mode (module docstring): admitted on an estimate of its
    input tokens, charged those its answer reports.

    Raises:
        APIError: as ``relay_tokens``; 429 over the key's limits or the gateway's queue.
    """
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    parsed, route = await _routed(request)
    est_tokens = len(await request.read()) // 4 + 1  # ~4 bytes a token, until the usage
    acct = account(request)
    lease, ticket = await admit_call(st, principal, est_tokens, acct)
    try:
        resp = await forward_as_is(request, principal, parsed, route, ticket, acct)
        acct.status = resp.status
        return resp
    finally:
        ticket.done()
        end_call(st, principal, lease, acct)


async def _routed(request: web.Request) -> tuple[dict[str, Any], Route]:
    """The request's body (a JSON object) and its route: the public model it goes to, no
    affinity (these routes fill no cache).

    Raises:
        APIError: 400 for a body that is no JSON object, a malformed body beside an unknown or
            missing model (its field named first), or several models served and none named;
            404 ``model_not_found``.
    """
    router = request.app[PROXY].router
    body = await request.read()  # bounded already by the ingress guard (http/json_guard.py)
    parsed = load_json(body)
    if not isinstance(parsed, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    kind = _BODIES[request.path]
    name = parsed.get("model")
    if name is None or name == "":
        if kind is EmbeddingRequest:
            parse(kind, body)  # local mode's 400: model is required
        try:
            model = _only_model(router)
        except APIError:  # several served: a malformed body's 400 first, as beside an unknown
            parse(kind, body)
            raise
    elif not isinstance(name, str):
        parse(kind, body)  # local mode's 400 naming model (or the field before it)
        raise bad_request("model: Input should be a valid string", param="model")
    else:
        try:
            model = router.resolve(name)
        except APIError:  # local mode's order: the body's form first, then the model
            parse(kind, body)
            raise
    return parsed, Route(None, [], model)


def _only_model(router: UpstreamRouter) -> str | None:
    """The model a body without one means: the one model the gateway serves (a config's, or
    the one its upstreams list); None while no upstream's models are known (the upstream then
    answers for its own).

    Raises:
        APIError: 400 naming ``model`` when several models are served.
    """
    if router.model_list is not None:
        served = [e.name for e in router.model_list.entries]
    else:
        served = router.served_names()
    if len(served) > 1:
        shown = ", ".join(repr(m) for m in served[:20])
        raise bad_request(
            f"model: required here: this gateway serves several models ({shown}; GET "
            "/v1/models), name the one whose tokenizer to use",
            param="model",
        )
    return served[0] if served else None
