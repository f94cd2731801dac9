"""Gemini's API (``/v1beta``) in upstream mode: translated to the OpenAI dialect the proxy
speaks, relayed, and the answer translated back.

The body is validated by the local dialect's models (``wire.gemini_models``: a field local mode
refuses is a 400 naming it here too) and turned into the same chat (``to_chat``), sent as a
chat completion (``POST /v1/chat/completions``) to the upstream routing picks for its messages
under the key's salt (prefix affinity), with the key's salt as ``cache_salt`` where the
upstream takes it — so a prefixgate upstream keeps tenants apart and reports cached tokens.
``generationConfig`` maps onto the chat's fields (``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``stop``, ``n``, ``seed``, penalties, ``response_format`` ``json_schema`` /
``json_object``), ``functionDeclarations`` and ``toolConfig`` onto ``tools`` and
``tool_choice``. The answer comes back as a ``GenerateContentResponse`` (text and
``functionCall`` parts, ``finishReason``, ``usageMetadata`` from the upstream's ``usage``:
``cachedContentTokenCount`` only when the upstream reports ``cached_tokens``); a stream is
checked event by event (``relay.EventChecker``: JSON chunks, ``[DONE]`` after every choice's
``finish_reason``), with Gemini's keep-alive (an empty line, as local mode's) every
``--keepalive-s`` while the upstream is silent, and a stream cut short (or silent past
``--upstream-timeout-s``, or ended by the upstream's own error event, in
``relay.event_error``'s words) ends with Gemini's ``data: {"error": ...}``, never as a
success; an answer the upstream aborted (``finish_reason: "abort"``) is Gemini's error whole
and streamed, never ``finishReason: OTHER`` (``wire.endings``, as local mode). A
prefixgate upstream's ``x-prefixgate-cache`` header is passed on (``relay.passed_cache_header``). A failure before the answer (connection error, 502/503/504) marks the upstream down
and tries the next; a 429/500 tries the next (``attempts.each_upstream``); other errors reach the client
reworded (``redact.upstream_error``), in Gemini's shape and naming the Gemini fields the
client sent (``wire.client_fields``). ``countTokens`` asks the upstream's ``/tokenize`` (501 where it has none).

``cachedContents`` map onto the proxy's prefix API (``proxy/prefixes.py``): create registers
the cache's messages (on a prefixgate upstream, pinned there through its prefix API), get and
delete are the prefix's, list is the key's own prefixes on this replica, and a
``generateContent`` naming ``cachedContent`` is sent with the cache's messages first, routed
by their text (to the upstream that holds the pin). What the upstream prefix API cannot do is
a 400 ``INVALID_ARGUMENT`` naming it: changing a cache's TTL (the upstream prefix API has no
renewal), ``displayName``, ``tools`` or ``toolConfig`` in a cache.
"""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.access_log import stream_cut
from prefixgate.gateway.http.errors import GEMINI, APIError, bad_request, error_dialect
from prefixgate.gateway.http.request_account import RequestAccount
from prefixgate.gateway.http.sse import SSE_HEADERS, client_gone, client_left, end_stream
from prefixgate.gateway.proxy.answers import shape_problem
from prefixgate.gateway.proxy.attempts import (
    Call,
    each_upstream,
    each_upstream_admitted,
    invalid_answer,
    post_count,
    refusal,
)
from prefixgate.gateway.proxy.messages_openai import token_count
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.prefix_entry import ProxyPrefix
from prefixgate.gateway.proxy.redact import secrets_of
from prefixgate.gateway.proxy.relay import (
    EventChecker,
    StreamBroken,
    event_error,
    mid_stream_error,
    passed_cache_header,
    upstream_reads,
)
from prefixgate.gateway.proxy.routes import (
    model_cards,
    upstream_headers,
    upstream_model_cards,
)
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import Upstream
from prefixgate.gateway.proxy.usage import output_bound
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import Principal, effective_salt
from prefixgate.gateway.wire.client_fields import ClientFields, gemini_fields
from prefixgate.gateway.wire.endings import aborted_error, is_aborted
from prefixgate.gateway.wire.gemini_models import (
    CachedContentCreate,
    Chat,
    CountTokensRequest,
    GenerateContentRequest,
    GenerationConfig,
    cache_life_s,
    cache_messages,
    parse_request,
    refuse_beside_cache,
    refuse_constraint_beside_tools,
    structured,
    to_chat,
    wire_messages,
)
from prefixgate.gateway.wire.gemini_routes import (
    CACHE_PREFIX,
    KEEPALIVE,
    add_gemini_routes,
    cache_miss,
    list_page,
    model_object,
    no_route,  # noqa: F401  (add_gemini_routes reads the handlers off this module)
    refuse_get_of_method,
    require_sse_alt,
    rfc3339,
    split_model_method,
)
from prefixgate.gateway.wire.partial_json import arguments_object
from prefixgate.gateway.wire.response_models import ChatCompletion, ChatCompletionChunk
from prefixgate.gateway.wire.stop_strings import refuse_stop_under_constraint
from prefixgate.gateway.wire.tools import prompt_tools

_DESCRIPTION = "served by prefixgate (proxy)"  # the model object's description

_FINISH = {
    "stop": "STOP",
    "tool_calls": "STOP",
    "function_call": "STOP",
    "length": "MAX_TOKENS",
    "content_filter": "SAFETY",
}


class _Call(Call):
    """One proxied Gemini request: its chat body, route and what was served."""

    def __init__(
        self,
        request: web.Request,
        body: dict[str, Any],
        route: Route,
        public: str,
        fields: ClientFields,
        principal: Principal,
    ):
        super().__init__(request, route, principal)
        self.route: Route = route
        self.body = body
        self.fields = fields  # an upstream's refusal of the chat body, in Gemini's words
        self.public = public

    def data(self, up: Upstream, salt: str | None) -> bytes:
        body = {**self.body, "model": up.upstream_model(self.route.model or self.public)}
        if up.cache_salt is not False and salt is not None:
            body["cache_salt"] = salt
        return json.dumps(body).encode()


def _chat_body(chat: Chat, gc: GenerationConfig | None, stream: bool) -> dict[str, Any]:
    """The OpenAI chat completions body of the chat and its ``generationConfig``."""
    body: dict[str, Any] = {"messages": wire_messages(chat.messages)}
    if chat.tools:
        body["tools"] = chat.tools
    if chat.tool_choice is not None:
        body["tool_choice"] = chat.tool_choice
    if gc is not None:
        for name, field in (
            ("max_tokens", "maxOutputTokens"),
            ("temperature", "temperature"),
            ("top_p", "topP"),
            ("top_k", "topK"),
            ("n", "candidateCount"),
            ("seed", "seed"),
            ("presence_penalty", "presencePenalty"),
            ("frequency_penalty", "frequencyPenalty"),
        ):
            value = getattr(gc, field)
            if value is not None:
                body[name] = value
        if gc.stopSequences:
            body["stop"] = list(gc.stopSequences)
        spec = structured(gc)
        if spec is not None and spec.json is not None:
            schema = spec.json if isinstance(spec.json, dict) else json.loads(spec.json)
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "response", "schema": schema, "strict": True},
            }
        elif spec is not None:
            body["response_format"] = {"type": "json_object"}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _usage_metadata(usage: Any) -> dict[str, int] | None:
    """Gemini's ``usageMetadata`` of an OpenAI ``usage`` (None when it is not one);
    ``cachedContentTokenCount`` only when the upstream reported cached tokens."""
    if not isinstance(usage, dict):
        return None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not (_whole(p) and _whole(c)):
        return None
    assert isinstance(p, int) and isinstance(c, int)
    out = {"promptTokenCount": p, "candidatesTokenCount": c, "totalTokenCount": p + c}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and _whole(cached):
        out["cachedContentTokenCount"] = cached
    return out


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parts(text: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if text or not calls:
        parts.append({"text": text or ""})
    for c in calls:
        fn = c.get("function") or {}
        parts.append(
            {
                "functionCall": {
                    "id": c.get("id") or "",
                    "name": fn.get("name") or "",
                    "args": arguments_object(fn.get("arguments")),
                }
            }
        )
    return parts


def _response(
    candidates: list[dict[str, Any]], usage: dict[str, int] | None, model: str, rid: str
) -> dict[str, Any]:
    out: dict[str, Any] = {"candidates": candidates}
    if usage is not None:
        out["usageMetadata"] = usage
    out["modelVersion"] = model
    out["responseId"] = rid
    return out


def to_gemini(completion: dict[str, Any], model: str, rid: str) -> dict[str, Any]:
    """A ``chat.completion`` as a ``GenerateContentResponse``."""
    candidates = []
    for ch in completion.get("choices") or []:
        msg = ch.get("message") or {}
        candidates.append(
            {
                "content": {
                    "role": "model",
                    "parts": _parts(msg.get("content"), msg.get("tool_calls") or []),
                },
                "finishReason": _FINISH.get(ch.get("finish_reason") or "", "OTHER"),
                "index": ch.get("index", 0),
            }
        )
    return _response(candidates, _usage_metadata(completion.get("usage")), model, rid)


class _Chunks:
    """``chat.completion.chunk`` events → Gemini's stream chunks: text as it comes,
    function calls whole with the last chunk, which carries every candidate's
    ``finishReason`` and the ``usageMetadata``. Each chunk is read into ``account`` (the
    request's: its finish reason, its token times)."""

    def __init__(self, model: str, rid: str, account: RequestAccount) -> None:
        self.account = account
        self.model = model
        self.rid = rid
        self.finish: dict[int, str] = {}
        self.aborted = False  # a choice ended with finish_reason "abort" (wire.endings)
        self.calls: dict[int, dict[int, dict[str, Any]]] = {}
        self.usage: dict[str, Any] | None = None
        self.completion = 0

    def feed(self, events: bytes) -> list[bytes]:
        out: list[bytes] = []
        for event in events.split(b"\n\n"):
            data = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if not data or data[0] == b"[DONE]":
                continue
            obj = json.loads(b"\n".join(data))
            self.account.read_choices(obj.get("choices"), streamed=True)
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            candidates = []
            for ch in obj.get("choices") or []:
                i = ch.get("index", 0)
                delta = ch.get("delta") or {}
                for call in delta.get("tool_calls") or []:
                    slot = self.calls.setdefault(i, {}).setdefault(
                        call.get("index", 0), {"id": "", "function": {"name": "", "arguments": ""}}
                    )
                    fn = call.get("function") or {}
                    slot["id"] = call.get("id") or slot["id"]
                    slot["function"]["name"] = fn.get("name") or slot["function"]["name"]
                    slot["function"]["arguments"] += fn.get("arguments") or ""
                if ch.get("finish_reason"):
                    self.finish[i] = _FINISH.get(ch["finish_reason"], "OTHER")
                    self.aborted = self.aborted or is_aborted(ch["finish_reason"])
                text = delta.get("content")
                if text:
                    self.completion += 1
                    content = {"role": "model", "parts": [{"text": text}]}
                    candidates.append({"content": content, "index": i})
            if candidates:
                out.append(self._event(_response(candidates, None, self.model, self.rid)))
        return out

    def closing(self) -> bytes:
        candidates = []
        for i in sorted(self.finish):
            calls = [self.calls.get(i, {})[k] for k in sorted(self.calls.get(i, {}))]
            parts = _parts(None, calls) if calls else [{"text": ""}]
            candidates.append(
                {
                    "content": {"role": "model", "parts": parts},
                    "finishReason": self.finish[i],
                    "index": i,
                }
            )
        usage = _usage_metadata(self.usage)
        return self._event(_response(candidates, usage, self.model, self.rid))

    @staticmethod
    def _event(obj: dict[str, Any]) -> bytes:
        return (
            b"data: "
            + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
            + b"\n\n"
        )


def _error_event(err: APIError) -> bytes:
    data = json.dumps(err.gemini_body(), separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


# --- the attempts ---------------------------------------------------------------------------
async def _refused(call: _Call, up: Upstream, resp: aiohttp.ClientResponse) -> None:
    """An upstream's non-200 answer: ``attempts.refusal``'s exception; never returns."""
    raise refusal(call, up, resp.status, await resp.read(), resp.headers, call.fields)


async def _generate_try(
    call: _Call, up: Upstream, salt: str | None, stream: bool, ticket: Any
) -> web.StreamResponse:
    session = call.router.session
    assert session is not None
    rid = uuid.uuid4().hex[:24]
    headers = upstream_headers(call.request, call.st, up)
    url = up.url + "/v1/chat/completions"
    async with session.post(url, data=call.data(up, salt), headers=headers, ssl=up.ssl) as resp:
        if resp.status != 200:
            await _refused(call, up, resp)
        ctype = resp.headers.get("Content-Type", "")
        if stream and ctype.startswith("text/event-stream"):
            ticket.started()
            up.served += 1
            call.served = True
            return await _relay(call, up, resp, rid)
        raw = await resp.read()
        try:
            parsed = json.loads(raw)
            problem = (
                "a stream answered as JSON" if stream else shape_problem(parsed, ChatCompletion)
            )
        except (ValueError, UnicodeDecodeError):
            problem = "a body that is not JSON"
        if problem is not None:
            raise invalid_answer(call.router, up, problem)
        ticket.started()
        up.served += 1
        call.served = True
        body = to_gemini(parsed, call.public, rid)
        call.account.read_choices(parsed.get("choices"), streamed=False)
        call.account.read_usage(parsed.get("usage"))  # the usageMetadata's source
        if any(is_aborted(ch.get("finish_reason")) for ch in parsed.get("choices") or []):
            raise aborted_error(upstream=True)  # cut short: no finishReason says so
        return web.json_response(body, headers=passed_cache_header(resp.headers))


async def _relay(
    call: _Call, up: Upstream, resp: aiohttp.ClientResponse, rid: str
) -> web.StreamResponse:
    """The upstream's chunk stream as Gemini's, checked; a cut ends with an error event.
    While the upstream is silent, Gemini's keep-alive (an empty line, as local mode's) goes
    out every ``--keepalive-s``."""
    out = web.StreamResponse(
        status=200, headers={**SSE_HEADERS, **passed_cache_header(resp.headers)}
    )
    await out.prepare(call.request)
    checker = EventChecker(ChatCompletionChunk, require_finish=True)
    chunks = _Chunks(call.public, rid, call.account)
    error: APIError | None = None
    s = call.st.settings
    reads = upstream_reads(resp, s.keepalive_s, s.upstream_timeout_s)
    try:
        while not checker.done:
            data = await anext(reads, b"")
            if data is None:  # silent for keepalive_s
                await out.write(KEEPALIVE)
                continue
            if not data:
                raise StreamBroken("the upstream's stream ended before its last event ([DONE])")
            for event in chunks.feed(checker.feed(data)):
                await out.write(event)
        if checker.errored:
            secrets = secrets_of(s.upstream_api_key, up.auth)
            error = event_error(checker.error_event or {}, secrets, call.fields)
        elif chunks.aborted:
            error = aborted_error(upstream=True)
    except StreamBroken as exc:
        error = APIError(502, str(exc), code=exc.code)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        if client_gone(call.request):  # a write to the client failed: aiohttp's
            return client_left(out)  # ClientConnectionResetError is a ClientConnectionError too
        error = mid_stream_error(exc, s.upstream_timeout_s)
    except ConnectionResetError:
        return client_left(out)
    call.account.estimated_completion_tokens = chunks.completion
    call.account.read_usage(chunks.usage)  # the closing chunk's usageMetadata's source
    if error is None:
        return await end_stream(out, chunks.closing())
    stream_cut(call.request, error.code)
    return await end_stream(out, _error_event(error))


# --- routes ---------------------------------------------------------------------------------
def _public_model(call_model: str, st: GatewayState, router: Any, param: str = "model") -> str:
    """The public model name of ``call_model`` (``models/`` dropped).

    Raises:
        APIError: 404 ``model_not_found`` naming ``param`` when no upstream serves it, in
            local mode's Gemini words ("models/<id> is not found; this server serves
            models/<id>, ..."); the router's 400 for a name it cannot take.
    """
    name = call_model.removeprefix("models/")
    try:
        resolved = router.resolve(name)
    except APIError as exc:
        if exc.status != 404:
            raise
        resolved = None
    if resolved is None:
        served = router.served_names()
        names = ", ".join(f"models/{m}" for m in served[:20])
        if len(served) > 20:
            names += f" and {len(served) - 20} more (GET /v1beta/models)"
        serves = f"; this server serves {names}" if served else ""
        raise APIError(
            404, f"models/{name[:80]} is not found{serves}", param=param, code="model_not_found"
        )
    return name


async def _chat_of(
    request: web.Request, req: GenerateContentRequest, salt: str | None
) -> tuple[Chat, ProxyPrefix | None]:
    refuse_beside_cache(req)
    if not req.cachedContent:
        return to_chat(req), None
    name = req.cachedContent
    if not name.startswith(CACHE_PREFIX):
        raise bad_request(
            f"cachedContent: {name[:80]!r} is not a cachedContents/... name", "cachedContent"
        )
    prefix = await _lookup(request, name.removeprefix(CACHE_PREFIX), salt, "cachedContent")
    chat = to_chat(GenerateContentRequest(contents=req.contents))
    chat.messages = [*prefix.messages, *chat.messages]
    chat.origins = ["cachedContent"] * len(prefix.messages) + chat.origins
    return chat, prefix


async def _lookup(request: web.Request, pid: str, salt: str | None, param: str) -> ProxyPrefix:
    try:
        return await request.app[PROXY].prefixes.lookup(pid, salt)
    except APIError as exc:
        raise cache_miss(exc, param) from None


@error_dialect(GEMINI)
async def model_method(request: web.Request) -> web.StreamResponse:
    """POST /v1beta/models/{model}:{method} in upstream mode (module docstring)."""
    model, method = split_model_method(request)
    if method == "streamGenerateContent":
        require_sse_alt(request)
    st = request.app[STATE]
    router = request.app[PROXY].router
    principal = st.keys.authenticate(request)
    raw = await request.read()
    # local mode's order: the body's form, the path's model, the body's model, then the rest
    if method == "countTokens":
        req = parse_request(CountTokensRequest, raw).request()
        public = _public_model(model, st, router)
        if req.model is not None:  # as local mode: a model nobody serves is a 404
            _public_model(req.model, st, router, "generateContentRequest.model")
            if req.model.removeprefix("models/") != model.removeprefix("models/"):
                raise bad_request(
                    "generateContentRequest.model: the body names another model than the path",
                    param="generateContentRequest.model",
                )
    else:
        req = parse_request(GenerateContentRequest, raw)
        public = _public_model(model, st, router)
        if req.model and req.model.removeprefix("models/") != model.removeprefix("models/"):
            raise bad_request("model: the body names another model than the path", param="model")
    salt = effective_salt(principal.salt, None)
    chat, _ = await _chat_of(request, req, principal.salt)
    gc = req.generationConfig
    if method != "countTokens":  # a count generates nothing: as local mode, no output checks
        constraint = structured(gc)
        refuse_constraint_beside_tools(constraint, chat.tools, chat.tool_choice)
        forced = "toolConfig" if chat.tool_choice not in (None, "auto", "none") else None
        if forced is None and constraint is not None:
            forced = "generationConfig.responseMimeType"
        refuse_stop_under_constraint(
            list(gc.stopSequences or []) if gc else [], "generationConfig.stopSequences", forced
        )
    route = router.route({"messages": chat.messages}, salt, router.resolve(public))
    body = _chat_body(chat, gc, method == "streamGenerateContent")
    fields = gemini_fields(chat.origins, req.tools, gc)
    call = _Call(request, body, route, public, fields, principal)
    if method == "countTokens":
        return await _count(call, chat)
    stream = method == "streamGenerateContent"

    async def attempt(up: Upstream, ticket: Any) -> web.StreamResponse:
        return await _generate_try(call, up, salt, stream, ticket)

    return await each_upstream_admitted(
        call, principal, len(raw) // 4 + 1, attempt, output_bound(body)
    )


async def _count(call: _Call, chat: Chat) -> web.StreamResponse:
    async def attempt(up: Upstream) -> web.StreamResponse:
        body: dict[str, Any] = {
            "model": up.upstream_model(call.route.model or call.public),
            "messages": wire_messages(chat.messages),
            "add_generation_prompt": True,
        }
        tools = prompt_tools(chat.tools, chat.tool_choice)  # as local mode renders them
        if tools:
            body["tools"] = tools
        data = await post_count(
            call,
            up,
            up.url + "/tokenize",
            json.dumps(body).encode(),
            upstream_headers(call.request, call.st, up),
            lambda resp: _refused(call, up, resp),
            f"countTokens is not available for models/{call.public}: its upstream has no "
            "/tokenize to count with",
        )
        return web.json_response({"totalTokens": token_count(data)})

    return await each_upstream(call, attempt)


@error_dialect(GEMINI)
async def list_models(request: web.Request) -> web.Response:
    """GET /v1beta/models: the models the upstreams serve (``_served``)."""
    cards = await _served(request)
    page, more = list_page(sorted(cards), request.query)
    models = [_model_object(name, cards[name]) for name in page]
    return web.json_response({"models": models, **more})


@error_dialect(GEMINI)
async def get_model(request: web.Request) -> web.Response:
    """GET /v1beta/models/{model}; 404 when no upstream serves it (``_served``)."""
    refuse_get_of_method(request)
    st = request.app[STATE]
    router = request.app[PROXY].router
    known = model_cards(router)
    if known is not None:
        st.keys.authenticate(request)
        name = _public_model(request.match_info["target"], st, router)
        if name not in known:  # served by an upstream whose models are not known yet
            raise APIError(
                404, f"models/{name[:80]} is not listed yet", param="model", code="model_not_found"
            )
        return web.json_response(_model_object(name, known[name]))
    # the router resolves any name while it knows no model: ask an upstream
    name = request.match_info["target"].removeprefix("models/")
    cards = await _served(request)
    if name not in cards:
        raise APIError(
            404, f"models/{name[:80]} is not found", param="model", code="model_not_found"
        )
    return web.json_response(_model_object(name, cards[name]))


def _model_object(name: str, card: dict[str, Any]) -> dict[str, Any]:
    """Gemini's ``Model`` of ``name`` with its OpenAI ``card``'s context length
    (``max_model_len``, vLLM's and prefixgate's field) as its token limits when it has one."""
    length = card.get("max_model_len")
    return model_object(name, _DESCRIPTION, length if isinstance(length, int) else None)


async def _served(request: web.Request) -> dict[str, dict[str, Any]]:
    """The models the upstreams serve, their OpenAI cards by name: the ones the gateway knows
    (``model_cards``), else an upstream's own list asked with the client's credential
    (``upstream_model_cards``: every upstream down, or each needing the client's key to list
    its models).

    Raises:
        APIError: 401 (the key), the upstream's refusal (401, 503 no healthy upstream).
    """
    principal = request.app[STATE].keys.authenticate(request)
    cards = model_cards(request.app[PROXY].router)
    if cards is not None:
        return cards
    return await upstream_model_cards(request, principal)


# --- cachedContents on the proxy's prefix API -----------------------------------------------
def _cache_object(entry: ProxyPrefix) -> dict[str, Any]:
    return {
        "name": CACHE_PREFIX + entry.id,
        "model": f"models/{entry.model}",
        "createTime": rfc3339(entry.created_at),
        "updateTime": rfc3339(entry.created_at),
        "expireTime": rfc3339(entry.expires_at),
        "usageMetadata": {"totalTokenCount": entry.prompt_tokens},
    }


def _unimplemented(what: str, param: str) -> APIError:
    """A field the proxy's prefix API cannot honour: a 400 naming it (``INVALID_ARGUMENT``),
    as for any field not implemented; not a 5xx, which clients retry and probes count as the
    server's fault."""
    return APIError(400, f"{what} is not available in proxy mode", param=param, code="unsupported")


@error_dialect(GEMINI)
async def create_cache(request: web.Request) -> web.Response:
    """POST /v1beta/cachedContents: a prefix of the proxy's prefix API."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    req = parse_request(CachedContentCreate, await request.read())
    router = request.app[PROXY].router
    public = _public_model(req.model, st, router)
    for name in ("tools", "toolConfig"):
        if getattr(req, name) is not None:
            raise _unimplemented(
                f"{name} in a cached content (the upstream prefix API keeps messages only)", name
            )
    if req.displayName is not None:
        raise _unimplemented("displayName (the upstream prefix API keeps no label)", "displayName")
    registry = request.app[PROXY].prefixes
    ttl_s = cache_life_s(req, registry.max_ttl_s)
    messages = wire_messages(cache_messages(req))
    spec = principal.spec
    per_key = 0
    if spec is not None:
        per_key = st.settings.key_max_prefixes if spec.max_prefixes is None else spec.max_prefixes
    entry = await registry.create(
        public,
        messages,
        ttl_s,
        principal.salt,
        effective_salt(principal.salt, None),
        lambda up: upstream_headers(request, st, up),
        owner=principal.id,
        key_max_prefixes=per_key,
    )
    return web.json_response(_cache_object(entry))


@error_dialect(GEMINI)
async def get_cache(request: web.Request) -> web.Response:
    """GET /v1beta/cachedContents/{id}: the prefix's cache object; 404 as the prefix API."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    entry = await _lookup(request, request.match_info["cache_id"], principal.salt, "name")
    return web.json_response(_cache_object(entry))


@error_dialect(GEMINI)
async def list_caches(request: web.Request) -> web.Response:
    """GET /v1beta/cachedContents?pageSize=&pageToken=: the key's live prefixes on this
    replica, oldest first (``list_page``)."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    page, more = list_page(request.app[PROXY].prefixes.owned(principal.salt), request.query)
    return web.json_response({"cachedContents": [_cache_object(e) for e in page], **more})


@error_dialect(GEMINI)
async def update_cache(request: web.Request) -> web.Response:
    """PATCH /v1beta/cachedContents/{id}: 400 naming ``ttl`` (the upstream prefix API has no
    renewal); 404 first when the cache is not the key's."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    await _lookup(request, request.match_info["cache_id"], principal.salt, "name")
    raise _unimplemented("changing a cache's ttl (the upstream prefix API has no renewal)", "ttl")


@error_dialect(GEMINI)
async def delete_cache(request: web.Request) -> web.Response:
    """DELETE /v1beta/cachedContents/{id}: the prefix deleted here and on its upstream."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    try:
        await request.app[PROXY].prefixes.remove(
            request.match_info["cache_id"],
            principal.salt,
            lambda up: upstream_headers(request, st, up),
        )
    except APIError as exc:
        raise cache_miss(exc, "name") from None
    return web.json_response({})


def add_routes(app: web.Application, expect_handler: Any) -> None:
    """Gemini's proxy-mode routes on ``app`` (the table both modes share)."""
    add_gemini_routes(app, sys.modules[__name__], expect_handler)
