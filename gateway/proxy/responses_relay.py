"""POST /v1/responses in upstream mode: OpenAI's Responses API relayed as a chat completion.

The body is validated by local mode's own wire model (``wire.responses_models.parse_request``:
the same fields accepted, the same ones refused by name with the same 400 words, in both
modes) and translated to the chat the local route renders (``chat_body``): ``instructions``
→ a system message first, ``input`` → the turns (a string: one user message; message items:
their role, text parts joined, as local mode joins them), ``max_output_tokens`` →
``max_tokens``, ``temperature``, ``top_p``, ``user``, ``text.format`` → ``response_format``
(``json_object``, or ``json_schema`` with its ``name``, ``schema``, ``strict``,
``description``), ``stream`` → ``stream`` with ``stream_options.include_usage``. It is sent
as ``POST /v1/chat/completions`` through the proxy's one attempt loop
(``attempts.each_upstream_admitted``: admission, the key's limits, routing by the
conversation under the key's salt, the model's other upstreams, fallbacks, health, the
upstream's credential, the access log), with the effective salt as ``cache_salt`` where the
upstream takes it.

Prompt caching is mapped as the chat route relays chat's controls (forwarded for the upstream
to apply: a prefixgate upstream pins them, another OpenAI-compatible one reads or ignores
them as it does on chat): ``prompt_cache_key``, ``prompt_cache_retention``,
``prompt_cache_options.mode``, and each ``input_text`` part's ``prompt_cache_breakpoint`` /
``cache_control`` as a chat text part carrying it (checked first as local mode checks them,
``wire.cache_breakpoints.openai_breakpoints``: the same 400s). Chat's
``prompt_cache_options.ttl`` is ``30m`` only: a ``12h`` one becomes the ``ttl`` of every part
breakpoint that has none (mode ``explicit``, or ``implicit`` beside
``prompt_cache_retention: "24h"``, whose 24 h end mark outlives it); the implicit end mark of
12 h alone has no chat spelling and is a 400 naming ``prompt_cache_options.ttl``, as is
``prompt_cache_options.comparison_response_id`` (the diagnostics need the prompt log of the
engine that answered the earlier response, which a proxy does not have). The upstream's
``x-prefixgate-cache`` header is passed on (``relay.passed_cache_header``), its marks named
as the client sent them (``input_words``: ``input.0.content.1``, not the chat's
``messages.1.content.1``).

The answer comes back as local mode writes it (``wire.responses_models.ResponseEvents``): a
``response`` object under the model name the client sent, or for a stream the typed events
(``response.created`` … ``response.completed``, or ``response.incomplete`` when cut by
``length`` / ``content_filter``), written as the upstream's chunks come (each checked:
``relay.EventChecker``, ``[DONE]`` after a ``finish_reason``). ``usage``: ``input_tokens``,
``output_tokens``, ``total_tokens``; ``input_tokens_details.cached_tokens`` from the
upstream's ``prompt_tokens_details.cached_tokens`` and ``cache_write_tokens`` from its
``cache_write_tokens`` — ``null`` when the upstream does not report them (unknown is not 0;
``upstream_fields.cached_tokens``), 0 written when nothing was marked; no
``cache_write_tokens_details`` (chat's usage has no split by TTL). An upstream's error is
reworded as every dialect's is (``redact.upstream_error``) in OpenAI's error shape, naming
the Responses fields the client sent (``wire.client_fields.responses_fields``). A stream cut
short (the upstream closed, broke, went silent past ``--upstream-timeout-s``, sent garbage
or its own error: its message as ``relay.event_error`` words it) ends with an ``error``
event then ``response.failed``, never as a success, as does an answer the upstream aborted
(``finish_reason: "abort"``; whole: a 502 ``request_aborted``, ``wire.endings``); while the upstream is silent, ``: keep-alive`` comments go out every
``--keepalive-s`` (as local mode's Responses stream); a client that leaves closes the upstream connection (the upstream aborts).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.access_log import stream_cut
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.http.lifecycle import end_streams_with
from prefixgate.gateway.http.sse import (
    KEEPALIVE,
    SSE_HEADERS,
    client_gone,
    client_left,
    end_stream,
)
from prefixgate.gateway.proxy.answers import shape_problem
from prefixgate.gateway.proxy.attempts import (
    Call,
    each_upstream_admitted,
    invalid_answer,
    refusal,
)
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.redact import secrets_of
from prefixgate.gateway.proxy.relay import (
    CACHE_HEADER,
    EventChecker,
    StreamBroken,
    event_error,
    mid_stream_error,
    passed_cache_header,
    upstream_reads,
)
from prefixgate.gateway.proxy.routes import upstream_headers
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import Upstream
from prefixgate.gateway.proxy.upstream_fields import cached_tokens
from prefixgate.gateway.proxy.usage import output_bound
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.keys import Principal, effective_salt
from prefixgate.gateway.wire.cache_breakpoints import openai_breakpoints
from prefixgate.gateway.wire.client_fields import ClientFields, responses_fields
from prefixgate.gateway.wire.endings import aborted_error, is_aborted
from prefixgate.gateway.wire.response_models import ChatCompletion, ChatCompletionChunk
from prefixgate.gateway.wire.responses_models import (
    ResponseEvents,
    ResponsesRequest,
    parse_request,
    usage_object,
)


def refuse_unmapped(req: ResponsesRequest) -> None:
    """Refuse what a proxy cannot relay (module docstring).

    Raises:
        APIError: 400 naming ``prompt_cache_options.comparison_response_id`` or
            ``prompt_cache_options.ttl``.
    """
    options = req.prompt_cache_options
    if options is None:
        return
    if options.comparison_response_id is not None:
        raise bad_request(
            "prompt_cache_options.comparison_response_id is not available in proxy mode "
            "(cache diagnostics need the prompt log of the engine that answered it)",
            param="prompt_cache_options.comparison_response_id",
            code="unsupported_parameter",
        )
    if options.ttl == "12h" and options.mode == "implicit" and req.prompt_cache_retention != "24h":
        raise bad_request(
            "prompt_cache_options.ttl: 12h for the implicit breakpoint is not available in "
            "proxy mode (the chat API it is relayed as keeps it 30m): mark the last input_text "
            "part with prompt_cache_breakpoint {mode: explicit, ttl: 12h}, or send "
            "prompt_cache_retention 24h",
            param="prompt_cache_options.ttl",
            code="unsupported_parameter",
        )


def _turns(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``req``: its template messages, with the text parts that carry a
    cache breakpoint kept as parts (the others' text joined, as local mode joins it)."""
    options = req.prompt_cache_options
    part_ttl = options.ttl if options is not None and options.ttl == "12h" else None
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    for m in req.input:
        marked = isinstance(m.content, list) and any(
            p.prompt_cache_breakpoint is not None or p.cache_control is not None for p in m.content
        )
        if not marked or isinstance(m.content, str):
            out.append({"role": m.role, "content": m.text()})
            continue
        parts = []
        for p in m.content:
            part: dict[str, Any] = {"type": "text", "text": p.text}
            mark = p.prompt_cache_breakpoint
            if mark is not None:
                ttl = mark.ttl or part_ttl
                part["prompt_cache_breakpoint"] = {
                    "mode": "explicit",
                    **({"ttl": ttl} if ttl else {}),
                }
            if p.cache_control is not None:
                part["cache_control"] = p.cache_control.model_dump(exclude_none=True)
            parts.append(part)
        out.append({"role": m.role, "content": parts})
    return out


_CHAT_MARK = re.compile(r"(^|; )messages\.(\d+)\.")


def input_words(value: str, instructions: bool) -> str:
    """An upstream's ``x-prefixgate-cache`` ``value`` (about the chat it was sent) with each
    mark named as the client sent it, as local mode names it: ``messages.<i>.content.<j>...``
    → ``input.<i - 1>.content.<j>...`` after ``instructions`` (the chat's first message),
    ``input.<i>...`` without; ``read=`` and the marks' tokens and states as they came."""
    offset = 1 if instructions else 0

    def renamed(m: re.Match[str]) -> str:
        i = int(m.group(2)) - offset
        return f"{m.group(1)}input.{i}." if i >= 0 else m.group(0)

    return _CHAT_MARK.sub(renamed, value)


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The OpenAI chat completions body of a Responses request (module docstring); its
    ``model`` is set per upstream."""
    body: dict[str, Any] = {"messages": _turns(req)}
    for name, value in (
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("user", req.user),
        ("prompt_cache_key", req.prompt_cache_key),
        ("prompt_cache_retention", req.prompt_cache_retention),
    ):
        if value is not None:
            body[name] = value
    options = req.prompt_cache_options
    if options is not None:
        body["prompt_cache_options"] = {"mode": options.mode}
        if options.ttl == "30m":
            body["prompt_cache_options"]["ttl"] = "30m"
        elif options.ttl == "12h":  # the parts carry it; the end mark is the retention's
            body["prompt_cache_options"]["mode"] = "explicit"
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.json_schema}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        if fmt.description is not None:
            spec["description"] = fmt.description
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


class _Call(Call):
    """One proxied Responses request: its chat body, route and answer's builder."""

    def __init__(
        self,
        request: web.Request,
        req: ResponsesRequest,
        body: dict[str, Any],
        route: Route,
        salt: str | None,
        principal: Principal,
        marked: bool,
    ) -> None:
        super().__init__(request, route, principal)
        self.route: Route = route
        self.req = req
        self.body = body
        self.salt = salt
        self.marked = marked  # a cache breakpoint was sent: cache_write_tokens is the upstream's
        self.public = req.model  # the model name the client sent: every answer says it
        self.fields: ClientFields = responses_fields(req)

    def data(self, up: Upstream) -> bytes:
        body = {**self.body, "model": up.upstream_model(self.route.model or self.public)}
        if up.cache_salt is not False and self.salt is not None:
            body["cache_salt"] = self.salt
        return json.dumps(body).encode()

    def events(self) -> ResponseEvents:
        return ResponseEvents("resp_" + uuid.uuid4().hex, int(time.time()), self.public, self.req)

    def usage(self, usage: Any, reasoned: bool) -> dict[str, Any] | None:
        """The Responses ``usage`` of the upstream's OpenAI ``usage`` (None: it sent none);
        a count it does not report is None (module docstring)."""
        if not isinstance(usage, dict):
            return None
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not (isinstance(p, int) and isinstance(c, int) and _count(p) and _count(c)):
            return None
        details = usage.get("prompt_tokens_details")
        written = details.get("cache_write_tokens") if isinstance(details, dict) else None
        if not _count(written):
            written = None if self.marked else 0
        out = usage.get("completion_tokens_details")
        reasoning = out.get("reasoning_tokens") if isinstance(out, dict) else None
        if not _count(reasoning):
            reasoning = None if reasoned else 0  # no reasoning text came: none was spent
        return usage_object(p, c, cached_tokens(usage), written, reasoning=reasoning)

    def learn(self, up: Upstream, usage: Any) -> None:
        """Feed the answer's usage to routing (as the chat route's ``_learn``)."""
        if not isinstance(usage, dict) or not _count(usage.get("prompt_tokens")):
            return
        cached = cached_tokens(usage)
        up.cached_tokens_reported = cached is not None
        if cached is not None and self.route.blocks:
            self.router.learn(up, self.route, cached, usage["prompt_tokens"])


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses in upstream mode (module docstring)."""
    st = request.app[STATE]
    router = request.app[PROXY].router
    principal = st.keys.authenticate(request)
    raw = await request.read()
    req = parse_request(raw)  # 400 naming the field, local mode's words
    model = router.resolve(req.model)  # 404 model_not_found when nobody serves it
    if isinstance(req.input, list) and not req.input:
        raise bad_request("input must hold at least one message", param="input")
    messages = req.messages()
    marks = openai_breakpoints(  # local mode's checks of the breakpoints, its 400s
        req.input if isinstance(req.input, list) else [],
        req.prompt_cache_options,
        req.prompt_cache_retention,
        messages,
        1 if req.instructions else 0,
        [],
        field="input",
    )
    refuse_unmapped(req)
    salt = effective_salt(principal.salt, req.cache_salt)
    route = router.route({"messages": messages}, salt, model)
    body = chat_body(req)
    call = _Call(request, req, body, route, salt, principal, bool(marks))

    async def attempt(up: Upstream, ticket: Any) -> web.StreamResponse:
        return await _try(call, up, ticket)

    return await each_upstream_admitted(
        call, principal, len(raw) // 4 + 1, attempt, output_bound(body)
    )


async def _try(call: _Call, up: Upstream, ticket: Any) -> web.StreamResponse:
    """One try of the request on ``up``: the chat sent, its answer translated."""
    session = call.router.session
    assert session is not None
    headers = upstream_headers(call.request, call.st, up)
    url = up.url + "/v1/chat/completions"
    async with session.post(url, data=call.data(up), headers=headers, ssl=up.ssl) as resp:
        call.answered = resp.status
        if resp.status != 200:
            raise refusal(call, up, resp.status, await resp.read(), resp.headers, call.fields)
        extra = passed_cache_header(resp.headers)
        if CACHE_HEADER in extra:
            extra[CACHE_HEADER] = input_words(extra[CACHE_HEADER], bool(call.req.instructions))
        ctype = resp.headers.get("Content-Type", "")
        if call.req.stream and ctype.startswith("text/event-stream"):
            ticket.started()
            up.served += 1
            call.served = True
            return await _relay(call, up, resp, extra)
        data = await resp.read()
        problem = _problem(data, ctype, call.req.stream)
        if problem is not None:
            raise invalid_answer(call.router, up, problem)
        ticket.started()
        up.served += 1
        call.served = True
        call.router.mark_ok(up)
        parsed = json.loads(data)
        choice = parsed["choices"][0]
        message = choice.get("message") or {}
        text = message.get("content") if isinstance(message.get("content"), str) else ""
        usage = parsed.get("usage")
        call.account.read_choices(parsed.get("choices"), streamed=False)
        call.account.read_usage(usage)
        call.learn(up, usage)
        if is_aborted(choice.get("finish_reason")):
            raise aborted_error(upstream=True)  # cut short: not a completed response
        reasoned = bool(message.get("reasoning_content") or message.get("reasoning"))
        answer = call.events().response(
            "completed", text, call.usage(usage, reasoned), choice.get("finish_reason")
        )
        data = json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode()
        return web.Response(body=data, content_type="application/json", headers=extra)


def _problem(data: bytes, ctype: str, stream: bool) -> str | None:
    """Why an upstream's 200 answer is not the chat completion the request needs (None: it
    is one)."""
    if stream:
        return "a stream answered as JSON"
    if ctype.startswith("text/event-stream"):
        return "an event stream for a non-stream request"
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return "a body that is not JSON"
    problem = shape_problem(parsed, ChatCompletion)
    if problem is None and not parsed.get("choices"):
        return "a chat completion without choices"
    return problem


class _Chunks:
    """The upstream's chunk events → Responses events (``ResponseEvents``): each content
    delta of choice 0 a ``response.output_text.delta``; the finish reason and usage noted
    for the closing events. Each chunk is read into the request's account."""

    def __init__(self, call: _Call, events: ResponseEvents) -> None:
        self.call = call
        self.events = events
        self.finish: str | None = None
        self.usage: Any = None
        self.reasoned = False
        self.content = 0  # content chunks: the estimate when no usage comes

    def feed(self, events: bytes) -> list[bytes]:
        out: list[bytes] = []
        for event in events.split(b"\n\n"):
            data = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if not data or data[0] == b"[DONE]":
                continue
            obj = json.loads(b"\n".join(data))
            if obj.get("error") is not None:
                continue  # the checker noted it (``errored``): the stream ends failed
            self.call.account.read_choices(obj.get("choices"), streamed=True)
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            for ch in obj.get("choices") or []:
                if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                    continue
                delta = ch.get("delta") or {}
                text = delta.get("content")
                if isinstance(text, str) and text:
                    self.content += 1
                    out.append(self.events.delta(text))
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.reasoned = True
                if ch.get("finish_reason"):
                    self.finish = ch["finish_reason"]
        return out

    def closing(self) -> list[bytes]:
        usage = self.call.usage(self.usage, self.reasoned)
        return self.events.closing(self.events.text, usage, self.finish)


async def _relay(
    call: _Call, up: Upstream, resp: aiohttp.ClientResponse, headers: dict[str, str]
) -> web.StreamResponse:
    """The upstream's chunk stream as Responses events, checked; a cut ends with ``error``
    then ``response.failed``."""
    request = call.request
    events = call.events()
    out = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
    await out.prepare(request)
    end_streams_with(request, events.failed)  # a drain's ending: the failed response
    checker = EventChecker(ChatCompletionChunk, require_finish=True)
    chunks = _Chunks(call, events)
    error: APIError | None = None
    s = call.st.settings
    reads = upstream_reads(resp, s.keepalive_s, s.upstream_timeout_s)
    try:
        await out.write(b"".join(events.opening()))
        while not checker.done:
            data = await anext(reads, b"")
            if data is None:  # silent for keepalive_s: a comment line, as local mode's
                await out.write(KEEPALIVE)
                continue
            if not data:
                raise StreamBroken("the upstream's stream ended before its last event ([DONE])")
            passed = chunks.feed(checker.feed(data))
            if passed:
                await out.write(b"".join(passed))
        if checker.errored:
            secrets = secrets_of(s.upstream_api_key, up.auth)
            error = event_error(checker.error_event or {}, secrets, call.fields)
        elif is_aborted(chunks.finish):
            error = aborted_error(upstream=True)
    except StreamBroken as exc:
        error = APIError(502, str(exc), code=exc.code)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        if client_gone(request):  # a write to the client failed: aiohttp's
            return client_left(out)  # ClientConnectionResetError is a ClientConnectionError too
        error = mid_stream_error(exc, s.upstream_timeout_s)
    except ConnectionResetError:
        return client_left(out)  # leaving closes the upstream connection
    call.account.estimated_completion_tokens = chunks.content
    call.account.read_usage(chunks.usage)
    call.learn(up, chunks.usage)
    if error is None:
        call.router.mark_ok(up)
        return await end_stream(out, b"".join(chunks.closing()))
    stream_cut(request, error.code)
    return await end_stream(out, events.failed(error))
