"""Typed errors of the SDK, shaped like openai-python's exception hierarchy.

::

    PrefixgateError
    ├── LengthFinishReasonError       parse(): the answer was cut at max_tokens, cannot parse
    ├── ContentFilterFinishReasonError  parse(): the answer was withheld by a content filter
    ├── APIError                      anything the API call produced
    │   ├── APIConnectionError        no usable response (refused, reset, dropped mid-body)
    │   │   └── APITimeoutError       connect/read/pool timeout, or stream idle timeout
    │   ├── APIResponseValidationError  a 2xx body that is not the expected JSON
    │   └── APIStatusError            a non-2xx status; one subclass per status below
    │       ├── BadRequestError (400)       ├── UnprocessableEntityError (422)
    │       ├── AuthenticationError (401)   ├── RateLimitError (429)
    │       ├── PermissionDeniedError (403) ├── InternalServerError (>= 500)
    │       ├── NotFoundError (404)         └── (other statuses: APIStatusError itself)
    │       └── ConflictError (409)

Error bodies are OpenAI error objects ``{"error": {message, type, param, code}}``
(https://platform.openai.com/docs/guides/error-codes); other bodies are tolerated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from .types import ChatCompletion

__all__ = [
    "PrefixgateError",
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "UnprocessableEntityError",
    "RateLimitError",
    "InternalServerError",
    "LengthFinishReasonError",
    "ContentFilterFinishReasonError",
]  # the error classes, re-exported by prefixgate.sdk (status_error is the client's helper)


class PrefixgateError(Exception):
    """Base class of every error the SDK raises on purpose."""


class LengthFinishReasonError(PrefixgateError):
    """``chat.completions.parse``: a choice ended with ``finish_reason == "length"`` (cut at
    ``max_tokens`` / the context), so its JSON is incomplete and cannot be parsed (as
    openai-python). Raise ``max_tokens`` or shorten the prompt.

    Attributes:
        completion: the ``ChatCompletion`` as received.
    """

    def __init__(self, *, completion: ChatCompletion) -> None:
        msg = "Could not parse response content as the length limit was reached"
        if completion.usage is not None:
            msg += f" - {completion.usage!r}"
        super().__init__(msg)
        self.completion = completion


class ContentFilterFinishReasonError(PrefixgateError):
    """``chat.completions.parse``: a choice ended with ``finish_reason == "content_filter"``.

    Attributes:
        completion: the ``ChatCompletion`` as received.
    """

    def __init__(self, *, completion: ChatCompletion) -> None:
        super().__init__(
            "Could not parse response content as the request was rejected by the content filter"
        )
        self.completion = completion


class APIError(PrefixgateError):
    """An API call failed.

    Attributes:
        message: human-readable text.
        request: the ``httpx.Request`` sent (None when the failure came before sending).
        body: the decoded error body (dict) or raw text, if any.
        type / param / code: the OpenAI error object's fields, when the server sent one.
    """

    def __init__(
        self, message: str, request: httpx.Request | None = None, *, body: Any = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request = request
        self.body = body
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        self.type: str | None = err.get("type")
        self.param: str | None = err.get("param")
        self.code: str | None = err.get("code")


class APIConnectionError(APIError):
    """The server gave no usable answer: connection refused/reset, or dropped mid-body."""

    def __init__(self, message: str = "Connection error.", request: httpx.Request | None = None):
        super().__init__(message, request)


class APITimeoutError(APIConnectionError):
    """A connect, read, write or pool timeout, or no stream chunk within the idle timeout."""

    def __init__(self, message: str = "Request timed out.", request: httpx.Request | None = None):
        super().__init__(message, request)


class APIResponseValidationError(APIError):
    """A 2xx response whose body is not the JSON the endpoint promises."""

    def __init__(self, message: str, response: httpx.Response, *, body: Any = None) -> None:
        super().__init__(message, response.request, body=body)
        self.response = response
        self.status_code = response.status_code


class APIStatusError(APIError):
    """The server answered a non-2xx status.

    Attributes:
        response: the ``httpx.Response`` (body already read).
        status_code: its HTTP status.
        request_id: the ``x-request-id`` header, if any.
        retry_after: seconds the server asked to wait (``retry-after-ms`` / ``Retry-After``),
            or None; parsed by the retry policy.
        flow_control: a 429 met by a client with ``adaptive_concurrency``: a signal its AIMD
            limit answers, retried without spending ``max_retries`` while the call is younger
            than ``RetryPolicy.max_retry_after`` seconds.
    """

    def __init__(self, message: str, *, response: httpx.Response, body: Any = None) -> None:
        super().__init__(message, response.request, body=body)
        self.response = response
        self.status_code = response.status_code
        self.request_id = response.headers.get("x-request-id")
        self.retry_after: float | None = None
        self.flow_control = False


class BadRequestError(APIStatusError):
    """400: the request is malformed (bad field, unknown parameter, prompt too long...)."""


class AuthenticationError(APIStatusError):
    """401: missing or wrong API key."""


class PermissionDeniedError(APIStatusError):
    """403: the key may not do this."""


class NotFoundError(APIStatusError):
    """404: unknown route, model or prefix."""


class ConflictError(APIStatusError):
    """409: conflicting concurrent change (retried)."""


class UnprocessableEntityError(APIStatusError):
    """422: well-formed but unprocessable request."""


class RateLimitError(APIStatusError):
    """429: over a rate limit or the server is overloaded (retried, honouring Retry-After)."""


class InternalServerError(APIStatusError):
    """>= 500: the server failed (retried)."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def status_error(response: httpx.Response, body: Any) -> APIStatusError:
    """Build the typed error for a non-2xx ``response`` whose body decoded to ``body``.

    The message is the OpenAI error object's ``message`` when there is one, else the raw body
    (truncated to 500 characters) or the reason phrase.
    """
    status = response.status_code
    cls = _BY_STATUS.get(status)
    if cls is None:
        cls = InternalServerError if status >= 500 else APIStatusError
    message = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            message = err.get("message")
        elif isinstance(err, str):
            message = err
    if not message:
        message = str(body)[:500] if body else response.reason_phrase
    return cls(f"Error code: {status} - {message}", response=response, body=body)
