"""The state both modes share (settings, keys, admission, metrics, shared state), by app key."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web
from prefixgate.gateway.http.errors import APIError, shown
from prefixgate.gateway.http.metrics import GatewayMetrics
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.admission import AdmissionController
from prefixgate.gateway.tenancy.keys import KeyRing
from prefixgate.gateway.tenancy.shared_state import LocalState, StateBackend


@dataclass(slots=True)
class GatewayState:
    """What both modes share; each mode's own parts are ``local.serving.LocalServing`` and
    ``proxy.serving.ProxyServing`` (app keys ``LOCAL`` and ``PROXY``)."""

    settings: GatewaySettings
    keys: KeyRing
    admission: AdmissionController
    metrics: GatewayMetrics
    model_name: str
    shared: StateBackend = field(default_factory=LocalState)  # limits, leases, prefixes
    ready: bool = False  # local: the engine is attached; upstream: the app is built

    def served_names(self) -> list[str]:
        """The model ids served: ``model_name`` (the one answers name), then the settings'
        ``model_aliases``."""
        return [self.model_name, *self.settings.model_aliases]

    def check_model(self, model: str) -> None:
        """Raises APIError 404 ``model_not_found`` unless ``model`` is a served model id."""
        names = self.served_names()
        if model not in names:
            served = " or ".join(repr(n) for n in names)
            raise APIError(
                404,
                f"the model {shown(model)} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )


STATE: web.AppKey[GatewayState] = web.AppKey("prefixgate_state", GatewayState)
