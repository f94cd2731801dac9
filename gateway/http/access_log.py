"""One log line per request, as vLLM's server prints (logger ``prefixgate.access``, level INFO).

    127.0.0.1 "POST /v1/chat/completions" 200 key=team-a prompt=31 completion=16 cached=16 finish=stop ttft=0.041s 0.412s

The key is shown by its *name* from the keys file (``-`` on an open server, ``unnamed`` for a
key without one), never the key itself. A started stream that ended with an in-band error
event instead of its normal ending (the shutdown cut it, the engine failed, the upstream broke)
says so after its status, ``200 error=server_shutting_down``: its 200 was sent before the
fault. Every field is read from the request's ``RequestAccount`` (``http/request_account.py``).
Token counts are those of the request's usage (``-``
for requests that never reached the engine; in proxy mode the upstream's reported usage,
``cached`` as the upstream reported it, or as the routing policy heard it reported when it
predicts it, which adds ``predicted=``, the cached tokens it predicted on the chosen upstream,
beside it). ``finish=`` is the first choice's finish reason in OpenAI's words (``stop``,
``length``, ``tool_calls``, ...; a Messages answer's ``stop_reason`` and a Gemini answer's
``finishReason`` are told so too), ``ttft=`` the seconds from the request parsed to its first
token (proxy mode: the first content chunk of the upstream's stream; a whole JSON answer
has none), each shown when known. A local-mode generation adds its
first token's walk, ``walk=`` then ``name:value`` pairs (milliseconds unless named otherwise):
``admit`` (request parsed to admitted: rate limits, leases, the admission queue),
``to_engine`` (admitted to the engine's arrival), ``wait`` (arrival to first scheduled) and
``steps`` (engine steps run meanwhile), ``step`` (its first step: ``<tokens>tok/<ms>``) and
``chunk`` (its own tokens in it), ``to_token`` (first scheduled to first token sampled),
``deliver`` (sampled to received by the handler: the step thread's hand-over and the event
loop's lag), ``write`` (received to its content written to the client); a part not known is
left out. Probes (``/health``,
``/ready``, ``/metrics``, the ``/dashboard`` page and its polls) are logged at DEBUG only, so a load balancer's checks do not flood
the log; so is any request sent with the ``User-Agent`` :data:`HEALTH_CHECK_USER_AGENT`, which a
prefixgate proxy sends on its health checks of its upstreams (``GET /health``, and the
``GET /v1/models`` it reads every few checks). ``prefixgate serve --no-access-log`` turns the
lines off.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prefixgate.gateway.http.request_account import ACCOUNT, RequestAccount, account

# The dashboard polls /dashboard/data every few seconds: logged as probes too.
PROBES = frozenset(
    {
        "/health",
        "/ready",
        "/metrics",
        "/version",
        "/dashboard",
        "/dashboard/data",
        "/dashboard/dashboard.js",
    }
)

HEALTH_CHECK_USER_AGENT = "prefixgate-health-check"
"""The ``User-Agent`` of a prefixgate proxy's own polls of its upstreams (health checks and
model-list reads; as Envoy's ``Envoy/HC``): an upstream logs them as probes, at DEBUG."""


def is_probe(request: web.BaseRequest) -> bool:
    """Whether ``request`` is a probe, logged at DEBUG: a probe route (:data:`PROBES`), or a
    proxy's health poll (``User-Agent`` :data:`HEALTH_CHECK_USER_AGENT`)."""
    return (
        request.path in PROBES or request.headers.get("User-Agent", "") == HEALTH_CHECK_USER_AGENT
    )


def stream_cut(request: web.Request, code: str | None) -> None:
    """Note that ``request``'s started stream ended with an in-band error event of ``code``
    (``None``: the event had no code; logged as ``error``)."""
    account(request).error = code or "error"


def _shown(value: object) -> str:
    return "-" if value is None else str(value)


def access_line(request: web.BaseRequest, status: int, seconds: float) -> str:
    """The line for one finished request (see the module docstring)."""
    rec = request.get(ACCOUNT) or RequestAccount()
    return (
        f'{request.remote or "-"} "{request.method} {request.path}" {status} '
        + ("" if rec.error is None else f"error={rec.error} ")
        + f"key={_shown(rec.key_name)} prompt={_shown(rec.prompt_tokens)} "
        f"completion={_shown(rec.completion_tokens)} cached={_shown(rec.cached_tokens)} "
        + (
            ""
            if rec.predicted_cached_tokens is None
            else f"predicted={rec.predicted_cached_tokens} "
        )
        + ("" if rec.finish_reason is None else f"finish={rec.finish_reason} ")
        + (
            ""
            if rec.first_token is None or rec.received is None
            else f"ttft={rec.first_token - rec.received:.3f}s "
        )
        + ("" if rec.walk is None else f"walk={rec.walk} ")
        + f"{seconds:.3f}s"
    )


class AccessLogger(AbstractAccessLogger):
    """aiohttp's access-log hook (``AppRunner(access_log_class=AccessLogger)``)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        level = logging.DEBUG if is_probe(request) else logging.INFO
        if self.logger.isEnabledFor(level):
            self.logger.log(level, access_line(request, response.status, time))

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO) or self.logger.isEnabledFor(logging.DEBUG)
