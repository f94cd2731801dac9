"""Raw HTTP responses: ``with_raw_response`` and ``with_streaming_response`` (openai-python's).

``await client.chat.completions.with_raw_response.create(...)`` returns an ``APIResponse``:
the headers, status and body of the HTTP response, and ``parse()`` for the typed result.
``async with client.chat.completions.with_streaming_response.create(...) as r`` yields an
``AsyncAPIResponse`` before its body is read (``iter_lines()``, ``iter_bytes()``, ``await
r.parse()``); leaving the block closes it. Both still raise ``APIStatusError`` for a non-2xx
answer and retry like the plain call. How the call is answered travels to ``AsyncClient.request``
in a context variable (set by the wrappers for the one call, so method signatures stay the
OpenAI ones).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any, Generic, Literal, ParamSpec, TypeVar

import httpx

from .errors import APIResponseValidationError
from .streaming import AsyncStream

__all__ = [
    "APIResponse",
    "AsyncAPIResponse",
    "AsyncResponseContextManager",
    "ResponseMethods",
    "ResponseMode",
    "response_mode",
    "to_raw_response_wrapper",
    "to_streamed_response_wrapper",
]

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

ResponseMode = Literal["parsed", "raw", "streaming"]
response_mode: ContextVar[ResponseMode] = ContextVar(
    "prefixgate_sdk_response_mode", default="parsed"
)
"""How the current call is answered: the typed result, an ``APIResponse`` or an
``AsyncAPIResponse`` (read by ``AsyncClient.request`` when the call starts)."""


class _ResponseInfo:
    """The HTTP facts common to both response wrappers."""

    http_response: httpx.Response

    @property
    def headers(self) -> httpx.Headers:
        """Response headers (case-insensitive)."""
        return self.http_response.headers

    @property
    def status_code(self) -> int:
        return self.http_response.status_code

    @property
    def http_request(self) -> httpx.Request:
        return self.http_response.request

    @property
    def url(self) -> httpx.URL:
        return self.http_response.request.url

    @property
    def method(self) -> str:
        return self.http_response.request.method

    @property
    def http_version(self) -> str:
        return self.http_response.http_version

    @property
    def request_id(self) -> str | None:
        """The server's ``x-request-id`` header, if any."""
        request_id: str | None = self.http_response.headers.get("x-request-id")
        return request_id

    @property
    def elapsed(self) -> datetime.timedelta:
        """Time from sending the request to the end of the response."""
        return self.http_response.elapsed

    @property
    def is_closed(self) -> bool:
        return self.http_response.is_closed

    def __repr__(self) -> str:
        return f"<{type(self).__name__} [{self.status_code}] {self.method} {self.url}>"


class APIResponse(_ResponseInfo, Generic[R]):
    """``with_raw_response``'s result: the response (body read) and its typed result.

    For ``stream=True`` the body is not read: ``parse()`` returns the stream.
    """

    def __init__(self, response: httpx.Response, parsed: R) -> None:
        self.http_response = response
        self._parsed = parsed

    def parse(self) -> R:
        """The typed result the plain call would have returned."""
        return self._parsed

    @property
    def content(self) -> bytes:
        return self.http_response.content

    @property
    def text(self) -> str:
        return self.http_response.text

    def json(self) -> Any:
        return self.http_response.json()


class AsyncAPIResponse(_ResponseInfo, Generic[R]):
    """``with_streaming_response``'s response: status and headers known, body not read yet.

    The call's concurrency slot is held until ``close()`` (leaving the ``async with``).

    Args:
        body: the call's response as a chunk stream (closing it frees the slot).
        stream: the call asked for ``stream=True``: ``parse()`` returns ``body`` itself.
    """

    def __init__(self, body: AsyncStream[Any], *, stream: bool) -> None:
        self.http_response = body.response
        self._body = body
        self._stream = stream

    async def parse(self) -> R:
        """The typed result: read the body and build it, or (``stream=True``) the stream.

        Raises:
            APIResponseValidationError: the body is not the expected JSON.
        """
        if self._stream:
            return self._body  # type: ignore[return-value]
        await self.read()
        try:
            data = json.loads(self.http_response.content)
            result: R = self._body.cast(data)
            return result
        except (TypeError, ValueError) as exc:
            raise APIResponseValidationError(
                f"Unexpected response shape: {exc}", self.http_response
            ) from exc

    async def read(self) -> bytes:
        """The whole body."""
        return await self.http_response.aread()

    async def text(self) -> str:
        await self.read()
        return self.http_response.text

    async def json(self) -> Any:
        await self.read()
        return self.http_response.json()

    async def iter_bytes(self, chunk_size: int | None = None) -> AsyncGenerator[bytes, None]:
        async for chunk in self.http_response.aiter_bytes(chunk_size):
            yield chunk

    async def iter_text(self, chunk_size: int | None = None) -> AsyncGenerator[str, None]:
        async for chunk in self.http_response.aiter_text(chunk_size):
            yield chunk

    async def iter_lines(self) -> AsyncGenerator[str, None]:
        async for line in self.http_response.aiter_lines():
            yield line

    async def close(self) -> None:
        """Close the response and free the call's concurrency slot (idempotent)."""
        await self._body.close()


class AsyncResponseContextManager(Generic[T]):
    """``async with`` around a pending ``AsyncAPIResponse`` call: closes it on exit."""

    def __init__(self, call: Awaitable[AsyncAPIResponse[T]]) -> None:
        self._call = call
        self._response: AsyncAPIResponse[T] | None = None

    async def __aenter__(self) -> AsyncAPIResponse[T]:
        self._response = await self._call
        return self._response

    async def __aexit__(self, *exc_info: object) -> None:
        if self._response is not None:
            await self._response.close()


async def call_in_mode(
    mode: ResponseMode, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
) -> Any:
    """Await ``fn(*args, **kwargs)`` answered as ``mode`` (the variable is reset after)."""
    token = response_mode.set(mode)
    try:
        return await fn(*args, **kwargs)
    finally:
        response_mode.reset(token)


def to_raw_response_wrapper(
    fn: Callable[P, Awaitable[R]],
) -> Callable[P, Awaitable[APIResponse[R]]]:
    """``fn`` (a resource method) returning an ``APIResponse`` around its result."""

    async def wrapped(*args: P.args, **kwargs: P.kwargs) -> APIResponse[R]:
        response: APIResponse[R] = await call_in_mode("raw", fn, *args, **kwargs)
        return response

    wrapped.__doc__ = fn.__doc__
    return wrapped


def to_streamed_response_wrapper(
    fn: Callable[P, Awaitable[R]],
) -> Callable[P, AsyncResponseContextManager[R]]:
    """``fn`` (a resource method) as an ``async with`` of an ``AsyncAPIResponse``."""

    def wrapped(*args: P.args, **kwargs: P.kwargs) -> AsyncResponseContextManager[R]:
        return AsyncResponseContextManager(call_in_mode("streaming", fn, *args, **kwargs))

    wrapped.__doc__ = fn.__doc__
    return wrapped


class ResponseMethods:
    """``with_raw_response`` / ``with_streaming_response`` of a resource (async or blocking):
    the methods of ``resource`` it names, each passed through ``wrap``
    (``to_raw_response_wrapper``, ``to_streamed_response_wrapper`` or the bridge's)."""

    def __init__(
        self, resource: Any, names: Sequence[str], wrap: Callable[[Callable[..., Any]], Any]
    ) -> None:
        for name in names:
            setattr(self, name, wrap(getattr(resource, name)))

    def __getattr__(self, name: str) -> Any:
        """Reached only for a name not set above (it also tells the type checker that the
        methods are set per resource)."""
        raise AttributeError(f"{name!r} has no raw or streamed form on this resource")
