"""The start every local-mode API route shares: state, engine, key, parsed body, model."""

from __future__ import annotations

from typing import TypeVar

from aiohttp import web
from prefixgate.engine.protocol import EngineClient
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import Principal
from prefixgate.gateway.wire.request_models import parse
from pydantic import BaseModel

Body = TypeVar("Body", bound=BaseModel)


async def open_call(
    request: web.Request, model: type[Body]
) -> tuple[GatewayState, EngineClient, Principal, Body]:
    """The app's state, its engine, the caller's key and the body parsed as ``model`` (see
    ``request_models.parse``) with its ``model`` field checked, in that order.

    Raises:
        APIError: 503 while the model loads, 401 from the key, 400 from the body, 404 for a
            model this gateway does not serve.
    """
    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    principal = st.keys.authenticate(request)
    req = parse(model, await request.read())
    st.check_model(getattr(req, "model"))  # noqa: B009 - every route body names its model
    return st, engine, principal, req
