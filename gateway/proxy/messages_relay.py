"""POST /v1/messages and /v1/messages/count_tokens in upstream mode (Anthropic's Messages API).

The body is validated first by the local dialect's models (``wire.anthropic_models``: a field
local mode refuses is a 400 naming it here too), then routed as a chat of the same messages
(its model's upstreams, prefix affinity by the system prompt under the key's salt). Per
upstream:

* **Messages upstreams** — a prefixgate upstream (``Upstream.prefix_api``: its
  ``/v1/models`` cards are all ``owned_by: "prefixgate"``) or a config's Anthropic-dialect
  deployment: the body is relayed as the client sent it, the model rewritten to the
  upstream's id and, for a prefixgate upstream, the key's effective cache salt
  (``keys.effective_salt`` of the key's salt and the request's own ``cache_salt``) as
  ``cache_salt`` — so tenants never share cached blocks or pins there, and breakpoints
  (``cache_control``) become that engine's pins. The answer is verified: a body must be an
  Anthropic ``message``, a stream is checked event by event (JSON objects whose ``type``
  is their event's, ``message_start`` first, ending with ``message_stop``).
* **OpenAI-compatible upstreams** (any other): the request translated to a chat completion
  and the answer back (``proxy.messages_openai``); ``count_tokens`` asks the upstream's
  ``/tokenize`` (vLLM's shape) and is 501 naming the route when it has none.

A failure before the answer (connection error, 502/503/504, an invalid 200) marks the
upstream down and tries the next of the model; a 429 (its ``Retry-After`` keeps the upstream
out) or 500/529 tries the next too; then a config's fallbacks (``attempts.each_upstream``). An
upstream error reaches the client reworded by ``redact.upstream_error`` as every dialect's
does — a 4xx's message kept with credentials scrubbed (a translated request's chat fields
named as the client sent them: ``wire.client_fields``), a 5xx in the gateway's words, a body
without an error object never shown (a 401/403 to the gateway's own credential is a 502
``upstream_auth_failed``: ``redact.auth_error``). A stream that ends before its
last event, breaks, stalls past ``--upstream-timeout-s``, turns to garbage or sends its own
error event (worded by ``relay.event_error``, the same rule) ends with an Anthropic ``error``
event, never as a success; an OpenAI-compatible upstream's aborted answer (``finish_reason:
"abort"``) is an error too (``wire.endings``: a 502, or the stream's ``error`` event), never
``end_turn``. The key is charged the usage the upstream
reports.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.access_log import stream_cut
from prefixgate.gateway.http.errors import ANTHROPIC, APIError, error_dialect, error_event
from prefixgate.gateway.http.request_account import RequestAccount
from prefixgate.gateway.http.sse import (
    KEEPALIVE,
    SSE_HEADERS,
    client_gone,
    client_left,
    end_stream,
)
from prefixgate.gateway.proxy import anthropic, attempts, messages_openai
from prefixgate.gateway.proxy.answers import shape_problem
from prefixgate.gateway.proxy.attempts import (
    Call,
    NextUpstream,
    each_upstream,
    invalid_answer,
    refusal,
)
from prefixgate.gateway.proxy.messages_openai import Malformed
from prefixgate.gateway.proxy.policies import Route
from prefixgate.gateway.proxy.redact import secrets_of
from prefixgate.gateway.proxy.relay import (
    CACHE_HEADER,
    broke_mid_stream,
    event_error,
    passed_cache_header,
    upstream_reads,
)
from prefixgate.gateway.proxy.routes import upstream_credential, upstream_headers
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import Upstream
from prefixgate.gateway.proxy.usage import output_bound
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.keys import Principal, effective_salt
from prefixgate.gateway.wire.anthropic_models import (
    Chat,
    CountTokensRequest,
    MessageAnswer,
    MessagesRequest,
    output_constraint,
    parse_request,
    to_chat,
)
from prefixgate.gateway.wire.client_fields import anthropic_fields
from prefixgate.gateway.wire.endings import aborted_error, is_aborted
from prefixgate.gateway.wire.request_models import load_json
from prefixgate.gateway.wire.response_models import ChatCompletion, ChatCompletionChunk
from prefixgate.gateway.wire.stop_strings import anthropic_constraint, refuse_stop_under_constraint

logger = logging.getLogger("prefixgate.gateway")

_EVENTS = frozenset(
    (
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "ping",
    )
)


class _Call(Call):
    """One client request: the parsed request, its chat, salt, route and what was served."""

    def __init__(
        self,
        request: web.Request,
        req: MessagesRequest | CountTokensRequest,
        raw: dict[str, Any],
        chat: Chat,
        salt: str | None,
        route: Route,
        principal: Principal,
        output_field: str = "",
    ) -> None:
        super().__init__(request, route, principal)
        self.route: Route = route
        self.req = req
        self.raw = raw
        self.chat = chat
        # an OpenAI-compatible upstream's refusal of the translated body, in the client's words
        self.fields = anthropic_fields(chat.origins, len(chat.tools), output_field)
        self.salt = salt
        self.public = req.model  # the model name the client sent: every answer says it

    def passthrough(self, up: Upstream) -> bool:
        """Whether ``up`` takes the Messages API itself (prefixgate, or Anthropic's)."""
        return up.dialect == "anthropic" or up.prefix_api is True

    def messages_body(self, up: Upstream) -> bytes:
        """The client's body for a Messages upstream: its model id, the salt (prefixgate)."""
        body = {**self.raw, "model": up.upstream_model(self.route.model or self.public)}
        body.pop("cache_salt", None)  # nested into the effective salt, or not taken
        if up.dialect != "anthropic" and up.cache_salt is not False and self.salt is not None:
            body["cache_salt"] = self.salt
        return json.dumps(body).encode()

    def headers(self, up: Upstream) -> dict[str, str]:
        if up.dialect == "anthropic":
            return anthropic.headers_for(upstream_credential(self.request, self.st, up))
        return upstream_headers(self.request, self.st, up)

    def took(self, usage: dict[str, Any] | None, up: Upstream) -> None:
        """Note the answer's Anthropic usage (into the request's account; routing)."""
        self.account.read_anthropic_usage(usage)
        if not isinstance(usage, dict):
            return
        counts = [usage.get(k) for k in _PROMPT_KEYS]
        if all(isinstance(c, int) and not isinstance(c, bool) for c in counts if c is not None):
            cached = usage.get("cache_read_input_tokens")
            prompt = sum(c for c in counts if c is not None)
            up.cached_tokens_reported = cached is not None
            # null: the upstream does not report its cache; nothing to learn (not a miss)
            if self.route.blocks and isinstance(cached, int) and not isinstance(cached, bool):
                self.router.learn(up, self.route, cached, prompt)


_PROMPT_KEYS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def _prepare(
    request: web.Request, kind: type[MessagesRequest] | type[CountTokensRequest]
) -> tuple[_Call, Any]:
    st = request.app[STATE]
    router = request.app[PROXY].router
    principal = st.keys.authenticate(request)
    body = await request.read()
    req = parse_request(kind, body)  # 400 naming the field, Anthropic's shape
    # local mode's order: the body's form, the model's name, then what the body says
    model = router.resolve(req.model)  # 404 model_not_found when nobody serves it
    raw = load_json(body)
    chat = to_chat(req)
    if kind is MessagesRequest:  # 400 beside a forced tool call, as local
        _, output_field = output_constraint(req, chat)
    else:  # a count generates nothing: as local mode, a format beside a forced call is counted
        _, output_field = req.output_schema()
    # after the chat's and the format's checks, as local mode: a body with two defects is
    # named by the same one in both modes
    stop = getattr(req, "stop_sequences", None)
    refuse_stop_under_constraint(stop, "stop_sequences", anthropic_constraint(raw))
    salt = effective_salt(principal.salt, req.cache_salt)
    route = router.route({"messages": chat.messages}, salt, model)
    return _Call(request, req, raw, chat, salt, route, principal, output_field), principal


@error_dialect(ANTHROPIC)
async def create_message(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages in upstream mode (module docstring)."""
    call, principal = await _prepare(request, MessagesRequest)
    est_tokens = request.content_length or len(json.dumps(call.raw))
    est_tokens = est_tokens // 4 + 1  # no tokenizer here: ~4 bytes per token until the usage

    async def attempt(up: Upstream, ticket: Any) -> web.StreamResponse:
        return await _message_try(call, up, ticket)

    return await attempts.each_upstream_admitted(
        call, principal, est_tokens, attempt, output_bound(call.raw)
    )


@error_dialect(ANTHROPIC)
async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens in upstream mode: the upstream's own count (a Messages
    upstream's ``count_tokens``, an OpenAI-compatible one's ``/tokenize``)."""
    call, _ = await _prepare(request, CountTokensRequest)

    async def attempt(up: Upstream) -> web.StreamResponse:
        return await _count_try(call, up)

    out = await each_upstream(call, attempt)
    assert isinstance(out, web.Response)
    return out


async def _refused(call: _Call, up: Upstream, resp: aiohttp.ClientResponse) -> None:
    """An upstream's non-200 answer: ``attempts.refusal``'s exception; never returns."""
    fields = None if call.passthrough(up) else call.fields  # it refused the chat body sent
    raise refusal(call, up, resp.status, await resp.read(), resp.headers, fields)


async def _message_try(call: _Call, up: Upstream, ticket: Any) -> web.StreamResponse:
    """One try of a Messages request on ``up`` (module docstring)."""
    session = call.router.session
    assert session is not None
    req = call.req
    assert isinstance(req, MessagesRequest)
    stops = list(req.stop_sequences or [])
    rid = messages_openai.message_id()
    dropped: str | None = None
    if call.passthrough(up):
        url, data = up.url + "/v1/messages", call.messages_body(up)
    else:
        messages_openai.refuse_unmapped(req)
        body = messages_openai.to_chat_body(
            req, call.chat, up.upstream_model(call.route.model or call.public)
        )
        if up.cache_salt is not False and call.salt is not None:
            body["cache_salt"] = call.salt
        url, data = up.url + "/v1/chat/completions", json.dumps(body).encode()
        dropped = messages_openai.dropped_marks(call.chat)
    async with session.post(url, data=data, headers=call.headers(up), ssl=up.ssl) as resp:
        if resp.status != 200:
            await _refused(call, up, resp)
        extra = passed_cache_header(resp.headers)  # the upstream's pins, as they are
        if dropped is not None:  # the breakpoints the translation left out, named after them
            extra[CACHE_HEADER] = "; ".join(p for p in (extra.get(CACHE_HEADER), dropped) if p)
        ctype = resp.headers.get("Content-Type", "")
        if req.stream and ctype.startswith("text/event-stream"):
            if ticket is not None:
                ticket.started()
            up.served += 1
            call.served = True
            if call.passthrough(up):
                checker: _Events = _MessageEvents(call.public, call.account)
            else:
                translator = messages_openai.ChunkTranslator(rid, call.public, stops)
                checker = _ChunkEvents(translator, call.account)
            out = await _relay(call, up, resp, checker, extra)
            call.account.estimated_completion_tokens = checker.output_tokens()
            call.took(checker.usage(), up)
            return out
        raw = await resp.read()
        try:
            if req.stream:
                raise Malformed(f"a {ctype.split(';')[0] or 'typeless'} answer to a stream")
            parsed = json.loads(raw)
            if call.passthrough(up):
                message = _checked_message(parsed, call.public)
                call.account.finish_reason = anthropic.finish_reason(message.get("stop_reason"))
            else:
                message = messages_openai.to_message(
                    _checked_completion(parsed), rid, call.public, stops
                )
                call.account.read_choices(parsed.get("choices"), streamed=False)
        except (ValueError, UnicodeDecodeError, Malformed) as exc:
            why = str(exc) if isinstance(exc, Malformed) else "a body that is not JSON"
            raise invalid_answer(call.router, up, why) from None
        if ticket is not None:
            ticket.started()
        up.served += 1
        call.served = True
        call.took(message["usage"], up)
        if not call.passthrough(up) and _aborted(parsed):
            raise aborted_error(upstream=True)  # end_turn would say it finished
        return web.json_response(message, headers=extra)


def _aborted(completion: dict[str, Any]) -> bool:
    """Whether a chat completion's first choice was aborted (``wire.endings``)."""
    choices = completion.get("choices") or [{}]
    return isinstance(choices[0], dict) and is_aborted(choices[0].get("finish_reason"))


def _checked_message(obj: Any, model: str) -> dict[str, Any]:
    """A Messages upstream's answer, checked to be an Anthropic ``message`` by the proxy's
    one verifier (``answers.shape_problem`` with ``MessageAnswer``), its model the public
    name.

    Raises:
        Malformed: it is not one (what is wrong, in a short sentence).
    """
    problem = shape_problem(obj, MessageAnswer)
    if problem is not None:
        raise Malformed(problem)
    return {**obj, "model": model}


def _checked_completion(obj: Any) -> Any:
    """An OpenAI-compatible upstream's answer to a translated Messages request, checked as
    the chat route checks it (``answers.shape_problem`` with ``ChatCompletion``: choices,
    messages, finish reasons).

    Raises:
        Malformed: it is not a ``chat.completion``.
    """
    problem = shape_problem(obj, ChatCompletion)
    if problem is not None:
        raise Malformed(problem)
    return obj


async def _count_try(call: _Call, up: Upstream) -> web.Response:
    """One try of a ``count_tokens`` request on ``up``."""
    model = up.upstream_model(call.route.model or call.public)
    unsupported = None
    if call.passthrough(up):
        url, data = up.url + "/v1/messages/count_tokens", call.messages_body(up)
    else:
        url = up.url + "/tokenize"
        data = json.dumps(messages_openai.tokenize_body(call.chat, model)).encode()
        unsupported = (
            f"{call.request.path} is not available for the model {call.public!r}: its "
            "upstream is OpenAI-compatible and has no /tokenize to count with"
        )
    parsed = await attempts.post_count(
        call, up, url, data, call.headers(up), lambda resp: _refused(call, up, resp), unsupported
    )
    if call.passthrough(up):
        n = parsed.get("input_tokens") if isinstance(parsed, dict) else None
        if not _count(n):
            call.router.mark_failed(up, "HTTP 200 without input_tokens")
            raise NextUpstream(
                "invalid",
                APIError(502, "the upstream's count has no input_tokens", code="upstream_error"),
            )
    else:
        n = messages_openai.token_count(parsed)
    up.served += 1
    return web.json_response({"input_tokens": n})


class _Events:
    """A stream's checker: SSE events in (``event`` name, ``data`` text), bytes for the
    client out; ``done`` once the stream ended well.

    Raises (from ``feed`` / ``end``): ``Malformed`` when the stream breaks its contract.
    """

    done = False

    def feed(self, event: str | None, data: str) -> bytes:
        raise NotImplementedError

    def end(self) -> bytes:
        """The upstream's stream ended (cleanly, at the transport): what is left to send."""
        raise Malformed("a stream that ended before its last event")

    def usage(self) -> dict[str, Any] | None:
        return None

    def output_tokens(self) -> int:
        return 0


class _MessageEvents(_Events):
    """A Messages upstream's stream, checked event by event: each ``data`` a JSON object
    whose ``type`` is a Messages event (and its ``event:`` name), ``message_start`` first,
    blocks opened before their deltas, ``message_stop`` last; an upstream ``error`` event is
    reworded. ``message_start``'s model is the public name; other events pass as they came.
    Read into ``account`` (the request's): each content delta a token, the stop reason."""

    def __init__(self, model: str, account: RequestAccount) -> None:
        self.account = account
        self.model = model
        self.started = False
        self.blocks: set[int] = set()
        self._usage: dict[str, Any] = {}

    def feed(self, event: str | None, data: str) -> bytes:
        try:
            obj = json.loads(data)
        except ValueError:
            raise Malformed("an event whose data is not JSON") from None
        kind = obj.get("type") if isinstance(obj, dict) else None
        if not isinstance(kind, str) or (event is not None and event != kind):
            raise Malformed("an event without its type")
        if kind == "error":
            raise _UpstreamError(obj)
        if kind not in _EVENTS:
            raise Malformed(f"an event of unknown type {kind[:40]!r}")
        if kind == "ping":
            return _frame(kind, data)
        if not self.started:
            if kind != "message_start" or not isinstance(obj.get("message"), dict):
                raise Malformed(f"{kind} before message_start")
            self.started = True
            msg = obj["message"]
            self._usage.update(msg.get("usage") or {})
            return _frame(kind, json.dumps({**obj, "message": {**msg, "model": self.model}}))
        index = obj.get("index")
        if kind == "message_start":
            raise Malformed("a second message_start")
        if kind == "content_block_start":
            if not isinstance(index, int) or index in self.blocks:
                raise Malformed("a content block started twice")
            self.blocks.add(index)
        elif kind in ("content_block_delta", "content_block_stop") and index not in self.blocks:
            raise Malformed(f"{kind} of a block never started")
        if kind == "content_block_delta":
            self.account.note_token()
        elif kind == "message_delta":
            delta = obj.get("delta")
            reason = delta.get("stop_reason") if isinstance(delta, dict) else None
            if reason is not None:
                self.account.finish_reason = anthropic.finish_reason(reason)
            usage = obj.get("usage")
            if isinstance(usage, dict):
                self._usage.update({k: v for k, v in usage.items() if v is not None})
        elif kind == "message_stop":
            self.done = True
        return _frame(kind, data)

    def usage(self) -> dict[str, Any] | None:
        return self._usage or None


class _ChunkEvents(_Events):
    """An OpenAI-compatible upstream's chunks, translated (``ChunkTranslator``); it must end
    with ``[DONE]`` after a finish reason. Each chunk is read into ``account`` (the
    request's: its finish reason, its token times)."""

    def __init__(
        self, translator: messages_openai.ChunkTranslator, account: RequestAccount
    ) -> None:
        self.translator = translator
        self.account = account

    def feed(self, event: str | None, data: str) -> bytes:
        if data.strip() == "[DONE]":
            self.done = True
            if is_aborted(self.translator.finish_reason):
                raise aborted_error(upstream=True)  # no stop_reason says so: an error event
            return self.translator.finish()
        try:
            obj = json.loads(data)
        except ValueError:
            raise Malformed("an event whose data is not JSON") from None
        if isinstance(obj, dict) and obj.get("error") is not None:
            raise _UpstreamError(obj)
        problem = shape_problem(obj, ChatCompletionChunk, chunk=True)  # as the chat relay's
        if problem is not None:
            raise Malformed(problem)
        self.account.read_choices(obj.get("choices"), streamed=True)
        return self.translator.feed(obj)

    def usage(self) -> dict[str, Any] | None:
        return self.translator.usage if self.translator.usage_seen else None

    def output_tokens(self) -> int:
        return self.translator.content_chunks


class _UpstreamError(Exception):
    """The upstream ended its stream with an error event of its own (``event``: its parsed
    data, for ``relay.event_error``)."""

    def __init__(self, event: dict[str, Any]) -> None:
        super().__init__("the upstream ended its stream with an error")
        self.event = event


def _frame(kind: str, data: str) -> bytes:
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def _sse(
    resp: aiohttp.ClientResponse, idle_timeout_s: float, keepalive_s: float
) -> AsyncIterator[tuple[str | None, str] | None]:
    """The upstream's SSE events as ``(event name, data)``; None when a keep-alive is due.

    Raises:
        Malformed: bytes that are not SSE, or an event over 16 MiB.
        TimeoutError: nothing for ``idle_timeout_s``.
    """
    buf = b""
    async for chunk in upstream_reads(resp, keepalive_s, idle_timeout_s):
        if chunk is None:
            yield None
            continue
        buf = (buf + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            name: str | None = None
            data: list[str] = []
            for line in raw.decode("utf-8", errors="strict").split("\n"):
                if not line or line.startswith(":"):
                    continue
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    name = value
                elif field == "data":
                    data.append(value)
                elif field not in ("id", "retry"):
                    raise Malformed("bytes that are not server-sent events")
            if data:
                yield name, "\n".join(data)
        if len(buf) > 16 << 20:
            raise Malformed("an event larger than 16 MiB")


async def _relay(
    call: _Call,
    up: Upstream,
    resp: aiohttp.ClientResponse,
    checker: _Events,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Relay the upstream's stream through ``checker``; a broken one ends with an Anthropic
    ``error`` event (module docstring): an upstream's own error event as ``relay.event_error``
    words it, an aborted answer as ``wire.endings.aborted_error``."""
    request = call.request
    out = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
    await out.prepare(request)
    s = call.st.settings
    error: APIError | None = None
    try:
        async for event in _sse(resp, s.upstream_timeout_s, s.keepalive_s):
            if event is None:
                await out.write(KEEPALIVE)
                continue
            passed = checker.feed(*event)
            if passed:
                await out.write(passed)
            if checker.done:
                break
        else:
            await out.write(checker.end())
    except Malformed as exc:
        error = APIError(502, f"the upstream's stream broke: {exc}", code="upstream_error")
    except _UpstreamError as exc:
        secrets = secrets_of(s.upstream_api_key, up.auth)
        fields = None if call.passthrough(up) else call.fields
        error = event_error(exc.event, secrets, fields)
    except APIError as exc:  # the upstream aborted the answer (finish_reason "abort")
        error = exc
    except UnicodeDecodeError:
        error = APIError(502, "the upstream's stream is not UTF-8", code="upstream_error")
    except TimeoutError:
        error = APIError(
            504,
            f"the upstream sent nothing for {s.upstream_timeout_s:g} s",
            code="upstream_timeout",
        )
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        if client_gone(request):  # a write to the client failed: aiohttp's
            return client_left(out)  # ClientConnectionResetError is a ClientConnectionError too
        error = APIError(502, broke_mid_stream(exc), code="upstream_error")
    except ConnectionResetError:
        return client_left(out)  # leaving closes the upstream connection
    if error is None:
        return await end_stream(out)
    logger.warning("upstream stream broken: %s", error.message)
    stream_cut(request, error.code)
    return await end_stream(out, error_event(request, error))
