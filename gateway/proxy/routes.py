"""Routes of upstream mode: the OpenAI API forwarded to the upstream pool.

The body is forwarded as received (bytes); answers are verified before they are relayed:
a 200 JSON answer must be a JSON object (an HTML page or garbage with status 200 is a
failed upstream: retried elsewhere, else 502 ``upstream_error``), an SSE stream is relayed
event by event, each checked, and must end with ``[DONE]`` — a stream that ends early,
breaks, stalls past the idle timeout or turns to garbage ends with an in-band error event
(``relay``). A request whose upstream fails before answering (connection refused or reset,
connect timeout, 502/503/504, an invalid 200 body) is retried once on each other healthy
upstream; an idle timeout before the answer (nothing for ``upstream_timeout_s``) is 504
``upstream_timeout`` and not retried (the request may still be running there); once a
stream has started it cannot move. An upstream error whose body is not an OpenAI error
object (an HTML page, a traceback, nothing) is answered with the same status and a generic
OpenAI error. A client that disconnects closes the upstream connection (the
upstream then aborts its request).
"""

from __future__ import annotations

import json
import logging
import re
import time
import zlib
from typing import Any

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.access_log import record
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.proxy.prefixes import ProxyPrefix
from prefixgate.gateway.proxy.relay import json_body_problem, relay_sse
from prefixgate.gateway.proxy.routing import prompt_blocks
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import (
    Route,
    Upstream,
    affinity_key,
    prompt_text,
    salted_affinity_key,
)
from prefixgate.gateway.proxy.usage import Usage, UsageTap, ask_usage, body_usage
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import MAX_SALT_CHARS, effective_salt

logger = logging.getLogger("prefixgate.gateway")

_RETRYABLE = frozenset((502, 503, 504))
_HOP_HEADERS = {"Content-Type": "application/json"}
_PASSED_HEADERS = ("Retry-After", "Content-Encoding")


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
    principal = st.keys.authenticate(request)
    body = await request.read()
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(parsed, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    prefix = None
    if parsed.get("prefix_id") is not None:
        prefix, parsed = await _with_prefix(request, st, parsed, principal.salt)
    if parsed.get("priority") is not None:  # forwarded as is, if the key may set it
        if isinstance(parsed["priority"], bool) or not isinstance(parsed["priority"], int):
            raise bad_request("priority: must be an integer", param="priority")
        principal.request_priority(parsed["priority"])
    request_salt = parsed.get("cache_salt")
    if request_salt is not None and (
        not isinstance(request_salt, str) or not 1 <= len(request_salt) <= MAX_SALT_CHARS
    ):
        raise bad_request(
            f"cache_salt must be a string of 1 to {MAX_SALT_CHARS} characters", param="cache_salt"
        )
    salt = effective_salt(principal.salt, request_salt)
    keep_usage = ask_usage(parsed)
    bodies = _Bodies(parsed, salt)
    router = request.app[PROXY].router
    route = _route(st, router.policy, parsed, salt)  # with a prefix: its messages + the request's
    if router.precise is not None:  # precise routing: the prompt's token ids, as the upstream's
        route = await router.precise.prepare(route, parsed, request.path, salt)
    est_tokens = len(body) // 4 + 1  # no tokenizer here: ~4 bytes per token until the usage
    lease = await st.shared.acquire(principal, est_tokens)
    try:
        ticket = st.admission.admit(est_tokens, tenant=principal.tenant, weight=principal.weight)
    except APIError:
        st.shared.refund(principal, lease)
        raise
    outcome = _Outcome(keep_usage)
    t0 = time.monotonic()
    try:
        if prefix is not None:
            return await _forward_prefix(request, st, prefix, parsed, salt, route, ticket, outcome)
        return await _forward(request, st, bodies, route, ticket, outcome)
    finally:
        ticket.done()
        if router.precise is not None:
            router.precise.release(route)
            _record_prediction(request, route)
        if outcome.served:
            prompt = outcome.prompt_tokens()
            st.shared.settle(
                principal,
                lease,
                est_tokens if prompt is None else prompt,
                outcome.completion_tokens(),
            )
            if prompt is not None:  # the upstream's usage, for the access line
                rec = record(request)
                rec.prompt_tokens, rec.completion_tokens = prompt, outcome.completion_tokens()
        else:
            st.shared.refund(principal, lease)
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
            return await _forward(request, st, _Bodies(full, salt), route, ticket, outcome)
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


def _route(st: GatewayState, policy: str, parsed: dict[str, Any], salt: str | None) -> Route:
    """What the router needs of a request: its rendezvous key (salted) and, for
    ``cache_aware``, its prompt's blocks under its effective cache salt."""
    s = st.settings
    key = salted_affinity_key(
        affinity_key(parsed, s.affinity_block_chars, s.affinity_max_chars), salt
    )
    blocks: list[int] = []
    if policy in ("cache_aware", "precise"):  # precise: for its cache_aware fallback
        blocks = prompt_blocks(
            prompt_text(parsed), salt, s.affinity_block_chars, s.affinity_max_chars
        )
    return Route(key, blocks)


def _record_prediction(request: web.Request, route: Route) -> None:
    """The access line's ``predicted=`` / ``cached=`` of a precise-routed request
    (``precise_routing.PreciseRoute``)."""
    if hasattr(route, "predicted_cached"):
        rec = record(request)
        rec.predicted_cached_tokens = route.predicted_cached
        rec.cached_tokens = getattr(route, "reported_cached", None)


class _Bodies:
    """The forwarded body per upstream: with the effective ``cache_salt`` for upstreams that
    take it; as the client sent it (plus the usage request) for those that do not."""

    __slots__ = ("_parsed", "_salt", "_salted", "_plain")

    def __init__(self, parsed: dict[str, Any], salt: str | None) -> None:
        self._parsed = parsed
        self._salt = salt
        self._salted: bytes | None = None
        self._plain: bytes | None = None

    def for_upstream(self, up: Upstream) -> bytes:
        if up.cache_salt is False or self._salt is None:
            if self._plain is None:
                self._plain = json.dumps(self._parsed).encode()  # \ud800 stays an escape
            return self._plain
        if self._salted is None:
            self._salted = json.dumps({**self._parsed, "cache_salt": self._salt}).encode()
        return self._salted


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
    """GET /v1/models (and /v1/models/{id}) from the least loaded healthy upstream."""
    st = request.app[STATE]
    st.keys.authenticate(request)
    return await _forward(request, st, None, None, None, None)


async def _forward(
    request: web.Request,
    st: GatewayState,
    bodies: _Bodies | None,
    route: Route | None,
    ticket: Any,
    outcome: _Outcome | None,
    pinned: Upstream | None = None,
) -> web.StreamResponse:
    """Forward to the upstream routing picks (the next one on a failure before the answer),
    or only to ``pinned`` (a prefix's upstream: ``_PinnedLost`` when it fails before the
    answer or answers 404 ``prefix_not_found``)."""
    router = request.app[PROXY].router
    session = router.session
    assert session is not None  # opened on the app's startup
    tried: list[Upstream] = []
    while True:
        if pinned is not None:
            if tried:
                raise _PinnedLost(tried[-1].last_error)
            up: Upstream | None = pinned
        else:
            up = router.pick(route, tried)
        if up is None:
            raise router.exhausted(tried, "every upstream failed")
        tried.append(up)
        headers = upstream_headers(request, st, up)
        up.in_flight += 1
        status = "error"
        try:
            if bodies is None:
                ctx = session.get(up.url + request.path_qs, headers=headers)
            else:
                body = bodies.for_upstream(up)
                ctx = session.post(up.url + request.path, data=body, headers=headers)
            async with ctx as resp:
                status = str(resp.status)
                if router.precise is not None:
                    router.precise.started(route)  # the answer began: its prefill is done
                if resp.status in _RETRYABLE:
                    router.mark_failed(up, f"HTTP {resp.status}")
                    continue
                if ticket is not None:
                    ticket.started()
                up.served += 1
                ctype = resp.headers.get("Content-Type", "application/json")
                if ctype.startswith("text/event-stream"):
                    s = st.settings
                    tap = None
                    if outcome is not None and resp.status == 200:
                        outcome.served = True
                        outcome.tap = tap = UsageTap(outcome.keep_usage)
                    tail = bytearray()
                    out = await relay_sse(
                        request, resp, s.keepalive_s, s.upstream_timeout_s, tap=tap, tail=tail
                    )
                    _learn(router, up, route, bytes(tail))
                    return out
                data = await resp.read()
                if pinned is not None and resp.status == 404 and _lost_prefix(data, resp.headers):
                    up.served -= 1
                    status = "prefix_lost"
                    raise _PinnedLost("prefix_not_found")
                if resp.status >= 400 and not _is_openai_error(data, resp.headers):
                    raise _wrapped_error(resp)
                problem = json_body_problem(data, resp.headers) if resp.status < 300 else None
                if problem is not None:  # a failed upstream: not served, nothing learnt
                    up.served -= 1
                    router.mark_failed(up, f"HTTP {resp.status} with {problem}")
                    status = "invalid"
                    continue
                if outcome is not None and resp.status == 200:
                    outcome.served = True
                    if "Content-Encoding" not in resp.headers:
                        outcome.usage = body_usage(data)
                    _learn(router, up, route, data[-4096:])
                out_headers = {"Content-Type": ctype}
                for name in _PASSED_HEADERS:  # a 429's advice; an encoding we did not undo
                    value = resp.headers.get(name)
                    if value is not None:
                        out_headers[name] = value
                return web.Response(body=data, status=resp.status, headers=out_headers)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            if request.transport is None or request.transport.is_closing():
                return web.Response(status=499)  # client gone; nothing to answer
            why = type(exc).__name__ + (f": {exc}" if str(exc) else "")
            if isinstance(exc, TimeoutError) and not isinstance(
                exc, aiohttp.ConnectionTimeoutError
            ):
                # An idle timeout: one slow request, not a dead server (a probe decides).
                router.suspect(up, why)
                status = "timeout"
                raise APIError(
                    504,
                    f"the upstream sent nothing for {router.timeout_s:g} s",
                    code="upstream_timeout",
                    type="timeout_error",
                ) from None
            router.mark_failed(up, why)
            status = "failed"
        finally:
            up.in_flight -= 1
            st.metrics.upstream_requests.labels(up.url, status).inc()


def _is_openai_error(data: bytes, headers: Any) -> bool:
    """True when an upstream's error body is an OpenAI error object (gzip/deflate undone to
    look, the bytes themselves passed on as they came)."""
    if headers.get("Content-Encoding", "identity").lower() in ("gzip", "deflate"):
        try:
            data = zlib.decompress(data, wbits=47)  # 32 + 15: gzip or zlib header
        except zlib.error:
            return False
    try:
        parsed = json.loads(data)
    except ValueError:
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)


def _lost_prefix(data: bytes, headers: Any) -> bool:
    """True when an upstream's 404 body is the error ``prefix_not_found``."""
    if "Content-Encoding" in headers:
        return False
    try:
        err = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("code") == "prefix_not_found"


def _wrapped_error(resp: aiohttp.ClientResponse) -> APIError:
    """An upstream error whose body is not an OpenAI error object (an HTML page, a traceback,
    nothing): the same status, a generic OpenAI error, the upstream's body never shown."""
    retry = resp.headers.get("Retry-After", "")
    return APIError(
        resp.status,
        f"the upstream answered HTTP {resp.status} without an OpenAI error object",
        code="upstream_error",
        retry_after=float(retry) if retry.isdigit() else None,
    )


_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def _learn(router: Any, up: Upstream, route: Route | None, tail: bytes) -> None:
    """Feed the answer's usage (its last ``prompt_tokens`` / ``cached_tokens``) to the
    router's prefix tree (``UpstreamRouter.learn``); nothing when the answer has none."""
    if route is None:
        return
    prompt = _PROMPT_TOKENS.findall(tail)
    cached = _CACHED_TOKENS.findall(tail)
    if prompt and cached:
        router.learn(up, route, int(cached[-1]), int(prompt[-1]))


def upstream_headers(request: web.Request, st: GatewayState, up: Upstream) -> dict[str, str]:
    """Headers towards ``up``: one credential at most — ``--upstream-api-key`` (Bearer), else
    the upstream URL's userinfo (Basic, made once by ``split_credentials``), else the client's
    own ``Authorization`` when the gateway has no keys of its own."""
    if st.settings.upstream_api_key:
        return {**_HOP_HEADERS, "Authorization": "Bearer " + st.settings.upstream_api_key}
    if up.auth is not None:
        return {**_HOP_HEADERS, "Authorization": up.auth}
    auth = request.headers.get("Authorization")
    if auth and st.keys.open:
        return {**_HOP_HEADERS, "Authorization": auth}
    return _HOP_HEADERS


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
