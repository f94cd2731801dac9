"""Relaying an upstream's SSE stream while verifying it: a stream cut short never reaches the
client as a success.

The upstream's bytes are split into events (blank-line separated, as the HTML standard's
server-sent events) and each complete event is checked, then written as it came:

* a ``data:`` line must hold JSON (or ``[DONE]``); comment lines (``:``) and the ``event``,
  ``id``, ``retry`` fields pass; anything else is not an SSE stream;
* the stream must end with ``data: [DONE]`` (or an error event of the upstream's own);
* with a ``chunk_model`` (``answers.answer_model``), each JSON event must be one of its
  chunks (``answers.shape_problem``), and with ``require_finish`` every choice the stream
  opened must have reported a ``finish_reason`` by ``[DONE]`` (a stream ending ``[DONE]``
  without one is a truncated answer posing as a finished one).

When the upstream breaks the contract — garbage, a clean end without ``[DONE]``, a chunk
that is not the route's, ``[DONE]`` before a ``finish_reason``, a
connection killed mid-stream, nothing for ``idle_timeout_s`` — the client gets one in-band
error event, ``data: {"error": {...}}`` with code ``upstream_error`` (or
``upstream_timeout``), and the stream ends without ``[DONE]``: openai-python and the
project's SDK then raise instead of returning truncated text. While the upstream is silent,
``: keep-alive`` comments go to the client every ``keepalive_s`` so it and any proxy in
between keep the connection open.

What every dialect's relay shares: ``upstream_reads`` (an upstream body's reads, with a
keep-alive due every ``keepalive_s`` of silence and the silence limit, which keep-alives do not
reset) and ``passed_cache_header`` (the upstream's ``x-prefixgate-cache`` header, passed on as
it came; none when it sent none).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.access_log import stream_cut
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.sse import (
    KEEPALIVE,
    SSE_HEADERS,
    client_gone,
    client_left,
    encode_event,
    end_stream,
)
from prefixgate.gateway.proxy.answers import shape_problem
from prefixgate.gateway.proxy.redact import scrub, upstream_error, upstream_error_fields
from prefixgate.gateway.proxy.usage import UsageTap
from pydantic import BaseModel

logger = logging.getLogger("prefixgate.gateway")

MAX_EVENT_BYTES = 16 << 20  # one event larger than this is not a chat completion chunk
# the Content-Encodings aiohttp undoes on the upstream session's reads (br and zstd: a
# missing library is a read error there); another stays on the bytes
DECODED = frozenset(("identity", "gzip", "deflate", "br", "zstd"))
_FIELDS = (b"data", b"event", b"id", b"retry")
CACHE_HEADER = "x-prefixgate-cache"  # a prefixgate upstream's prompt-cache report


def passed_cache_header(headers: Mapping[str, str]) -> dict[str, str]:
    """The answer header of an upstream's ``headers`` every relayed route passes on:
    ``x-prefixgate-cache`` as the upstream sent it (an empty value too, as local mode's stream
    sends it), ``{}`` when it sent none (an upstream that is not prefixgate: vLLM, SGLang, ...);
    the proxy never makes one up."""
    value = headers.get(CACHE_HEADER)
    return {} if value is None else {CACHE_HEADER: value}


async def upstream_reads(
    resp: aiohttp.ClientResponse, keepalive_s: float, idle_timeout_s: float
) -> AsyncIterator[bytes | None]:
    """``resp``'s body as it arrives: each read's bytes (never empty), or None each time
    ``keepalive_s`` (seconds) passed without any: a keep-alive is due. Ends at the body's end.
    The silence limit counts from the upstream's last byte: keep-alives sent meanwhile do not
    reset it.

    Raises:
        TimeoutError: nothing for ``idle_timeout_s`` seconds (0: no limit of ours), or
            aiohttp's own ``sock_read`` timeout; ``mid_stream_error`` words it.
        aiohttp.ClientPayloadError, aiohttp.ClientConnectionError: the connection broke.
    """
    last = time.monotonic()
    while True:
        try:
            async with asyncio.timeout(min(keepalive_s, idle_timeout_s or keepalive_s)) as wait:
                chunk = await resp.content.readany()
        except TimeoutError:
            if not wait.expired():  # aiohttp's sock_read: the upstream's silence, not ours
                raise
            if idle_timeout_s and time.monotonic() - last >= idle_timeout_s:
                raise
            yield None
            continue
        if not chunk:
            return
        last = time.monotonic()
        yield chunk


class StreamBroken(Exception):
    """The upstream's stream broke its contract (``code``: the error code to report)."""

    def __init__(self, message: str, code: str = "upstream_error") -> None:
        super().__init__(message)
        self.code = code


class EventChecker:
    """Splits bytes into SSE events and checks each (see the module docstring).

    ``feed(data) -> bytes`` returns the complete events to pass on (raises ``StreamBroken``);
    ``done`` is True once ``[DONE]`` (or an upstream error event, kept in ``error_event``:
    its parsed data, for ``event_error``) was seen; ``seen`` and
    ``finished`` hold the choice indexes that sent a chunk and that reported a
    ``finish_reason``; ``broken`` is set by ``relay_sse`` to why the stream broke, if it did.

    Args:
        chunk_model: the response model each JSON event must be a chunk of (None: any JSON
            object).
        require_finish: ``[DONE]`` before every opened choice finished (or with none opened)
            breaks the stream.
        model: the model name every event's ``model`` is to say (the name the client sent,
            where the gateway sent the upstream another id: ``answers.renamed``); None: as
            the upstream said it.
    """

    __slots__ = (
        "_buf",
        "done",
        "errored",
        "error_event",
        "seen",
        "finished",
        "events",
        "broken",
        "_model",
        "_require_finish",
        "_rename",
    )

    def __init__(
        self,
        chunk_model: type[BaseModel] | None = None,
        require_finish: bool = False,
        model: str | None = None,
    ) -> None:
        self._buf = b""
        self.done = False
        self.errored = False
        self.error_event: dict[str, Any] | None = None
        self.seen: set[int] = set()
        self.finished: set[int] = set()
        self.events = 0
        self.broken: str | None = None
        self._model = chunk_model
        self._require_finish = require_finish
        self._rename = model

    def feed(self, data: bytes) -> bytes:
        """Complete, checked events of ``data`` (with what came before), as bytes."""
        buf = (self._buf + data).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if buf.startswith(b"\xef\xbb\xbf") and not self.events:
            buf = buf[3:]  # a byte-order mark may open a stream
        out = []
        while not self.done:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            event, buf = buf[: end + 2], buf[end + 2 :]
            out.append(self._check(event))
        if len(buf) > MAX_EVENT_BYTES:
            raise StreamBroken("the upstream sent an event larger than 16 MiB")
        self._buf = b"" if self.done else buf
        return b"".join(out)

    def _check(self, event: bytes) -> bytes:
        """``event`` checked; returned as it came, or with its ``model`` renamed."""
        self.events += 1
        data = []
        for line in event.split(b"\n"):
            if not line or line.startswith(b":"):
                continue
            name, _, value = line.partition(b":")
            if name not in _FIELDS:
                raise StreamBroken("the upstream sent bytes that are not server-sent events")
            if name == b"data":
                data.append(value[1:] if value.startswith(b" ") else value)
        if not data:
            return event
        payload = b"\n".join(data)
        if payload.strip() == b"[DONE]":
            if self._require_finish and (not self.seen or self.seen - self.finished):
                open_ = sorted(self.seen - self.finished)
                raise StreamBroken(
                    "the upstream's stream ended ([DONE]) without a finish_reason"
                    + (f" for choice {open_[0]}" if open_ else " (no choice sent)")
                )
            self.done = True
            return event
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            raise StreamBroken("the upstream sent an event whose data is not JSON") from None
        if not isinstance(obj, dict):
            raise StreamBroken("the upstream sent an event whose data is not a JSON object")
        if obj.get("error") is not None:
            self.done = self.errored = True  # the upstream's own explicit ending
            self.error_event = obj
            return event
        if self._model is not None:
            problem = shape_problem(obj, self._model, chunk=True)
            if problem is not None:
                raise StreamBroken(f"the upstream sent an event that is {problem}")
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                self.seen.add(choice.get("index", 0))
                if choice.get("finish_reason") is not None:
                    self.finished.add(choice.get("index", 0))
        if self._rename is not None and "model" in obj and obj["model"] != self._rename:
            kept = [ln for ln in event.split(b"\n") if ln and not ln.startswith(b"data")]
            data_line = b"data: " + json.dumps({**obj, "model": self._rename}).encode()
            return b"\n".join([*kept, data_line]) + b"\n\n"
        return event


# an upstream error event's ``type`` → the HTTP status class it stands for, when its ``code``
# is no HTTP status (vLLM sends the status as ``code``; Anthropic's events carry only a type)
_TYPE_STATUS = {
    "invalid_request_error": 400,
    "BadRequestError": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "NotFoundError": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "RateLimitError": 429,
    "overloaded_error": 529,
}


def event_error(obj: Mapping[str, Any], secrets: tuple[str, ...], fields: Any = None) -> APIError:
    """The error ending a translated stream whose upstream sent an error event of its own
    (``obj``: the event's parsed data, OpenAI's ``{"error": {...}}`` or Anthropic's
    ``{"type": "error", "error": {...}}``), by the rule of ``redact.upstream_error`` (the
    chat relay's, which passes the event on scrubbed): a 4xx-class error keeps the
    upstream's ``message``, ``type``, ``param`` and ``code`` with ``secrets`` scrubbed (and
    the translated request's fields in the client's words, ``fields``); a 5xx-class one is
    the gateway's words, ``the upstream ended its stream with an error`` and its type and
    code where they are identifiers. The class: the error's ``code`` when an HTTP status
    (400-599, as vLLM sends it), else by its ``type`` (``_TYPE_STATUS``), else 5xx."""
    err = upstream_error_fields(dict(obj)) or {}
    code, etype = err.get("code"), err.get("type")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        status = code
    else:
        status = _TYPE_STATUS.get(etype, 500) if isinstance(etype, str) else 500
    error = upstream_error(status, json.dumps(dict(obj)).encode(), {}, secrets, fields)
    if status >= 500:
        said = error.message.removeprefix(f"the upstream answered HTTP {status}")
        error.message = "the upstream ended its stream with an error" + said
    return error


def broke_mid_stream(exc: BaseException) -> str:
    """What a stream's cut says when the upstream connection failed under it (``exc``)."""
    return f"the upstream connection broke mid-stream: {type(exc).__name__}"


def mid_stream_error(exc: BaseException, idle_timeout_s: float) -> APIError:
    """The error ending a stream whose upstream read failed with ``exc``: a read that waited
    ``idle_timeout_s`` (aiohttp's ``sock_read``, a ``TimeoutError``) is a 504
    ``upstream_timeout`` saying so, as the chat relay's; any other failure a 502
    ``upstream_error`` (``broke_mid_stream``)."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
        return APIError(
            504, f"the upstream sent nothing for {idle_timeout_s:g} s", code="upstream_timeout"
        )
    return APIError(502, broke_mid_stream(exc), code="upstream_error")


def stream_error(message: str, code: str = "upstream_error") -> bytes:
    """The in-band error event that ends a broken stream."""
    return encode_event(APIError(502, message, code=code, type="upstream_error").body())


def _tapped(tap: UsageTap | None, events: bytes) -> bytes:
    return events if tap is None or not events else tap.feed(events)


async def relay_sse(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    keepalive_s: float,
    idle_timeout_s: float,
    tap: UsageTap | None = None,
    tail: bytearray | None = None,
    checker: EventChecker | None = None,
    secrets: tuple[str, ...] = (),
) -> web.StreamResponse:
    """Relay ``resp``'s SSE stream to the client, checked (see the module docstring); whole
    events pass through ``tap`` when given (it reads their usage, see ``usage``).
    ``checker``: the route's (``EventChecker(chunk_model, require_finish)``), else one that
    checks SSE framing and JSON only; its ``broken`` says afterwards why the stream broke.
    ``secrets``: credentials scrubbed from every relayed event (``redact.scrub``: an
    upstream's error event may quote the key it was sent).

    ``tail``, when given, is left holding the stream's last 4 KiB as relayed (where its
    usage chunk is, for cache-aware routing). The upstream's ``x-prefixgate-cache`` header
    goes on (``passed_cache_header``).

    An encoded stream arrives decoded (the upstream session undoes gzip, deflate, br and
    zstd) and is sent as identity.
    Returns the (ended) client response; leaves when the client goes away.

    Raises:
        APIError: 502 for a stream in another encoding (it cannot be checked).
    """
    encoding = resp.headers.get("Content-Encoding", "identity").lower()
    if encoding not in DECODED:
        raise APIError(
            502,
            f"the upstream's stream is {encoding}-encoded and cannot be checked",
            code="upstream_error",
        )
    out = web.StreamResponse(
        status=resp.status, headers={**SSE_HEADERS, **passed_cache_header(resp.headers)}
    )
    await out.prepare(request)
    checker = checker if checker is not None else EventChecker()
    error: bytes | None = None
    code = "upstream_error"  # the error event's code, when there is one
    reads = upstream_reads(resp, keepalive_s, idle_timeout_s)
    try:
        while not checker.done:
            try:
                chunk = await anext(reads, b"")
            except TimeoutError:
                raise StreamBroken(
                    f"the upstream sent nothing for {idle_timeout_s:g} s", code="upstream_timeout"
                ) from None
            if chunk is None:  # silent for keepalive_s
                await out.write(KEEPALIVE)
                continue
            if not chunk:  # the upstream ended its response
                raise StreamBroken("the upstream's stream ended before its last event ([DONE])")
            passed = _tapped(tap, checker.feed(chunk))
            if passed and secrets:
                passed = scrub(passed, secrets)
            if passed:
                await out.write(passed)
                if tail is not None:
                    tail += passed
                    del tail[:-4096]
    except StreamBroken as exc:
        checker.broken = str(exc)
        error, code = stream_error(str(exc), exc.code), exc.code
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        if client_gone(request):  # a write to the client failed: aiohttp's
            return client_left(out)  # ClientConnectionResetError is a ClientConnectionError too
        checker.broken = broke_mid_stream(exc)
        error = stream_error(checker.broken)
    except ConnectionResetError:
        return client_left(out)  # leaving closes the upstream connection
    if error is not None:
        logger.warning("upstream stream broken: %s", error[6:].decode(errors="replace").strip())
        stream_cut(request, code)
    return await end_stream(out, error)


def json_body_problem(
    data: bytes, headers: Any, model: type[BaseModel] | None = None
) -> str | None:
    """Why an upstream's 200 body is not the JSON object it must be — with ``model``, one
    that validates as it (``answers.shape_problem``) — None when it is (``data`` decoded: the
    upstream session undoes its ``Content-Encoding``)."""
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        ctype = headers.get("Content-Type", "no content type")
        return f"a body that is not JSON ({ctype.split(';')[0]}, {len(data)} bytes)"
    if not isinstance(parsed, dict):
        return "a JSON body that is not an object"
    return shape_problem(parsed, model) if model is not None else None
