"""Routes of upstream mode: the OpenAI API forwarded to the upstream pool.

The body is forwarded as received (bytes); answers are verified before they are relayed:
a 200 JSON answer must be a JSON object (an HTML page or garbage with status 200 is a
failed upstream: retried elsewhere, else 502 ``upstream_error``), an SSE stream is relayed
event by event, each checked, and must end with ``[DONE]`` — a stream that ends early,
breaks, stalls past the idle timeout or turns to garbage ends with an in-band error event
(``relay``). A request goes only to upstreams serving its model (``upstream``). One whose
upstream fails before answering (connection refused or reset, connect timeout, 502/503/504,
an invalid 200 body) is retried once on each other healthy upstream of its model; a 429 or
500 answer also moves it to the next one (the upstream stays in rotation; a 429's
``Retry-After`` keeps it out that long), and when none is left the client gets that answer
(a 429 with the ``Retry-After`` of the soonest upstream back). Then, under a config file,
come the model's fallbacks in order — not for a 429 whose upstream is back within
``SOON_S`` — and a 400 "context length exceeded" goes to the next fallback at once. An idle
timeout before the answer (nothing for ``upstream_timeout_s``) is 504 ``upstream_timeout``
and not retried (the request may still be running there), except under a config file, whose
deployments are declared interchangeable: there the next one (then a fallback) takes it.
Once a stream has started it cannot move. An upstream error whose body is not an OpenAI error
object (an HTML page, a traceback, nothing) is answered with the same status and a generic
OpenAI error. A client that disconnects closes the upstream connection (the
upstream then aborts its request).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prefixgate.gateway.api.request_models import load_json
from prefixgate.gateway.api.stop_strings import openai_constraint, refuse_stop_under_constraint
from prefixgate.gateway.http.access_log import record
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.http.headers import header_text
from prefixgate.gateway.http.json_guard import no_body
from prefixgate.gateway.proxy import anthropic
from prefixgate.gateway.proxy.answers import answer_model
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.prefixes import ProxyPrefix
from prefixgate.gateway.proxy.redact import auth_error, reworded_error, secrets_of
from prefixgate.gateway.proxy.relay import EventChecker, json_body_problem, relay_sse
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import Upstream, UpstreamRouter, retry_after_seconds
from prefixgate.gateway.proxy.usage import (
    Usage,
    UsageTap,
    admit_call,
    ask_usage,
    body_usage,
    settle_usage,
)
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import MAX_SALT_CHARS, effective_salt
from prefixgate.gateway.tenancy.ttft_budget import BUDGET_HEADER

logger = logging.getLogger("prefixgate.gateway")

_RETRYABLE = frozenset((502, 503, 504))
# Answers that send the request to the next upstream of its model (then to its fallback
# models), the upstream staying in rotation; the last one is the client's when none is left.
_NEXT_UPSTREAM = frozenset((429, 500))
SOON_S = 1.0  # a 429 whose deployment is back within this (seconds) is not worth a fallback
_HOP_HEADERS = {"Content-Type": "application/json"}
_PASSED_HEADERS = ("Retry-After", "retry-after-ms", "Content-Encoding")


async def proxy_generate(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions in upstream mode.

    Tenancy: the key's cache salt, combined with the request's own ``cache_salt``
    (``auth.effective_salt``), is sent as ``cache_salt`` to upstreams that take it (so keys
    with different salts never share an upstream's cached blocks) and is part of the affinity
    key. Accounting: the key is charged the usage the upstream reports (prompt + completion
    tokens; streams are asked for it, see ``usage``), nothing when the request is refused or
    fails before its first token.
    """
    st = request.app[STATE]
    router = request.app[PROXY].router
    principal = st.keys.authenticate(request)
    body = await request.read()
    parsed = load_json(body)  # bounded already by the ingress guard (http/json_guard.py)
    if not isinstance(parsed, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    refuse_stop_under_constraint(parsed.get("stop"), "stop", openai_constraint(parsed))
    prefix = None
    if parsed.get("prefix_id") is not None:
        prefix, parsed = await _with_prefix(request, st, parsed, principal.salt)
    if parsed.get("priority") is not None:  # forwarded as is, if the key may set it
        if isinstance(parsed["priority"], bool) or not isinstance(parsed["priority"], int):
            raise bad_request("priority: Input should be a valid integer", param="priority")
        principal.request_priority(parsed["priority"])
    request_salt = parsed.get("cache_salt")
    if request_salt is not None and (
        not isinstance(request_salt, str) or not 1 <= len(request_salt) <= MAX_SALT_CHARS
    ):
        raise bad_request(
            f"cache_salt must be a string of 1 to {MAX_SALT_CHARS} characters", param="cache_salt"
        )
    salt = effective_salt(principal.salt, request_salt)
    model = router.resolve(parsed.get("model"))  # 404 model_not_found when nobody serves it
    keep_usage = ask_usage(parsed)
    bodies = _Bodies(parsed, salt)
    route = router.route(parsed, salt, model)  # with a prefix: its messages + the request's
    route = await router.policy.prepare(route, parsed, request.path, salt)  # the policy's part
    est_tokens = len(body) // 4 + 1  # no tokenizer here: ~4 bytes per token until the usage
    lease, ticket = await admit_call(st, principal, est_tokens)
    outcome = _Outcome(keep_usage)
    t0 = time.monotonic()
    try:
        if prefix is not None:
            return await _forward_prefix(request, st, prefix, parsed, salt, route, ticket, outcome)
        return await _forward(request, st, bodies, route, ticket, outcome)
    finally:
        ticket.done()
        router.policy.release(route)
        _record_prediction(request, router, route)
        settle_usage(request, st.shared, principal, lease, est_tokens, outcome)
        st.metrics.e2e.observe(time.monotonic() - t0)


async def _with_prefix(
    request: web.Request, st: GatewayState, parsed: dict[str, Any], owner_salt: str | None
) -> tuple[ProxyPrefix, dict[str, Any]]:
    """The request's prefix (404 unless it is the key's and live) and the request as if sent
    in full: the prefix's messages, then its own (``prefix_id`` dropped)."""
    prefix_id = parsed["prefix_id"]
    if request.path != "/v1/chat/completions":
        raise bad_request("prefix_id is a chat completions field", param="prefix_id")
    if not isinstance(prefix_id, str):
        raise bad_request("prefix_id must be a string", param="prefix_id")
    messages = parsed.get("messages")
    if not isinstance(messages, list):
        raise bad_request("messages must be a list of messages", param="messages")
    prefix = await request.app[PROXY].prefixes.lookup(prefix_id, owner_salt)
    full = {k: v for k, v in parsed.items() if k != "prefix_id"}
    full["messages"] = [*prefix.messages, *messages]
    return prefix, full


async def _forward_prefix(
    request: web.Request,
    st: GatewayState,
    prefix: ProxyPrefix,
    full: dict[str, Any],
    salt: str | None,
    route: Route,
    ticket: Any,
    outcome: _Outcome,
) -> web.StreamResponse:
    """A chat on ``prefix``: to the upstream holding its pin with the upstream's prefix id and
    the request's own messages; registered again first when that upstream is down or lost
    the pin (``_PinnedLost``); sent in full, routed by its text, when no upstream holds it."""
    registry = request.app[PROXY].prefixes
    lost: str | None = None
    for _ in range(3):
        up = registry.holder(prefix)
        if up is None or lost is not None:
            if prefix.upstream is not None or lost is not None:
                await registry.replace(prefix, lost or prefix.upstream_id, _for(request, st))
            up = registry.holder(prefix)
        if up is None:
            bodies = _Bodies(full, salt, prefix)
            return await _forward(request, st, bodies, route, ticket, outcome)
        own = full["messages"][len(prefix.messages) :]
        body = {**full, "messages": own, "prefix_id": prefix.upstream_id}
        try:
            return await _forward(
                request, st, _Bodies(body, salt), route, ticket, outcome, pinned=up
            )
        except _PinnedLost:
            lost = prefix.upstream_id
    raise APIError(
        502,
        f"prefix {prefix.id}: its upstream lost it again after registering it anew",
        code="upstream_error",
    )


def _for(request: web.Request, st: GatewayState) -> Any:
    return lambda up: upstream_headers(request, st, up)


class _PinnedLost(Exception):
    """The upstream holding a prefix's pin failed before answering, or no longer has it."""


def _record_prediction(request: web.Request, router: UpstreamRouter, route: Route) -> None:
    """The access line's ``predicted=`` / ``cached=`` of a request whose routing policy
    predicts its cached tokens (``RoutingPolicy.prediction``)."""
    told = router.policy.prediction(route)
    if told is not None:
        rec = record(request)
        rec.predicted_cached_tokens, rec.cached_tokens = told


class _Bodies:
    """The forwarded body per upstream: with the effective ``cache_salt`` for upstreams that
    take it; as the client sent it (plus the usage request) for those that do not; with the
    upstream's own id of the routed model (a config's alias, name or fallback)."""

    __slots__ = ("_parsed", "_salt", "_made", "prefix", "stream")

    def __init__(
        self, parsed: dict[str, Any], salt: str | None, prefix: ProxyPrefix | None = None
    ) -> None:
        self.stream = parsed.get("stream") is True  # the answer must be SSE, else JSON
        self._parsed = parsed
        self._salt = salt
        self._made: dict[tuple[bool, str | None], bytes] = {}
        self.prefix = prefix  # the registered prefix its messages start with (sent in full)

    @property
    def parsed(self) -> dict[str, Any]:
        """The request body as the client sent it (plus the usage request of a stream)."""
        return self._parsed

    def for_upstream(self, up: Upstream, model: str | None = None) -> bytes:
        salted = up.cache_salt is not False and self._salt is not None
        name = up.upstream_model(model) if model is not None else None  # None: as sent
        made = self._made.get((salted, name))
        if made is None:
            body = self._parsed
            if name is not None and name != body.get("model"):
                body = {**body, "model": name}
            if salted:
                body = {**body, "cache_salt": self._salt}
            made = self._made[(salted, name)] = json.dumps(body).encode()  # \ud800: an escape
        return made


class _Outcome:
    """What the upstream served: whether tokens came (``served``) and their usage."""

    __slots__ = ("served", "usage", "tap", "keep_usage")

    def __init__(self, keep_usage: bool) -> None:
        self.served = False
        self.usage = Usage()
        self.tap: UsageTap | None = None
        self.keep_usage = keep_usage

    def prompt_tokens(self) -> int | None:
        """The reported prompt tokens, None when the upstream reported no usage."""
        usage = self.tap.usage if self.tap is not None else self.usage
        return usage.prompt_tokens

    def completion_tokens(self) -> int:
        if self.tap is not None:
            return self.tap.completion_tokens()
        return self.usage.completion_tokens


async def proxy_get(request: web.Request) -> web.StreamResponse:
    """GET /v1/models: the union of the upstreams' models (a config's model names and
    aliases); GET /v1/models/{id}: that card, else 404 ``model_not_found``. Forwarded to an
    upstream (the least loaded healthy one) only while no upstream's models are known."""
    st = request.app[STATE]
    st.keys.authenticate(request)
    router = request.app[PROXY].router
    cards = model_cards(router)
    if cards is None:
        return await _forward(request, st, None, None, None, None)
    wanted = request.match_info.get("model")
    if wanted is None:
        return web.json_response({"object": "list", "data": list(cards.values())})
    card = cards.get(wanted)
    if card is None:
        router.resolve(wanted)  # 404 model_not_found when nobody serves it
        raise APIError(404, f"the model {wanted!r} is not listed yet", code="model_not_found")
    return web.json_response(card)


def model_cards(router: UpstreamRouter) -> dict[str, dict[str, Any]] | None:
    """The models the gateway serves, by id, as cards (``/v1/models``): each upstream's own
    card, the first upstream's where several serve one; a config's model (or alias) has the
    card of its first deployment's upstream model with its own id (a minimal card while
    that upstream's are unknown). None while no upstream's models are known."""
    if router.model_list is None:
        if all(u.models is None for u in router.upstreams):
            return None
        out: dict[str, dict[str, Any]] = {}
        for u in router.upstreams:
            for mid in list(u.cards) or sorted(u.models or ()):
                out.setdefault(mid, u.cards.get(mid) or _card(mid))
        return out
    out = {}
    aliases = router.model_list.aliases()
    for name in router.model_list.names():
        model = aliases.get(name, name)
        deployments = router.serving(model)
        first = deployments[0] if deployments else None
        card = first.cards.get(first.upstream_model(model)) if first is not None else None
        out[name] = {**card, "id": name} if card else _card(name)
    return out


def _card(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "prefixgate"}


async def _forward(
    request: web.Request,
    st: GatewayState,
    bodies: _Bodies | None,
    route: Route | None,
    ticket: Any,
    outcome: _Outcome | None,
    pinned: Upstream | None = None,
) -> web.StreamResponse:
    """Forward to the upstream routing picks (the next one of the model on a failure before
    the answer, then the model's fallbacks: see the module docstring), or only to ``pinned``
    (a prefix's upstream: ``_PinnedLost`` when it fails before the answer or answers 404
    ``prefix_not_found``)."""
    router = request.app[PROXY].router
    session = router.session
    assert session is not None  # opened on the app's startup
    wants_stream = bodies is not None and bodies.stream
    shape = answer_model(request.path, wants_stream)  # the response model answers must fit
    api_key = st.settings.upstream_api_key
    tried: list[Upstream] = []
    exclude: list[Upstream] = []  # tried for this model
    fallbacks = router.fallbacks(route.model if route is not None else None)
    configured = router.model_list is not None  # deployments declared interchangeable
    last: _Answer | None = None  # the last 429 / 500 answer, the client's when none is left
    timed_out: APIError | None = None
    while True:
        model = route.model if route is not None else None
        if pinned is not None:
            if tried:
                raise _PinnedLost(tried[-1].last_error)
            up: Upstream | None = pinned
        else:
            up = router.pick(route, exclude)
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
                return last.response(router.retry_after(model))
            if timed_out is not None:
                raise timed_out
            raise router.exhausted(tried, "every upstream failed", model)
        tried.append(up)
        exclude.append(up)
        headers = upstream_headers(request, st, up)
        up.in_flight += 1
        slot = up.slots.take()
        status = "error"
        try:
            if up.dialect == "anthropic":
                got = await _forward_anthropic(request, st, up, bodies, route, ticket, outcome)
                status = str(got.status)
                if isinstance(got, _Answer):
                    if got.status in _RETRYABLE:
                        router.mark_failed(up, f"HTTP {got.status}")
                    else:  # 429, 500, 529 overloaded (the client sees a 503: OpenAI's word)
                        last = got if got.status != 529 else _Answer(503, got.data, got.headers)
                        up.last_error = f"HTTP {got.status}"
                        wait = retry_after_seconds(got.headers.get("Retry-After"))
                        if got.status == 429 and wait is not None:
                            router.limit(up, wait)
                    continue
                return got.response
            if bodies is None:
                ctx = session.get(up.url + request.path_qs, headers=headers, ssl=up.ssl)
            else:
                body = bodies.for_upstream(up, route.model if route is not None else None)
                ctx = session.post(up.url + request.path, data=body, headers=headers, ssl=up.ssl)
            async with ctx as resp:
                status = str(resp.status)
                router.policy.started(route)  # the answer began: its prefill is done
                if resp.status in _RETRYABLE:
                    router.mark_failed(up, f"HTTP {resp.status}")
                    continue
                if resp.status in _NEXT_UPSTREAM and pinned is None:
                    last = _Answer(
                        resp.status, await resp.read(), resp.headers, secrets_of(api_key, up.auth)
                    )
                    wait = retry_after_seconds(resp.headers.get("Retry-After"))
                    if resp.status == 429 and wait is not None:
                        router.limit(up, wait)
                    else:
                        up.last_error = f"HTTP {resp.status}"
                    continue
                if ticket is not None:
                    ticket.started()
                up.served += 1
                ctype = resp.headers.get("Content-Type", "application/json")
                is_sse = ctype.startswith("text/event-stream")
                if resp.status == 200 and is_sse != wants_stream and shape is not None:
                    # SSE to a non-stream request (or JSON to a stream): not its answer
                    up.served -= 1
                    router.mark_bad_answer(
                        up,
                        "HTTP 200 with an event stream for a non-stream request"
                        if is_sse
                        else f"HTTP 200 with {ctype.split(';')[0]} for a stream request",
                    )
                    status = "invalid"
                    continue
                if is_sse:
                    s = st.settings
                    tap = None
                    if outcome is not None and resp.status == 200:
                        outcome.served = True
                        outcome.tap = tap = UsageTap(outcome.keep_usage)
                    tail = bytearray()
                    checker = EventChecker(shape, require_finish=shape is not None)
                    out = await relay_sse(
                        request,
                        resp,
                        s.keepalive_s,
                        s.upstream_timeout_s,
                        tap=tap,
                        tail=tail,
                        checker=checker,
                        secrets=secrets_of(api_key, up.auth),
                    )
                    if checker.broken is not None:
                        router.mark_bad_answer(up, checker.broken)
                    elif checker.done:
                        router.mark_ok(up)
                    _learn(router, up, route, bytes(tail))
                    return out
                data = await resp.read()
                if resp.status == 400 and fallbacks and route and _too_long(data, resp.headers):
                    up.served -= 1
                    status = "too_long"
                    route.model = fallbacks.pop(0)  # a model with a longer context, say
                    exclude = []
                    logger.info(
                        "prompt too long for model %s: falling back to %s", model, route.model
                    )
                    continue
                if pinned is not None and resp.status == 404 and _lost_prefix(data, resp.headers):
                    up.served -= 1
                    status = "prefix_lost"
                    raise _PinnedLost("prefix_not_found")
                if resp.status in (401, 403):  # about the credential sent: never its body
                    up.served -= 1
                    raise auth_error(resp.status, up.url, bool(api_key or up.auth))
                if resp.status >= 400:
                    raise _upstream_error(
                        resp.status, data, resp.headers, secrets_of(api_key, up.auth)
                    )
                problem = (
                    json_body_problem(data, resp.headers, shape) if resp.status < 300 else None
                )
                if problem is not None:  # a bad answer: not served, nothing learnt
                    up.served -= 1
                    router.mark_bad_answer(up, f"HTTP {resp.status} with {problem}")
                    status = "invalid"
                    continue
                if resp.status < 300:
                    router.mark_ok(up)
                if outcome is not None and resp.status == 200:
                    outcome.served = True
                    if "Content-Encoding" not in resp.headers:
                        outcome.usage = body_usage(data)
                    _learn(router, up, route, data[-4096:])
                return _Answer(resp.status, data, resp.headers).response()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            if request.transport is None or request.transport.is_closing():
                return web.Response(status=499)  # client gone; nothing to answer
            status, timeout = transport_failure(router, up, exc)
            if timeout is not None:
                timed_out = timeout
                if configured and pinned is None and route is not None:
                    continue  # a config's deployments are interchangeable: the next one
                raise timed_out from None
        finally:
            end_attempt(st, up, slot, status)


def transport_failure(
    router: UpstreamRouter, up: Upstream, exc: BaseException
) -> tuple[str, APIError | None]:
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


class _Served:
    """An answer that went to the client (``response``), with its HTTP ``status``."""

    __slots__ = ("status", "response")

    def __init__(self, status: str, response: web.StreamResponse) -> None:
        self.status = status
        self.response = response


async def _forward_anthropic(
    request: web.Request,
    st: GatewayState,
    up: Upstream,
    bodies: _Bodies | None,
    route: Route | None,
    ticket: Any,
    outcome: _Outcome | None,
) -> _Served | _Answer:
    """One try of a chat on an Anthropic-dialect deployment (``proxy.anthropic``): the
    translated answer sent to the client (``_Served``), or an answer worth the next upstream
    (429, 500, 502/503/504, 529 overloaded: an ``_Answer`` holding an OpenAI error object).

    Raises:
        APIError: 400 for what the deployment cannot take (a route other than chat, a field
            or content part); the upstream's other errors, mapped (``anthropic.error_of``).
    """
    if bodies is None or route is None or request.path != "/v1/chat/completions":
        raise APIError(
            400,
            f"{request.path} is not served for this model (an Anthropic deployment): "
            "use /v1/chat/completions",
            code="unsupported_for_model",
        )
    session = request.app[PROXY].router.session
    assert session is not None
    public = route.model or ""
    parsed = bodies.parsed
    pfx = bodies.prefix
    req = anthropic.to_messages(
        parsed,
        up.upstream_model(public),
        len(pfx.messages) if pfx is not None else 0,
        pfx.seconds_left() if pfx is not None else 0.0,
    )
    async with session.post(
        up.url + "/v1/messages", json=req, headers=anthropic.headers_for(up.auth), ssl=up.ssl
    ) as resp:
        if resp.status != 200:
            data = await resp.read()
            err = anthropic.error_of(resp.status, data)
            if resp.status in (429, 500, 502, 503, 504, 529):
                headers = {"Content-Type": "application/json"}
                for name in ("Retry-After", "retry-after-ms"):
                    if name in resp.headers:
                        headers[name] = resp.headers[name]
                return _Answer(resp.status, json.dumps(err.body()).encode(), headers)
            raise err
        if ticket is not None:
            ticket.started()
        up.served += 1
        if outcome is not None:
            outcome.served = True
        if req.get("stream"):
            translator = anthropic.StreamTranslator(
                public, include_usage=outcome.keep_usage if outcome is not None else False
            )
            out = await anthropic.relay_stream(
                request, resp, translator, st.settings.upstream_timeout_s
            )
            if outcome is not None and translator.usage is not None:
                outcome.usage.read(translator.usage)
            return _Served("200", out)
        try:
            msg = await resp.json(content_type=None)
            completion = anthropic.to_completion(msg, public)
        except (ValueError, AttributeError, TypeError):
            raise APIError(
                502, "the Anthropic upstream's answer is not a message", code="upstream_error"
            ) from None
        if outcome is not None:
            outcome.usage.read(completion["usage"])
        return _Served("200", web.json_response(completion))


def _too_long(data: bytes, headers: Any) -> bool:
    """True when an upstream's 400 body says the prompt exceeds the model's context
    (OpenAI's code ``context_length_exceeded``, or vLLM's / SGLang's "maximum context
    length" message)."""
    err = _error_object(data, headers)
    if err is None:
        return False
    message = err.get("message")
    return err.get("code") == "context_length_exceeded" or (
        isinstance(message, str) and "maximum context length" in message
    )


def _why(tried: list[Upstream]) -> str:
    return tried[-1].last_error if tried else "no upstream of it can take requests"


def _lost_prefix(data: bytes, headers: Any) -> bool:
    """True when an upstream's 404 body is the error ``prefix_not_found`` or
    ``prefix_revoked`` (a prefixgate upstream whose engine revoked the pin for room)."""
    err = _error_object(data, headers)
    return err is not None and err.get("code") in ("prefix_not_found", "prefix_revoked")


def _error_object(data: bytes, headers: Any) -> dict[str, Any] | None:
    """The ``error`` object of an upstream's JSON error body; None when the body is encoded
    (``Content-Encoding``), not JSON, or holds no error object."""
    if "Content-Encoding" in headers:
        return None
    try:
        err = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


class _Answer:
    """An upstream's whole (non-stream) answer: ``status``, body bytes, headers."""

    __slots__ = ("status", "data", "headers", "secrets")

    def __init__(
        self, status: int, data: bytes, headers: Any, secrets: tuple[str, ...] = ()
    ) -> None:
        self.status = status
        self.data = data
        self.headers = headers
        self.secrets = secrets  # the credentials scrubbed from an error body (redact)

    def response(self, retry_after: float | None = None) -> web.Response:
        """The client's response: the body as it came (an error without an OpenAI error
        object wrapped in one), its content type, ``Retry-After`` and encoding; with
        ``retry_after`` (seconds until one of the model's upstreams is out of its 429) as
        ``Retry-After`` instead of the upstream's own.

        Raises:
            APIError: the wrapped error.
        """
        headers = CIMultiDict(self.headers)
        if retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        if self.status >= 400:
            raise _upstream_error(self.status, self.data, headers, self.secrets)
        out_headers = {"Content-Type": headers.get("Content-Type", "application/json")}
        for name in _PASSED_HEADERS:  # a 429's advice; an encoding we did not undo
            value = headers.get(name)
            if value is not None:
                out_headers[name] = value
        return web.Response(body=self.data, status=self.status, headers=out_headers)


def _upstream_error(status: int, data: bytes, headers: Any, secrets: tuple[str, ...]) -> APIError:
    """The client's error for an upstream's error answer (``status`` >= 400, body ``data``):
    reworded from its error object's four fields with ``secrets`` scrubbed, with the
    upstream's ``Retry-After``; a body without an error object is wrapped (never shown)."""
    error = reworded_error(data, headers.get("Content-Encoding", "identity"), secrets)
    if error is None:
        return _wrapped_error(status, headers)
    e = error["error"]
    return APIError(
        status,
        e["message"],
        param=e["param"],
        code=e["code"],
        type=e["type"],
        retry_after=_retry_after(headers),
    )


def _wrapped_error(status: int, headers: Any) -> APIError:
    """An upstream error whose body is not an OpenAI error object (an HTML page, a traceback,
    nothing): the same status, a generic OpenAI error, the upstream's body never shown."""
    return APIError(
        status,
        f"the upstream answered HTTP {status} without an OpenAI error object",
        code="upstream_error",
        retry_after=_retry_after(headers),
    )


def _retry_after(headers: Any) -> float | None:
    """The upstream's wait in seconds: its ``retry-after-ms`` (the finer one) when a whole
    number, else its ``Retry-After`` when a whole number, else None."""
    ms = headers.get("retry-after-ms", "")
    if ms.isdigit():
        return int(ms) / 1000.0
    retry = headers.get("Retry-After", "")
    return float(retry) if retry.isdigit() else None


_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def _learn(router: Any, up: Upstream, route: Route | None, tail: bytes) -> None:
    """Feed the answer's usage (its last ``prompt_tokens`` / ``cached_tokens``) to the
    router's prefix tree (``UpstreamRouter.learn``); nothing when the answer has none. Notes
    on ``up`` whether an answer with usage counted cached tokens (``/ready``)."""
    prompt = _PROMPT_TOKENS.findall(tail)
    cached = _CACHED_TOKENS.findall(tail)
    if prompt:  # an answer with usage: does it count cached tokens (null / absent: no)?
        up.cached_tokens_reported = bool(cached)
    if route is None:
        return
    if prompt and cached:
        router.learn(up, route, int(cached[-1]), int(prompt[-1]))


def upstream_headers(request: web.Request, st: GatewayState, up: Upstream) -> dict[str, str]:
    """Headers towards ``up``: one credential at most — its own (a config's credential, or
    its URL's userinfo as Basic, made once by ``split_credentials``), else
    ``--upstream-api-key`` (Bearer), else the client's own ``Authorization`` when the gateway
    has no keys of its own; and the client's TTFT budget header, which a prefixgate upstream
    enforces."""
    out = dict(_HOP_HEADERS)
    budget = request.headers.get(BUDGET_HEADER)  # a prefixgate upstream refuses by it
    if budget is not None:
        out[BUDGET_HEADER] = budget
    if up.auth is not None:
        out["Authorization"] = up.auth
    elif st.settings.upstream_api_key:
        out["Authorization"] = "Bearer " + st.settings.upstream_api_key
    else:
        auth = header_text(request, "Authorization")
        if auth and st.keys.open:
            out["Authorization"] = auth
    return out


@no_body
async def local_mode_only(request: web.Request) -> web.Response:
    """An API route of local mode only, in upstream mode (``/v1/responses``, ``/v1/embeddings``,
    ``/tokenize``, ``/detokenize``): 501 naming it (the proxy relays chat, completions, models
    and prefixes only), never a bare "unknown route".

    Raises:
        APIError: always, 501 ``unsupported_in_upstream_mode``.
    """
    instead = {
        "/v1/responses": "; use /v1/chat/completions",
        "/tokenize": "; the upstream's own /tokenize answers it",
        "/detokenize": "; the upstream's own /detokenize answers it",
        "/v1/embeddings": "; send embeddings to the upstream serving them",
    }.get(request.path, "")
    raise APIError(
        501,
        f"{request.path} is not available in upstream mode{instead}",
        code="unsupported_in_upstream_mode",
        type="invalid_request_error",
    )
