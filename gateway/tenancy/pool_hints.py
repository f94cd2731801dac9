"""The Gateway API Inference Extension's hint headers, read as a request's tenant and
priority on an engine pod whose operator trusts the pool in front of it.

An inference gateway (Envoy + the endpoint picker of an ``InferencePool``) passes two
headers on to the model server it picks:

- ``x-gateway-inference-fairness-id``: the flow the request belongs to for fair sharing;
  read as the engine request's ``tenant`` (the ``fair`` scheduling policy's charge);
- ``x-gateway-inference-objective``: the name of an ``InferenceObjective``; read as the
  engine request's ``priority`` through ``GatewaySettings.objective_priority`` (name →
  engine priority, lower first). An objective not in the map gets the default priority (the
  key's), as the endpoint picker gives an unknown objective its default priority.

A client reaching the pod directly could set both, so they are read only when
``GatewaySettings.trust_pool_headers`` is on (``prefixgate serve --trust-pool-headers``);
otherwise they are ignored. A request's own ``priority`` field (when its key may set one)
still comes before the objective's.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.headers import header_text
from prefixgate.gateway.settings import SETTINGS

FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
MAX_FAIRNESS_ID_CHARS = 256  # a tenant name's bound in the engine's per-tenant state


@dataclass(frozen=True, slots=True)
class PoolHint:
    """What a trusted pool's headers say of one request.

    Attributes:
        tenant: the fairness id (None: no header, the key's tenant stands).
        priority: the objective's engine priority (None: no header or an objective not
            mapped, the default priority stands).
    """

    tenant: str | None
    priority: int | None


def pool_hint(request: web.Request) -> PoolHint | None:
    """The request's pool hint, or None when the headers are not trusted or not sent.

    Raises:
        APIError: 400 ``invalid_header`` naming the header when the fairness id is empty,
            longer than 256 characters, holds a control character or is not UTF-8 (or the
            objective is not UTF-8).
    """
    settings = request.app[SETTINGS]
    if not settings.trust_pool_headers:
        return None
    tenant: str | None = None
    if FAIRNESS_ID_HEADER in request.headers:
        tenant = header_text(request, FAIRNESS_ID_HEADER).strip()
        if (
            not tenant
            or len(tenant) > MAX_FAIRNESS_ID_CHARS
            or any(ord(c) < 0x20 or c == "\x7f" for c in tenant)
        ):
            raise APIError(
                400,
                f"the {FAIRNESS_ID_HEADER} header must be 1 to {MAX_FAIRNESS_ID_CHARS} "
                "characters without control characters",
                param=FAIRNESS_ID_HEADER,
                code="invalid_header",
            )
    objective = header_text(request, OBJECTIVE_HEADER).strip()
    priority = settings.objective_priority.get(objective) if objective else None
    if tenant is None and priority is None:
        return None
    return PoolHint(tenant, priority)
