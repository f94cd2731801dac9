"""Routes of upstream mode: the OpenAI API forwarded to the upstream pool.

The body is forwarded as received (bytes); answers are verified before they are relayed:
a 200 JSON answer must be a JSON object (an HTML page or garbage with status 200 is a
failed upstream: retried elsewhere, else 502 ``upstream_error``), an SSE stream is relayed
event by event, each checked, and must end with ``[DONE]`` — a stream that ends early,
breaks, stalls past the idle timeout or turns to garbage ends with an in-band error event
(``relay``). A request goes only to upstreams serving its model (``upstream``), through the
one attempt loop of upstream mode (``attempts.each_upstream``: retries on the model's other upstreams,
then a config's fallbacks, health, a timeout's rule), each attempt in the upstream's dialect
(``_Forward``: the OpenAI pass-through, or an Anthropic deployment's translation). A 429 or
500 answer moves the request to the next upstream (the upstream stays in rotation; a 429's
``Retry-After`` keeps it out that long), 502/503/504 and an invalid 200 count as its
failures, and a 400 "context length exceeded" goes to the next fallback at once. An upstream
error is reworded by ``redact.upstream_error`` (a 4xx's message kept, credentials scrubbed; a
5xx in the gateway's words; a body without an error object never shown). A client that
disconnects closes the upstream connection (the upstream then aborts its request).
"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.http.request_account import RequestAccount, account
from prefixgate.gateway.proxy import anthropic
from prefixgate.gateway.proxy.answers import answer_model, renamed
from prefixgate.gateway.proxy.attempts import (
    DOWN,
    NEXT,
    Call,
    NextModel,
    NextUpstream,
    PinnedLost,
    each_upstream,
    refusal,
)
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.prefixes import ProxyPrefix
from prefixgate.gateway.proxy.redact import (
    error_object,
    secrets_of,
    too_long,
    upstream_error,
)
from prefixgate.gateway.proxy.relay import (
    CACHE_HEADER,
    EventChecker,
    json_body_problem,
    relay_sse,
)
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import Upstream, UpstreamRouter
from prefixgate.gateway.proxy.usage import (
    UsageTap,
    admit_call,
    ask_usage,
    body_usage,
    end_call,
    input_usage,
    output_bound,
)
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import Principal, client_credential, effective_salt
from prefixgate.gateway.tenancy.ttft_budget import BUDGET_HEADER
from prefixgate.gateway.wire.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    check_chat_body,
    check_completion_body,
    check_contents,
    gateway_fields,
    load_json,
    parse,
)
from prefixgate.gateway.wire.stop_strings import openai_constraint, refuse_stop_under_constraint

_HOP_HEADERS = {"Content-Type": "application/json"}
# Routes whose answer is relayed as is (``forward_as_is``): no stream, no fallback model (the
# token ids or vectors are the model's own), an upstream without the route a 501.
AS_IS_ROUTES = frozenset(("/tokenize", "/detokenize", "/v1/embeddings"))
# an upstream's answer headers a whole answer passes on (a stream's: ``relay.relay_sse``)
_PASSED_HEADERS = ("Retry-After", "retry-after-ms", CACHE_HEADER)


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
    chat = request.path == "/v1/chat/completions"
    if chat:
        check_contents(parsed.get("messages"))  # as local mode's ChatMessage: the same 400
    # prefix_id / cache_salt: local mode's checks and words; "" is absent (and not forwarded)
    fields, parsed = gateway_fields(parsed, chat)
    model = _resolved(router, parsed, body, chat)  # the body's form, then the model's name
    prefix = None
    if fields.prefix_id is not None:
        prefix, parsed = await _with_prefix(request, st, body, parsed, principal.salt)
    _refuse_stop_under_constraint(parsed, chat)
    if parsed.get("priority") is not None:  # forwarded as is, if the key may set it
        if isinstance(parsed["priority"], bool) or not isinstance(parsed["priority"], int):
            raise bad_request("priority: Input should be a valid integer", param="priority")
        principal.request_priority(parsed["priority"])
    salt = effective_salt(principal.salt, fields.cache_salt)
    keep_usage = ask_usage(parsed)
    bodies = _Bodies(parsed, salt)
    route = router.route(parsed, salt, model)  # with a prefix: its messages + the request's
    route = await router.policy.prepare(route, parsed, request.path, salt)  # the policy's part
    est_tokens = len(body) // 4 + 1  # no tokenizer here: ~4 bytes per token until the usage
    outcome = _Outcome(account(request), keep_usage)
    lease, ticket = await admit_call(
        st, principal, est_tokens, outcome.account, output_bound(parsed)
    )
    try:
        if prefix is not None:
            resp = await _forward_prefix(
                request, st, principal, prefix, parsed, salt, route, ticket, outcome
            )
        else:
            resp = await _forward(request, st, principal, bodies, route, ticket, outcome)
        outcome.account.status = resp.status
        return resp
    finally:
        ticket.done()
        router.policy.release(route)
        _record_prediction(request, router, route)
        end_call(st, principal, lease, outcome.account)


def _refuse_stop_under_constraint(parsed: dict[str, Any], chat: bool) -> None:
    """400 naming ``stop`` beside a whole-output constraint (``stop_strings``), the proxy's
    own refusal, after what local mode names before it: a body refused anyway is named by its
    first defect in local mode's order (the wire model's form, then ``check_chat_body`` /
    ``check_completion_body``), not by ``stop`` where local mode names another field. Only
    the fields local mode's wire model knows are checked: another is the upstream's to judge
    (a served model's body is forwarded with the fields its upstream may take).

    Raises:
        APIError: 400 naming the field.
    """
    stop, constraint = parsed.get("stop"), openai_constraint(parsed)
    if constraint is None or not stop:
        return  # nothing refused here: the body's form is the upstream's to check
    fields = (ChatCompletionRequest if chat else CompletionRequest).model_fields
    known = json.dumps({k: v for k, v in parsed.items() if k in fields}).encode()
    if chat:
        check_chat_body(parse(ChatCompletionRequest, known))
    else:
        check_completion_body(parse(CompletionRequest, known))
    refuse_stop_under_constraint(stop, "stop", constraint)


def _resolved(
    router: UpstreamRouter, parsed: dict[str, Any], body: bytes, chat: bool
) -> str | None:
    """The public model name ``parsed`` routes by (``UpstreamRouter.resolve``), in local
    mode's order: a well-formed body first, then the model's name, then what the body says
    beyond its form (checked after this). A model nobody serves is answered only for a body
    local mode's wire model (``ChatCompletionRequest`` / ``CompletionRequest``) takes: else its
    400 naming the field, as local mode and OpenAI answer a malformed body whatever its model.
    A served model's body is the upstream's to check, unknown fields included.

    Raises:
        APIError: 400 naming a field of a malformed body beside an unknown model; 404
            ``model_not_found``; 400 for a missing model under a config.
    """
    try:
        return router.resolve(parsed.get("model"))
    except APIError:
        parse(ChatCompletionRequest if chat else CompletionRequest, body)
        raise


async def _with_prefix(
    request: web.Request,
    st: GatewayState,
    body: bytes,
    parsed: dict[str, Any],
    owner_salt: str | None,
) -> tuple[ProxyPrefix, dict[str, Any]]:
    """The request's prefix (404 unless it is the key's and live) and the request as if sent
    in full: the prefix's messages, then its own (``prefix_id`` dropped). ``body`` (the
    client's bytes) is checked first as local mode checks it before its lookup: the wire
    model, the model's name, what the body says on its own (``check_chat_body``), so a bad
    body is the same 400 whether or not the prefix is found.

    Raises:
        APIError: 400 naming a bad field; 404 ``model_not_found``, ``prefix_not_found``.
    """
    req = parse(ChatCompletionRequest, body)
    request.app[PROXY].router.resolve(parsed.get("model"))  # local mode's model check
    check_chat_body(req)
    prefix_id = parsed["prefix_id"]  # a string on a chat body (gateway_fields)
    messages = parsed.get("messages") or []  # a list (parsed); absent: the prefix's only
    prefix = await request.app[PROXY].prefixes.lookup(prefix_id, owner_salt)
    full = {k: v for k, v in parsed.items() if k != "prefix_id"}
    full["messages"] = [*prefix.messages, *messages]
    return prefix, full


async def _forward_prefix(
    request: web.Request,
    st: GatewayState,
    principal: Principal,
    prefix: ProxyPrefix,
    full: dict[str, Any],
    salt: str | None,
    route: Route,
    ticket: Any,
    outcome: _Outcome,
) -> web.StreamResponse:
    """A chat on ``prefix``: to the upstream holding its pin with the upstream's prefix id and
    the request's own messages; registered again first when that upstream is down or lost
    the pin (``PinnedLost``); sent in full, routed by its text, when no upstream holds it."""
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
            return await _forward(request, st, principal, bodies, route, ticket, outcome)
        own = full["messages"][len(prefix.messages) :]
        body = {**full, "messages": own, "prefix_id": prefix.upstream_id}
        try:
            return await _forward(
                request, st, principal, _Bodies(body, salt), route, ticket, outcome, pinned=up
            )
        except PinnedLost:
            lost = prefix.upstream_id
    raise APIError(
        502,
        f"prefix {prefix.id}: its upstream lost it again after registering it anew",
        code="upstream_error",
    )


def _for(request: web.Request, st: GatewayState) -> Any:
    return lambda up: upstream_headers(request, st, up)


def _record_prediction(request: web.Request, router: UpstreamRouter, route: Route) -> None:
    """The access line's ``predicted=`` / ``cached=`` of a request whose routing policy
    predicts its cached tokens (``RoutingPolicy.prediction``)."""
    told = router.policy.prediction(route)
    if told is not None:
        acct = account(request)
        acct.predicted_cached_tokens = told[0]
        if acct.cached_tokens is None:  # as the policy heard it reported
            acct.cached_tokens = told[1]


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
    """Where a forwarded call notes what the upstream served: the request's ``account``
    (``served``, the usage) and whether the client asked for a stream's usage chunk."""

    __slots__ = ("account", "keep_usage")

    def __init__(self, acct: RequestAccount, keep_usage: bool) -> None:
        self.account = acct
        self.keep_usage = keep_usage


async def forward_as_is(
    request: web.Request,
    principal: Principal,
    parsed: dict[str, Any],
    route: Route,
    ticket: Any = None,
    acct: RequestAccount | None = None,
) -> web.StreamResponse:
    """A route of ``AS_IS_ROUTES``: its body ``parsed`` to an upstream of ``route.model``
    through the attempt loop (``_Forward``: the upstream's model id, credentials, health, the
    model's other upstreams on a failure, never its fallbacks; no cache salt, which these
    routes do not take), the upstream's answer relayed as it came once checked
    (``answers.answer_model``: 502 when none answered one), the client's model name in it.
    ``ticket`` (admission's) and ``acct`` (where the answer's input tokens are noted, to
    charge the key) for a route that is admitted and charged (embeddings), None else.

    Raises:
        APIError: the upstream's error reworded (``redact.upstream_error``); 501
            ``unsupported_for_model`` when the model's upstreams have no such route
            (``lacks_route``); 502 / 503 when none answered.
    """
    bodies = _Bodies(parsed, None)
    bodies.stream = False
    outcome = _Outcome(acct, False) if acct is not None else None
    st = request.app[STATE]
    return await _forward(request, st, principal, bodies, route, ticket, outcome)


async def proxy_get(request: web.Request) -> web.StreamResponse:
    """GET /v1/models: the union of the upstreams' models (a config's model names and
    aliases); GET /v1/models/{id}: that card, else 404 ``model_not_found``. Forwarded to an
    upstream (the least loaded healthy one) only while no upstream's models are known."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    router = request.app[PROXY].router
    cards = model_cards(router)
    if cards is None:
        return await _forward(request, st, principal, None, None, None, None)
    wanted = request.match_info.get("model")
    if wanted is None:
        return web.json_response({"object": "list", "data": list(cards.values())})
    card = cards.get(wanted)
    if card is None:
        router.resolve(wanted)  # 404 model_not_found when nobody serves it
        raise APIError(404, f"the model {wanted!r} is not listed yet", code="model_not_found")
    return web.json_response(card)


async def upstream_model_cards(
    request: web.Request, principal: Principal
) -> dict[str, dict[str, Any]]:
    """The model cards an upstream lists, by id: ``GET /v1/models`` forwarded as ``proxy_get``
    forwards it while no upstream's models are known (``model_cards`` None: every upstream
    down, or each needing the client's key to list them), with the request's credential,
    whatever the request's own path and query (a Gemini route's ``?key=`` never reaches the
    upstream's URL).

    Raises:
        APIError: the upstream's refusal as the client's (401 about the credential, 503 no
            healthy upstream).
    """
    st = request.app[STATE]
    resp = await _forward(request, st, principal, None, None, None, None, path="/v1/models")
    body = resp.body if isinstance(resp, web.Response) else None
    if resp.status != 200 or not isinstance(body, bytes):  # checked as a ModelList already
        raise APIError(502, "the upstream's model list could not be read", code="upstream_error")
    return {str(card["id"]): card for card in json.loads(body)["data"]}


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
    principal: Principal,
    bodies: _Bodies | None,
    route: Route | None,
    ticket: Any,
    outcome: _Outcome | None,
    pinned: Upstream | None = None,
    path: str | None = None,
) -> web.StreamResponse:
    """Forward through the attempt loop (``attempts.each_upstream``: the upstream routing
    picks, the next one of the model on a failure before the answer, then the model's
    fallbacks), or only to ``pinned`` (a prefix's upstream: ``PinnedLost`` when it fails
    before the answer or answers 404 ``prefix_not_found``); each attempt in its upstream's
    dialect (``_Forward.attempt``). ``path``: the upstream path (and query) asked, when not
    the request's own."""
    call = _Forward(request, principal, bodies, route, ticket, outcome, pinned, path)
    return await each_upstream(call, call.attempt, pinned)


class _Forward(Call):
    """One forwarded request (``attempts.Call``) and its attempt on one upstream: the
    OpenAI pass-through (``openai_try``) or an Anthropic-dialect deployment's translation
    (``anthropic_try``)."""

    def __init__(
        self,
        request: web.Request,
        principal: Principal,
        bodies: _Bodies | None,
        route: Route | None,
        ticket: Any,
        outcome: _Outcome | None,
        pinned: Upstream | None,
        path: str | None = None,
    ) -> None:
        super().__init__(request, route, principal)
        self.path_qs = path or request.path_qs
        self.bodies = bodies
        self.ticket = ticket
        self.outcome = outcome
        self.pinned = pinned
        route_path = self.path_qs.split("?", 1)[0]
        # an answer relayed as is: no stream, no fallback model, nothing learnt for routing
        self.as_is = route_path in AS_IS_ROUTES
        self.falls_back = not self.as_is
        self.stream = bodies is not None and bodies.stream and not self.as_is
        # the model answers must fit
        self.shape = answer_model(route_path, self.stream)

    async def attempt(self, up: Upstream) -> web.StreamResponse:
        if up.dialect == "anthropic":
            if self.as_is:  # no such route on the Messages API: the model's next upstream
                raise NextUpstream("unsupported", self._no_route(None))
            return await self.anthropic_try(up)
        return await self.openai_try(up)

    def _sent_name(self, up: Upstream | None = None) -> str | None:
        """The model name the client sent, where the gateway sends ``up`` (None: an Anthropic
        deployment, which always answers in translation) another id: every answer then says
        the client's name (``answers.renamed``); None when nothing is renamed."""
        if self.bodies is None or self.route is None or self.route.model is None:
            return None
        sent = self.bodies.parsed.get("model")
        if not isinstance(sent, str) or not sent:
            return None
        return sent if up is None or sent != up.upstream_model(self.route.model) else None

    def _secrets(self, up: Upstream) -> tuple[str, ...]:
        return secrets_of(self.st.settings.upstream_api_key, up.auth)

    async def openai_try(self, up: Upstream) -> web.StreamResponse:
        """One try on an OpenAI-compatible upstream: the body forwarded as is (its model and
        salt for ``up``), the answer checked and relayed (module docstring).

        Raises:
            NextUpstream, NextModel, PinnedLost: see ``attempts``.
            APIError: the upstream's error, reworded (``upstream_error``).
        """
        request, router, route, outcome = self.request, self.router, self.route, self.outcome
        session = router.session
        assert session is not None  # opened on the app's startup
        headers = upstream_headers(request, self.st, up)
        if self.bodies is None:
            ctx = session.get(up.url + self.path_qs, headers=headers, ssl=up.ssl)
        else:
            body = self.bodies.for_upstream(up, route.model if route is not None else None)
            ctx = session.post(up.url + request.path, data=body, headers=headers, ssl=up.ssl)
        async with ctx as resp:
            self.answered = resp.status
            router.policy.started(route)  # the answer began: its prefill is done
            if resp.status in DOWN or (resp.status in NEXT and self.pinned is None):
                data = b"" if resp.status in DOWN else await resp.read()
                raise refusal(self, up, resp.status, data, resp.headers)
            if self.ticket is not None:
                self.ticket.started()
            up.served += 1
            ctype = resp.headers.get("Content-Type", "application/json")
            is_sse = ctype.startswith("text/event-stream")
            if resp.status == 200 and is_sse != self.stream and self.shape is not None:
                # SSE to a non-stream request (or JSON to a stream): not its answer
                up.served -= 1
                router.mark_bad_answer(
                    up,
                    "HTTP 200 with an event stream for a non-stream request"
                    if is_sse
                    else f"HTTP 200 with {ctype.split(';')[0]} for a stream request",
                )
                raise NextUpstream("invalid", None)
            if is_sse:
                return await self._relay_stream(up, resp)
            data = await resp.read()
            if resp.status == 400 and route is not None and too_long(data, resp.headers):
                up.served -= 1
                error = upstream_error(resp.status, data, resp.headers, self._secrets(up))
                raise NextModel("too_long", error)
            if self.pinned is not None and resp.status == 404 and _lost_prefix(data, resp.headers):
                up.served -= 1
                raise PinnedLost("prefix_not_found")
            if self.as_is and lacks_route(resp.status, data):  # another of the model may have it
                up.served -= 1
                raise NextUpstream(str(resp.status), self._no_route(resp.status))
            if resp.status >= 400:  # the answer, reworded (401/403: about the credential)
                if resp.status in (401, 403):
                    up.served -= 1
                raise refusal(self, up, resp.status, data, resp.headers, may_move=False)
            problem = (
                json_body_problem(data, resp.headers, self.shape) if resp.status < 300 else None
            )
            if problem is not None:  # a bad answer: not served, nothing learnt
                up.served -= 1
                router.mark_bad_answer(up, f"HTTP {resp.status} with {problem}")
                raise NextUpstream("invalid", None)
            if resp.status < 300:
                router.mark_ok(up)
            if outcome is not None and resp.status == 200:
                outcome.account.mark_served()
                if self.as_is:
                    input_usage(data[-4096:], outcome.account)  # embeddings: input tokens
                else:
                    body_usage(data, outcome.account)
                    _learn(router, up, route, data[-4096:])
            name = self._sent_name(up)
            if name is not None and resp.status == 200:
                data = renamed(data, name)
            return _passed(resp.status, data, resp.headers)

    def _no_route(self, status: int | None) -> APIError:
        """501 for a route relayed as is that the model's upstream does not serve: it answered
        ``status`` (no such route), or it is an Anthropic deployment (None)."""
        model = self.bodies.parsed.get("model") if self.bodies is not None else None
        named = f" for the model {model!r}" if isinstance(model, str) and model else ""
        path = self.request.path
        why = (
            "it is an Anthropic deployment"
            if status is None
            else f"it answered HTTP {status}; vLLM serves it, a plain OpenAI-compatible "
            "server may not"
        )
        return APIError(
            501,
            f"{path} is not available{named}: its upstream has no {path} route ({why})",
            code="unsupported_for_model",
        )

    async def _relay_stream(self, up: Upstream, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """An upstream's event stream relayed event by event, checked (``relay.relay_sse``)."""
        s, outcome, router = self.st.settings, self.outcome, self.router
        tap = None
        if outcome is not None and resp.status == 200:
            outcome.account.mark_served()
            tap = UsageTap(outcome.account, outcome.keep_usage)
        tail = bytearray()
        checker = EventChecker(
            self.shape, require_finish=self.shape is not None, model=self._sent_name(up)
        )
        out = await relay_sse(
            self.request,
            resp,
            s.keepalive_s,
            s.upstream_timeout_s,
            tap=tap,
            tail=tail,
            checker=checker,
            secrets=self._secrets(up),
        )
        if checker.broken is not None:
            router.mark_bad_answer(up, checker.broken)
        elif checker.done:
            router.mark_ok(up)
        _learn(router, up, self.route, bytes(tail))
        return out

    async def anthropic_try(self, up: Upstream) -> web.StreamResponse:
        """One try of a chat on an Anthropic-dialect deployment (``proxy.anthropic``): the
        translated answer; 429, 500, 502/503/504 and 529 overloaded (the client sees a 503,
        OpenAI's word) go to the next upstream.

        Raises:
            NextUpstream: see ``attempts``.
            APIError: 400 for what the deployment cannot take (a route other than chat, a
                field or content part); the upstream's other errors, reworded.
        """
        request, route, bodies, outcome = self.request, self.route, self.bodies, self.outcome
        if bodies is None or route is None or request.path != "/v1/chat/completions":
            raise APIError(
                400,
                f"{request.path} is not served for this model (an Anthropic deployment): "
                "use /v1/chat/completions",
                code="unsupported_for_model",
            )
        session = self.router.session
        assert session is not None
        public = route.model or ""
        answered = self._sent_name() or public  # the name the client sent
        pfx = bodies.prefix
        req = anthropic.to_messages(
            bodies.parsed,
            up.upstream_model(public),
            len(pfx.messages) if pfx is not None else 0,
            pfx.seconds_left() if pfx is not None else 0.0,
        )
        async with session.post(
            up.url + "/v1/messages",
            json=req,
            headers=anthropic.headers_for(upstream_credential(request, self.st, up)),
            ssl=up.ssl,
        ) as resp:
            self.answered = resp.status
            if resp.status != 200:
                data = await resp.read()
                exc = refusal(self, up, resp.status, data, resp.headers)
                error = exc.error if isinstance(exc, NextUpstream) else exc
                if resp.status == 529 and isinstance(error, APIError):
                    error.status = 503  # overloaded: a 503, OpenAI's word
                raise exc
            if self.ticket is not None:
                self.ticket.started()
            up.served += 1
            if outcome is not None:
                outcome.account.mark_served()
            if req.get("stream"):
                translator = anthropic.StreamTranslator(
                    answered,
                    include_usage=outcome.keep_usage if outcome is not None else False,
                    account=outcome.account if outcome is not None else None,
                )
                s = self.st.settings
                out = await anthropic.relay_stream(
                    request, resp, translator, s.upstream_timeout_s, s.keepalive_s
                )
                if outcome is not None and translator.usage is not None:
                    outcome.account.read_usage(translator.usage)
                return out
            try:
                msg = await resp.json(content_type=None)
                completion = anthropic.to_completion(msg, answered)
            except (ValueError, AttributeError, TypeError):
                raise APIError(
                    502, "the Anthropic upstream's answer is not a message", code="upstream_error"
                ) from None
            if outcome is not None:
                outcome.account.read_choices(completion["choices"], streamed=False)
                outcome.account.read_usage(completion["usage"])
            return web.json_response(completion)


def lacks_route(status: int, data: bytes) -> bool:
    """Whether an upstream's error answer says it has no such route (not that it refused the
    request): 405 or 501, or a 404 whose body is no error object about the request — an
    empty or plain-text 404, a framework's ``{"detail": "Not Found"}``, or a prefixgate
    gateway's own ``not_found`` "unknown route". A 404 naming the model (vLLM's
    ``NotFoundError`` for a model it does not serve, either of its error shapes) is the
    request's own."""
    if status in (405, 501):
        return True
    if status != 404:
        return False
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return True
    if not isinstance(body, dict):
        return True
    err = body.get("error")
    if isinstance(err, dict):
        message = err.get("message")
        return err.get("code") == "not_found" and str(message).startswith("unknown route")
    return body.get("object") != "error"  # vLLM's older shape: the error's fields at the top


def _lost_prefix(data: bytes, headers: Any) -> bool:
    """True when an upstream's 404 body is the error ``prefix_not_found`` or
    ``prefix_revoked`` (a prefixgate upstream whose engine revoked the pin for room)."""
    err = error_object(data, headers)
    return err is not None and err.get("code") in ("prefix_not_found", "prefix_revoked")


def _passed(status: int, data: bytes, headers: Any) -> web.Response:
    """An upstream's whole answer as the client's: its body (decoded: the session undid its
    ``Content-Encoding``), content type, ``Retry-After`` and ``x-prefixgate-cache`` (a
    prefixgate upstream's: ``relay.passed_cache_header``'s rule)."""
    out_headers = {"Content-Type": headers.get("Content-Type", "application/json")}
    for name in _PASSED_HEADERS:
        value = headers.get(name)
        if value is not None:
            out_headers[name] = value
    return web.Response(body=data, status=status, headers=out_headers)


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


def upstream_credential(request: web.Request, st: GatewayState, up: Upstream) -> str | None:
    """The ``Authorization`` value the request's attempt at ``up`` carries (None: none): the
    upstream's own (a config's credential, or its URL's userinfo as Basic), else
    ``--upstream-api-key`` as Bearer (not to an Anthropic deployment: it is for the
    OpenAI-compatible upstreams), else — only when the gateway has no keys of its own — the
    client's credential from whichever header or parameter its dialect sends it in
    (``keys.client_credential``: ``Authorization``, ``x-api-key``, ``x-goog-api-key``,
    ``?key=``). Every route's attempt reads it here; ``upstream_headers`` /
    ``anthropic.headers_for`` put it in the upstream's dialect's header (never in a URL)."""
    own = request.app[PROXY].router.gateway_credential(up)
    if own is not None:
        return own
    if st.keys.open:
        return client_credential(request) or None
    return None


def upstream_headers(request: web.Request, st: GatewayState, up: Upstream) -> dict[str, str]:
    """Headers towards an OpenAI-compatible ``up``: one credential at most, as
    ``Authorization`` (``upstream_credential``); and the client's TTFT budget header, which a
    prefixgate upstream enforces."""
    out = dict(_HOP_HEADERS)
    budget = request.headers.get(BUDGET_HEADER)  # a prefixgate upstream refuses by it
    if budget is not None:
        out[BUDGET_HEADER] = budget
    auth = upstream_credential(request, st, up)
    if auth is not None:
        out["Authorization"] = auth
    return out
