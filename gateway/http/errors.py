"""OpenAI error objects and the middleware that turns every failure into one.

Every non-2xx answer of the gateway has the body of the OpenAI API
(https://platform.openai.com/docs/guides/error-codes)::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Status codes: 400 bad input, 401 missing or wrong key, 404 unknown model, route or prefix,
404 also for the prefix API in upstream mode, 405 wrong method, 413 body too large, 417 an ``Expect`` other than 100-continue, 429 overloaded or over a rate limit (with ``Retry-After``
in whole seconds), 500 internal, 502 upstream failure, 503 not ready. A stack trace never
reaches the wire: unexpected exceptions are logged and answered with a generic 500.
Routes of another dialect (``error_dialect``) answer the same errors in that dialect's shape:
Anthropic's ``{"type": "error", "error": {"type", "message"}}``, Gemini's ``{"error":
{"code", "message", "status"}}``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict

logger = logging.getLogger("prefixgate.gateway")


# OpenAI's error ``type`` per status (the values its API and vLLM's server use).
class ErrorObject(BaseModel):
    """The ``error`` of an error body (``errors.APIError`` fills it)."""

    model_config = ConfigDict(extra="allow")
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-2xx body: ``{"error": {message, type, param, code}}``."""

    model_config = ConfigDict(extra="allow")
    error: ErrorObject


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    417: "invalid_request_error",
    501: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# Anthropic's error ``type`` per status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

ANTHROPIC = "anthropic"  # the error dialect of Anthropic's routes (``error_dialect``)
GEMINI = "gemini"  # the error dialect of Gemini's routes (/v1beta)

# Gemini's (google.rpc) ``status`` per HTTP status
# (https://ai.google.dev/gemini-api/docs/troubleshooting#error-codes).
_GEMINI_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    408: "DEADLINE_EXCEEDED",
    409: "ALREADY_EXISTS",
    413: "INVALID_ARGUMENT",
    417: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def error_dialect(dialect: str) -> Callable[[Handler], Handler]:
    """Mark a route handler whose errors take another dialect's body (``ANTHROPIC``, ``GEMINI``):
    ``error_middleware`` reads the mark off the matched route, so the errors raised before
    the handler runs (body limits, ``Expect``) take that shape too."""

    def mark(handler: Handler) -> Handler:
        handler.error_dialect = dialect  # type: ignore[attr-defined]
        return handler

    return mark


# a model name may hold '/'; tunedModels' methods too, as Google serves them
_GEMINI_V1_METHOD = re.compile(r"/v1/(models|tunedModels)/.+:[A-Za-z]+\Z")
# A model method with no API version: a Gemini client whose base URL lacks it (LiteLLM's
# ``gemini/`` models with ``api_base`` the server's root post ``/models/{model}:generateContent``)
_GEMINI_BARE_METHOD = re.compile(r"/(models|tunedModels)/.+:[A-Za-z]+\Z")


def is_gemini_path(path: str) -> bool:
    """Whether ``path`` is Gemini's API: under ``/v1beta/``, a model method under ``/v1``
    (``/v1/models/{model}:{method}``, google-genai's default API version, or a tuned model's)
    or under no version (``/models/{model}:{method}``: a 404 in Gemini's shape saying where
    the routes are), or ``/v1/cachedContents`` (google-genai's caches with that default: a 404
    in Gemini's shape, which the client can read)."""
    return (
        path.startswith("/v1beta/")
        or _GEMINI_V1_METHOD.match(path) is not None
        or _GEMINI_BARE_METHOD.match(path) is not None
        or path == "/v1/cachedContents"
        or path.startswith("/v1/cachedContents/")
    )


def takes_query_key(path: str) -> bool:
    """Whether a request to ``path`` may send its key as ``?key=`` (Gemini's REST form):
    Gemini's paths (``is_gemini_path``) and ``/v1/models[/{model}]``, where Google's REST
    examples list and get the models (``GET /v1/models?key=...``)."""
    return is_gemini_path(path) or path == "/v1/models" or path.startswith("/v1/models/")


def dialect_of_path(path: str) -> str:
    """The error dialect of a path, for answers given before any route matched (aiohttp's
    parser refusing the request): Gemini's on its paths (``is_gemini_path``), Anthropic's on
    ``/v1/messages``, else OpenAI's."""
    if is_gemini_path(path):
        return GEMINI
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    return "openai"


def dialect_of(request: web.Request) -> str:
    """The error dialect of the request's matched route: its handler's ``error_dialect`` mark
    (a dialect, or a function of the request giving one: a route answering each client in
    its own dialect), else ``GEMINI`` on Gemini's paths (``is_gemini_path``), else
    ``"openai"``."""
    handler = getattr(request.match_info, "handler", None)
    mark = getattr(handler, "error_dialect", None)
    if callable(mark):
        return str(mark(request))
    if mark is not None:
        return str(mark)
    return GEMINI if is_gemini_path(request.path) else "openai"


def error_event(request: web.Request, error: APIError) -> bytes:
    """The in-band SSE event ending a stream of ``request`` cut short by ``error``, in its
    route's dialect: OpenAI's ``data: {"error": ...}``, Anthropic's ``event: error``, or
    Gemini's ``data: {"error": {code, message, status}}``."""
    dialect = dialect_of(request)
    if dialect == ANTHROPIC:
        data = json.dumps(error.anthropic_body(), separators=(",", ":"), ensure_ascii=False)
        return f"event: error\ndata: {data}\n\n".encode()
    body = error.gemini_body() if dialect == GEMINI else error.body()
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


ERROR_CODE: web.ResponseKey[str] = web.ResponseKey("prefixgate_error_code", str)


class APIError(Exception):
    """An error answered as an OpenAI error object.

    Args:
        status: HTTP status code.
        message: human-readable message (never a traceback).
        param: the request field at fault, if any.
        code: machine-readable code (e.g. ``"invalid_api_key"``, ``"model_not_found"``).
        retry_after: seconds for the ``Retry-After`` header (rounded up, at least 1) and the
            ``retry-after-ms`` header, if any.
        type: error type; defaults from the status.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers: dict[str, str] = {}  # more response headers (a 405's ``Allow``)
        self.type = type or _TYPES.get(status, "api_error")

    def body(self) -> dict[str, Any]:
        """The OpenAI error object as a dict (``responses.ErrorResponse``)."""
        error = ErrorObject(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=error).model_dump()

    def anthropic_body(self) -> dict[str, Any]:
        """The error in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
        (the error type from the status, as Anthropic's API names it)."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else None)
        return {
            "type": "error",
            "error": {"type": kind or "invalid_request_error", "message": self.message},
        }

    def gemini_body(self) -> dict[str, Any]:
        """The error in Gemini's shape, ``{"error": {"code", "message", "status"}}`` (``code``
        the HTTP status, ``status`` its google.rpc name), plus a ``google.rpc.BadRequest``
        detail naming the field when ``param`` is set, and a ``google.rpc.RetryInfo`` detail
        when ``retry_after`` is (``retryDelay``: the ``retry-after-ms`` header's wait as a JSON
        Duration, ``"14.713s"``; google-genai reads no header, its ``APIError.details`` has it)."""
        error: dict[str, Any] = {
            "code": self.status,
            "message": self.message,
            "status": _GEMINI_STATUS.get(
                self.status, "INTERNAL" if self.status >= 500 else "INVALID_ARGUMENT"
            ),
        }
        details: list[dict[str, Any]] = []
        if self.param:
            details.append(
                {
                    "@type": "type.googleapis.com/google.rpc.BadRequest",
                    "fieldViolations": [{"field": self.param, "description": self.message}],
                }
            )
        if self.retry_after is not None:
            ms = retry_after_headers(self.retry_after)["retry-after-ms"]
            details.append(
                {
                    "@type": "type.googleapis.com/google.rpc.RetryInfo",
                    "retryDelay": f"{int(ms) / 1000.0:g}s",
                }
            )
        if details:
            error["details"] = details
        return {"error": error}

    def response(self, dialect: str = "openai") -> web.Response:
        """The error as an aiohttp JSON response (with ``Retry-After`` when set; a 501 with
        ``x-should-retry: false``, which the OpenAI and Anthropic SDKs obey: a route not
        served here stays so, and they would retry every 5xx); ``dialect`` ``"anthropic"``
        gives Anthropic's body (``anthropic_body``), ``"gemini"`` Gemini's (``gemini_body``),
        else OpenAI's."""
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers.update(retry_after_headers(self.retry_after))
        if self.status == 501:
            headers.setdefault("x-should-retry", "false")
        if dialect == ANTHROPIC:
            body = self.anthropic_body()
        elif dialect == GEMINI:
            body = self.gemini_body()
        else:
            body = self.body()
        resp = web.Response(
            status=self.status,
            body=json.dumps(body).encode(),
            content_type="application/json",
            headers=headers,
        )
        resp[ERROR_CODE] = self.code or self.type  # for the request counter (metrics)
        return resp


def retry_after_seconds(seconds: float) -> int:
    """``Retry-After`` is whole seconds (RFC 9110 §10.2.3): round up, at least 1."""
    return max(1, math.ceil(seconds))


def retry_after_headers(seconds: float) -> dict[str, str]:
    """A wait of ``seconds`` as headers: ``Retry-After`` (whole seconds, rounded up) and
    ``retry-after-ms`` (milliseconds, rounded up, at least 1: the finer one, which the
    OpenAI and Anthropic SDKs and LiteLLM read first)."""
    return {
        "Retry-After": str(retry_after_seconds(seconds)),
        "retry-after-ms": str(max(1, math.ceil(seconds * 1000.0))),
    }


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (a client's input is
    echoed so it can see what was refused, never megabytes of it)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 404 ``not_found_error``."""
    return APIError(404, message, param=param, code=code)


def too_many(message: str, retry_after: float, code: str = "rate_limit_exceeded") -> APIError:
    """A 429 with ``Retry-After``."""
    return APIError(429, message, code=code, retry_after=retry_after)


def from_http_exception(exc: web.HTTPException) -> APIError:
    """Map aiohttp's own HTTP errors (404 route, 405 method, 413 body) to OpenAI errors."""
    status = exc.status
    if status == 413:
        return APIError(
            413, f"request body too large: {exc.text or exc.reason}", code="request_too_large"
        )
    if status == 404:
        return APIError(404, "unknown route", code="not_found")  # the path is not at hand here
    if status == 405:
        return APIError(405, "method not allowed on this route", code="method_not_allowed")
    return APIError(status, exc.reason or "HTTP error")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The routes' ``Expect`` handler: ``100-continue`` as aiohttp does it, anything else an
    OpenAI error 417 (aiohttp's own answers it before any middleware, as plain text, and
    fails with a 500 when the header is not UTF-8)."""
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue":
        if request.version == (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None
    resp = APIError(
        417,
        f"unsupported Expect header {shown(expect)}: only 100-continue is",
        code="expectation_failed",
        type="invalid_request_error",
    ).response(dialect_of(request))
    resp.force_close()  # the body is never read
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every failure of ``handler`` with an OpenAI error object (no tracebacks).

    An answer given without reading the request's body closes the connection after it
    (``Connection: close``): aiohttp would drain that body to reuse the connection, and a body
    it cannot decode (bad gzip) then resets the connection under the client's next request.
    """
    try:
        return _closing_if_unread(request, await handler(request))
    except APIError as exc:
        return _closing_if_unread(request, exc.response(dialect_of(request)))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _closing_if_unread(request, from_http_exception(exc).response(dialect_of(request)))
    except web.RequestPayloadError as exc:
        # The body itself is unreadable (bad Content-Encoding data, broken chunked framing).
        resp = APIError(
            400, f"the request body cannot be read: {_payload_reason(exc)}", code="invalid_body"
        ).response(dialect_of(request))
        resp.force_close()  # the connection's framing is lost: tell the client not to reuse it
        # and aiohttp not to read the rest after answering (that read raised the same error
        # again, logged as an "Unhandled exception" traceback per request)
        request.content.feed_eof()
        return resp
    except ConnectionResetError as exc:
        # The client went away: nothing can be sent anymore.
        logger.debug("client connection ended on %s: %r", request.path, exc)
        raise
    except Exception:  # noqa: BLE001 - logged in full, answered without details
        logger.exception("internal error on %s %s", request.method, request.path)
        return APIError(500, "internal server error", code="internal_error").response(
            dialect_of(request)
        )


def _closing_if_unread(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    if not resp.prepared and request.body_exists and not request.content.is_eof():
        resp.force_close()
    return resp


def _payload_reason(exc: Exception) -> str:
    """aiohttp's payload error text without its "400, message:" prefix, on one line."""
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
    text = " ".join(str(getattr(cause, "message", None) or cause).split())
    return text.removeprefix("400, message: ") or "malformed body"


async def route_miss(request: web.Request) -> APIError:
    """The answer to a request no route took: 405 ``method_not_allowed`` (its ``Allow`` header
    in ``headers``) when another method is served at that path, else 404 ``not_found`` naming
    the method and path (and, for a path without ``/v1``, that the API lives under it).
    Catch-all routes (``{tail}``) are not counted as serving a path."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if "{tail}" in resource.canonical:
            continue
        match, methods = await resource.resolve(request)
        allowed |= methods
    if allowed:
        exc = APIError(
            405,
            f"method {request.method} is not allowed on {request.path[:120]}; "
            f"allowed: {', '.join(sorted(allowed))}",
            code="method_not_allowed",
        )
        exc.headers = {"Allow": ",".join(sorted(allowed))}
        return exc
    hint = ""
    if _GEMINI_BARE_METHOD.match(request.path):
        hint = (
            " (Gemini's routes are under /v1beta: LiteLLM's api_base for a gemini/ model ends "
            "in /v1beta; google-genai's HttpOptions(base_url=...) is the server's root)"
        )
    elif not request.path.startswith(("/v1/", "/v1beta/")) and request.path not in ("/", ""):
        hint = (
            " (the API's routes are under /v1, e.g. /v1/chat/completions: a base URL ends in /v1)"
        )
    elif request.path == "/v1/cachedContents" or request.path.startswith("/v1/cachedContents/"):
        hint = (
            " (Gemini's cachedContents are served under /v1beta, as at Google: google-genai's "
            "HttpOptions(api_version='v1beta'))"
        )
    return APIError(
        404, f"unknown route {request.method} {request.path[:120]}{hint}", code="not_found"
    )
