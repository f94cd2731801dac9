"""The attempt loop of the translating relays (Anthropic's Messages and Gemini's routes): one
request tried on the upstream routing picks, then the model's other deployments, then the
config's fallbacks in order, each attempt bounded by the upstream's slots and settled in
``routes.end_attempt``. An answer that should go to the next upstream raises ``NextUpstream``
(with the client's error, should none be left); a transport failure is judged by
``routes.transport_failure`` (a timeout goes on to the next deployment of a config's model,
deployments declared interchangeable, else it is the answer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.routes import end_attempt, transport_failure
from prefixgate.gateway.proxy.upstream import Upstream
from prefixgate.gateway.state import GatewayState


class NextUpstream(Exception):
    """This upstream's answer sends the request on to the next one (``error``: the client's
    answer when none is left; ``status``: the attempt's outcome for the metrics)."""

    def __init__(self, status: str, error: APIError | None) -> None:
        super().__init__(status)
        self.status = status
        self.error = error


class RelayCall(Protocol):
    """What the loop reads of a relay's call."""

    request: web.Request
    st: GatewayState
    router: Any  # proxy.upstream.UpstreamRouter
    route: Route


async def each_upstream(
    call: RelayCall, attempt: Callable[[Upstream], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """``attempt`` on the upstream routing picks, then the next of the model, then the
    model's fallbacks (module docstring).

    Raises:
        APIError: the last upstream's error, or ``router.exhausted`` when none answered.
    """
    router, route = call.router, call.route
    fallbacks = router.fallbacks(route.model)
    configured = router.model_list is not None  # deployments declared interchangeable
    tried: list[Upstream] = []
    exclude: list[Upstream] = []
    last: APIError | None = None
    timed_out: APIError | None = None
    while True:
        up = router.pick(route, exclude)
        if up is None and fallbacks:
            route.model = fallbacks.pop(0)
            exclude = []
            continue
        if up is None:
            if last is not None:
                soon = router.retry_after(route.model)
                if last.status == 429 and soon is not None:
                    last.retry_after = soon
                raise last
            if timed_out is not None:
                raise timed_out
            raise router.exhausted(tried, "every upstream failed", route.model)
        tried.append(up)
        exclude.append(up)
        up.in_flight += 1
        slot = up.slots.take()
        status = "error"
        try:
            out = await attempt(up)
            status = str(out.status)
            return out
        except NextUpstream as nxt:
            status = nxt.status
            if nxt.error is not None:
                last = nxt.error
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            request = call.request
            if request.transport is None or request.transport.is_closing():
                return web.Response(status=499)  # client gone; nothing to answer
            status, timeout = transport_failure(router, up, exc)
            if timeout is not None:
                timed_out = timeout
                if configured:
                    continue
                raise timed_out from None
        finally:
            end_attempt(call.st, up, slot, status)
