"""The one attempt loop of upstream mode, for every forwarded route (chat and completions,
the Anthropic Messages and Gemini relays, a forwarded ``/v1/models``): one request tried on
the upstream routing picks, then the model's other deployments, then the config's fallbacks in
order, each attempt bounded by the upstream's slots and settled in ``end_attempt``.

What one attempt on one upstream does is the dialect's (``attempt(up)``); how it ends tells
the loop what comes next:

* an answer (a ``web.StreamResponse``): the client's;
* ``NextUpstream(status, error)``: the next upstream of the model (502/503/504, 429, 500, an
  invalid answer); ``error`` is the client's answer when none is left (a 429 with the
  ``Retry-After`` of the soonest deployment back), else ``router.exhausted``'s;
* ``NextModel(status, error)``: the next fallback model at once (a 400 "context length
  exceeded"); ``error`` is the client's when the config has none;
* a transport failure (``transport_failure``): the next upstream; an idle timeout (504
  ``upstream_timeout``, the request may still run there) only under a config file, whose
  deployments are declared interchangeable, else it is the answer;
* ``APIError``: the client's answer.

The model's fallbacks come when its deployments are spent, not for a 429 whose deployment is
back within ``SOON_S``, and never for a call whose answer is the model's own
(``Call.falls_back`` False: token ids, vectors — another model's would be wrong, not late). A request ``pinned`` to one upstream (a prefix's pin) tries that one
only: ``PinnedLost`` when it fails before answering. A client gone during an attempt gets 499
and nothing else.

A promise holds across gateways: an upstream's 429 that carries ``PROMISE_HEADER`` (a
prefixgate engine gateway holds a place for the request until then: ``admission_wait``) is the
client's answer at once, its ``Retry-After`` kept, not moved to the next upstream, whose
newcomer would break that promise. The gateway records the pin in the shared state
(``StateBackend.put_promise``: the request's fingerprint, ``request_fingerprint``, to the
upstream's URL, for as long as the promise lives), so the client's retry of the same request,
through any gateway on that state, goes to that upstream first (``UpstreamRouter.pick``'s
``promised``). The pin is dropped once an upstream answers the retry. While the shared state
holds no promise (``StateBackend.may_hold_promises``: on any gateway) a request is neither
fingerprinted nor looked up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.request_account import account
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.redact import auth_error, secrets_of, upstream_error
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import Upstream, UpstreamRouter, retry_after_seconds
from prefixgate.gateway.proxy.usage import admit_call, end_call
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.admission import MAX_RETRY_AFTER_S
from prefixgate.gateway.tenancy.admission_wait import PROMISE_HEADER
from prefixgate.gateway.tenancy.keys import Principal, client_credential

if TYPE_CHECKING:
    from prefixgate.gateway.tenancy.admission import Ticket
    from prefixgate.gateway.tenancy.keys import Principal

logger = logging.getLogger("prefixgate.gateway")

SOON_S = 1.0  # a 429 whose deployment is back within this (seconds) is not worth a fallback
# An upstream's answers that say it is down: out of rotation (``mark_failed``), the next one.
DOWN = frozenset((502, 503, 504))
# Busy or failed once (529: Anthropic's "overloaded"): the next upstream of the model, this
# one staying in rotation; the last such answer is the client's when none is left.
NEXT = frozenset((429, 500, 529))


class NextUpstream(Exception):
    """This upstream's answer sends the request on to the next one (``error``: the client's
    answer when none is left; ``status``: the attempt's outcome for the metrics)."""

    def __init__(self, status: str, error: APIError | None) -> None:
        super().__init__(status)
        self.status = status
        self.error = error


def invalid_answer(router: UpstreamRouter, up: Upstream, problem: str) -> NextUpstream:
    """An upstream's HTTP 200 that is not the answer asked for (``problem``: what it is, "a
    body that is not JSON"): ``up`` marked failed, and the ``NextUpstream`` to raise (a 502
    ``upstream_error`` saying ``problem`` when no upstream is left)."""
    router.mark_failed(up, f"HTTP 200 with {problem}")
    return NextUpstream(
        "invalid", APIError(502, f"the upstream answered {problem}", code="upstream_error")
    )


class NextModel(Exception):
    """This upstream's answer sends the request to the model's next fallback at once (a
    prompt over the context: another model may take it); ``error``: the client's answer when
    the model has no fallback left."""

    def __init__(self, status: str, error: APIError) -> None:
        super().__init__(status)
        self.status = status
        self.error = error


class PinnedLost(Exception):
    """The upstream holding a prefix's pin failed before answering, or no longer has it."""


class Call:
    """One client request through the loop, the set-up every dialect's call shares: the
    aiohttp ``request``, the gateway's state ``st``, the ``router`` and the ``route``
    routing knows (None: a request without a prompt, a forwarded GET), the caller's
    ``principal`` (the route's ``KeyRing.authenticate``); ``account``: the
    request's ``RequestAccount``, where an attempt notes what it served (``served``: whether
    an upstream's tokens reached the client; the usage); ``answered``: the HTTP status the
    current attempt's upstream answered (the attempt's metric when it ends in an error);
    ``falls_back``: whether the model's configured fallbacks may answer it (not where the
    answer is the model's own: token ids, vectors)."""

    falls_back = True

    def __init__(self, request: web.Request, route: Route | None, principal: Principal) -> None:
        self.request = request
        self.principal = principal  # the caller, as the route authenticated it
        self.st: GatewayState = request.app[STATE]
        self.router: UpstreamRouter = request.app[PROXY].router
        self.route = route
        self.account = account(request)  # served, the usage: what the key is charged
        self.answered: int | None = None  # the HTTP status of this attempt's answer, if any
        # an upstream's promised 429 (``refusal``): (its URL, seconds the promise lives)
        self.promise: tuple[str, float] | None = None

    @property
    def served(self) -> bool:
        """Whether an upstream's tokens reached the client (``account.served``)."""
        return self.account.served

    @served.setter
    def served(self, value: bool) -> None:
        if value:
            self.account.mark_served()  # notes when the answer began too
        else:
            self.account.served = False


async def each_upstream(
    call: Call,
    attempt: Callable[[Upstream], Awaitable[web.StreamResponse]],
    pinned: Upstream | None = None,
) -> web.StreamResponse:
    """``attempt`` on the upstream routing picks (the one holding a promise for the request
    first), then the next of the model, then the model's fallbacks; on ``pinned`` only when
    given (module docstring).

    Raises:
        APIError: the last upstream's error, or ``router.exhausted`` when none answered; an
            upstream's promised 429 (its pin recorded in the shared state).
        PinnedLost: ``pinned`` failed before answering.
    """
    shared = call.st.shared
    fingerprint = None  # hashed only when a promise may be held for it, or is made now
    if pinned is None and call.route is not None and shared.may_hold_promises():
        fingerprint = await request_fingerprint(call)
    promised = await shared.promised_upstream(fingerprint) if fingerprint is not None else None
    try:
        out = await _each_upstream(call, attempt, pinned, promised)
    except APIError:
        if pinned is None and call.promise is not None:
            fingerprint = fingerprint or await request_fingerprint(call)
            url, ttl_s = call.promise  # the client's retry goes back there
            if fingerprint is not None:
                await shared.put_promise(fingerprint, url, ttl_s)
        elif fingerprint is not None and promised is not None:
            await shared.drop_promise(fingerprint)  # answered: the promise is void now
        raise
    if fingerprint is not None and promised is not None:
        await shared.drop_promise(fingerprint)  # answered: the promise was claimed
    return out


async def request_fingerprint(call: Call) -> str | None:
    """What recognises a client's retry of one request (``StateBackend.put_promise``'s key):
    the SHA-256 (hex) of its key (``call.principal``; on an open gateway, the credential it
    forwards, ``keys.client_credential``), its method, path and query, and its body, as the
    client sends it again. None for a request without a prompt (``call.route`` None)."""
    if call.route is None:
        return None
    request = call.request
    body = await request.read()  # read already by the route: aiohttp keeps the bytes
    who = call.principal.id
    if who is None:  # an open gateway: the client's credential is the upstream's key
        who = "open:" + client_credential(request)
    digest = hashlib.sha256()
    for part in (who, request.method, request.path_qs):
        digest.update(part.encode("utf-8", "backslashreplace") + b"\0")
    digest.update(body)
    return digest.hexdigest()


async def _each_upstream(
    call: Call,
    attempt: Callable[[Upstream], Awaitable[web.StreamResponse]],
    pinned: Upstream | None,
    promised: str | None,
) -> web.StreamResponse:
    router, route = call.router, call.route
    fallbacks = router.fallbacks(route.model if route is not None and call.falls_back else None)
    # a config's deployments are declared interchangeable: a timeout goes on to the next one
    interchangeable = router.model_list is not None and pinned is None and route is not None
    tried: list[Upstream] = []
    exclude: list[Upstream] = []  # tried for this model
    last: APIError | None = None  # the last 429 / 500 answer, the client's when none is left
    timed_out: APIError | None = None
    while True:
        model = route.model if route is not None else None
        if pinned is not None:
            if tried:
                raise PinnedLost(tried[-1].last_error)
            up: Upstream | None = pinned
        else:
            up = router.pick(route, exclude, promised)
        if up is None and route is not None and fallbacks:
            soon = router.retry_after(model)
            if not (
                last is not None and last.status == 429 and soon is not None and soon <= SOON_S
            ):
                route.model = fallbacks.pop(0)  # every deployment failed: the next model
                exclude = []
                logger.info(
                    "model %s failed (%s): falling back to %s", model, _why(tried), route.model
                )
                continue
        if up is None:
            if last is not None:
                soon = router.retry_after(model)
                if last.status == 429 and soon is not None:
                    last.retry_after = soon
                raise last
            if timed_out is not None:
                raise timed_out
            raise router.exhausted(tried, "every upstream failed", model)
        tried.append(up)
        exclude.append(up)
        up.in_flight += 1
        slot = up.slots.take()
        status = "error"
        call.answered = None
        try:
            out = await attempt(up)
            status = str(out.status)
            return out
        except PinnedLost:
            status = "prefix_lost"  # the pinned upstream no longer holds the prefix
            raise
        except APIError:
            if call.answered is not None:
                status = str(call.answered)  # the upstream's answer, reworded for the client
            raise
        except NextUpstream as nxt:
            status = nxt.status
            if nxt.error is not None:
                last = nxt.error
        except NextModel as nxt:
            if route is None or not fallbacks:
                status = str(nxt.error.status)
                up.served += 1  # its answer goes to the client
                raise nxt.error from None
            status = nxt.status
            route.model = fallbacks.pop(0)  # a model with a longer context, say
            exclude = []
            logger.info("prompt too long for model %s: falling back to %s", model, route.model)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            request = call.request
            if request.transport is None or request.transport.is_closing():
                return web.Response(status=499)  # client gone; nothing to answer
            status, timeout = transport_failure(router, up, exc)
            if timeout is not None:
                timed_out = timeout
                if interchangeable:
                    continue
                raise timed_out from None
        finally:
            end_attempt(call.st, up, slot, status)


def refusal(
    call: Call,
    up: Upstream,
    status: int,
    data: bytes,
    headers: Any,
    fields: Any = None,
    may_move: bool = True,
) -> Exception:
    """What an upstream's non-2xx answer (``status``, body ``data``, ``headers``) does to the
    request, the same for every dialect: the exception to raise.

    - 401/403: ``redact.auth_error`` (about whose credential: the gateway's own when it sent
      one, ``UpstreamRouter.gateway_credential``, else the client's; never the upstream's
      body);
    - ``DOWN``: ``up`` marked failed, ``NextUpstream`` (no error of its own: when none is left
      the client gets ``router.exhausted``, naming the cause);
    - a 429 with ``PROMISE_HEADER`` (``up`` holds a place for the request): the answer,
      its Retry-After and the header kept; ``call.promise`` notes it (``each_upstream``
      records the pin) and the Retry-After rests ``up`` for the other requests;
    - ``NEXT`` (when ``may_move``: not a pinned prefix's upstream): a 429's Retry-After
      rests ``up`` that long, ``NextUpstream`` carrying the reworded answer;
    - anything else: the answer reworded for the client (``redact.upstream_error``, its
      fields renamed by ``fields``, the client's dialect's ``wire.client_fields`` table).
    """
    call.answered = status  # the attempt's metric
    if status in (401, 403):
        return auth_error(status, up.url, call.router.gateway_credential(up) is not None)
    if status in DOWN:
        call.router.mark_failed(up, f"HTTP {status}")
        return NextUpstream(str(status), None)
    secrets = secrets_of(call.st.settings.upstream_api_key, up.auth)
    err = upstream_error(status, data, headers, secrets, fields)
    wait = retry_after_seconds(headers.get("Retry-After"))
    promise_s = _promise_s(headers.get(PROMISE_HEADER)) if status == 429 else None
    if promise_s is not None:
        call.promise = (up.url, promise_s)
        err.headers[PROMISE_HEADER] = str(math.ceil(promise_s * 1000))
        if wait is not None:
            # the promise is this one request's (a budget slot up to 600 s away): the other
            # requests are rested no longer than the longest predicted wait
            call.router.limit(up, min(wait, MAX_RETRY_AFTER_S))
        return err
    if status in NEXT and may_move:
        if status == 429 and wait is not None:
            call.router.limit(up, wait)
        else:
            up.last_error = f"HTTP {status}"
        return NextUpstream(str(status), err)
    return err


def _promise_s(value: str | None) -> float | None:
    """``PROMISE_HEADER``'s milliseconds as seconds; None when absent, not a positive
    finite number, or longer than a day (not a promise this gateway keeps a pin for)."""
    if value is None:
        return None
    try:
        ms = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(ms) or ms <= 0 or ms > 86_400_000:
        return None
    return ms / 1000


def _why(tried: list[Upstream]) -> str:
    return tried[-1].last_error if tried else "no upstream of it can take requests"


def transport_failure(router: Any, up: Upstream, exc: BaseException) -> tuple[str, APIError | None]:
    """Judge a transport error of one attempt on ``up``: an idle timeout is one slow request,
    not a dead server (``suspect``: a health check now decides): ``("timeout", the 504
    upstream_timeout to answer)``; anything else (refused, reset, cut mid-body) is one
    gateway failure of ``up`` (``mark_failed``: only consecutive ones eject it):
    ``("failed", None)``."""
    why = type(exc).__name__ + (f": {exc}" if str(exc) else "")
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
        router.suspect(up, why)
        message = f"the upstream sent nothing for {router.timeout_s:g} s"
        return "timeout", APIError(504, message, code="upstream_timeout")
    router.mark_failed(up, why)
    return "failed", None


def end_attempt(st: GatewayState, up: Upstream, slot: int, status: str) -> None:
    """One attempt on ``up`` is over: its in-flight place and slot given back (``slot`` from
    ``up.slots.take()``), counted by ``status`` in ``prefixgate_upstream_requests_total``."""
    up.in_flight -= 1
    up.slots.give(slot)
    st.metrics.upstream_requests.labels(up.url, status).inc()


async def each_upstream_admitted(
    call: Call,
    principal: Principal,
    est_tokens: int,
    attempt: Callable[[Upstream, Ticket], Awaitable[web.StreamResponse]],
    max_tokens: int | None = None,
) -> web.StreamResponse:
    """``each_upstream`` for a call admitted first (``usage.admit_call``: the key's lease for
    ``est_tokens``, then the admission ``Ticket``, ``max_tokens`` the body's output bound,
    each ``attempt(up, ticket)`` is given); the
    answer's status goes to ``call.account``, and the ticket and the lease end with the call
    however it ends (``usage.end_call``).

    Raises:
        APIError: a 429 of admission, or what ``each_upstream`` raises.
    """
    lease, ticket = await admit_call(call.st, principal, est_tokens, call.account, max_tokens)
    try:
        resp = await each_upstream(call, lambda up: attempt(up, ticket))
        call.account.status = resp.status
        return resp
    finally:
        ticket.done()
        end_call(call.st, principal, lease, call.account)


async def post_count(
    call: Call,
    up: Upstream,
    url: str,
    data: bytes,
    headers: dict[str, str],
    refused: Callable[[aiohttp.ClientResponse], Awaitable[None]],
    unsupported: str | None = None,
) -> Any:
    """POST ``data`` to ``url``, an upstream's token-count route (vLLM's ``/tokenize``,
    Anthropic's ``count_tokens``); its JSON answer (None: not JSON).

    Raises:
        APIError: with ``unsupported`` (the message), 501 ``unsupported_for_model`` when the
            upstream has no such route (404, 405, 501).
        what ``refused(resp)`` raises for another answer than 200.
    """
    session = call.router.session
    assert session is not None
    async with session.post(url, data=data, headers=headers, ssl=up.ssl) as resp:
        if unsupported is not None and resp.status in (404, 405, 501):
            await resp.read()
            raise APIError(501, unsupported, code="unsupported_for_model")
        if resp.status != 200:
            await refused(resp)
        raw = await resp.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
