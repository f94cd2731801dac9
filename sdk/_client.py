"""``AsyncClient``: one HTTP pool, one concurrency limiter, one retry policy for all its calls.

Each call runs tenacity's retry loop (``RetryPolicy``); each attempt waits for the rate limiter
(if any), takes a concurrency slot, sends the request and holds the slot until the response is
read (or, streaming, until the stream closes). The slot is not held while a retry waits, so
backing-off requests do not block fresh ones; a retry is queued ahead of first attempts, so
they cannot starve it either. An attempt that never reached the server (cancelled or failed
while it waited in a limiter, or before sending) gives its rate-limit charge back. The httpx pool has exactly ``max_concurrency``
connections: the limiter admits no more requests than connections, so an attempt never queues
for a connection (no httpx#1171-style ``PoolTimeout`` after cancellations: cancelled attempts
close their response shielded from the cancellation and release their slot in ``finally``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Self, TypedDict, TypeVar

import anyio
import httpx

from ._options import RequestOptions, Timeout, check_seconds
from ._response import APIResponse, AsyncAPIResponse, response_mode
from .errors import (
    APIConnectionError,
    APIResponseValidationError,
    APITimeoutError,
    RateLimitError,
    status_error,
)
from .flow_control import Charge, ConcurrencyLimiter, RateLimit, RateLimiter, estimate_tokens
from .resources import (
    AsyncChat,
    AsyncCompletions,
    AsyncEmbeddings,
    AsyncModels,
    AsyncPrefixes,
    AsyncResponses,
)
from .retry import PROMISE_HEADER, RetryPolicy, parse_retry_after
from .streaming import AsyncStream

__all__ = [
    "AsyncClient",
    "ClientOptions",
    "CopyOptions",
    "RequestOptions",
    "DEFAULT_TIMEOUT",
    "DEFAULT_BASE_URL",
]

T = TypeVar("T")

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
# openai-python's defaults: 10 min for a whole generation, 5 s to connect.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
_VERSION = "0.1.0"


@contextmanager
def _map_httpx_errors(request: httpx.Request | None) -> Iterator[None]:
    """Translate httpx transport failures into the SDK's connection/timeout errors."""
    try:
        yield
    except (httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:
        # Our own request cannot be sent (a header value with CR/LF, a bad URL): a caller's
        # mistake that no retry fixes, not a connection failure.
        raise ValueError(f"invalid request: {exc}") from exc
    except httpx.TimeoutException as exc:
        raise APITimeoutError(f"Request timed out: {exc!r}", request) from exc
    except httpx.TransportError as exc:
        raise APIConnectionError(f"Connection error: {exc!r}", request) from exc


class ClientOptions(TypedDict, total=False):
    """The keyword-only options of ``AsyncClient`` (defaults and meanings there), which the
    blocking ``Client`` takes and hands over as they are."""

    max_concurrency: int
    max_retries: int | None
    timeout: Timeout
    rate_limit: RateLimit | None
    adaptive_concurrency: bool
    retry_policy: RetryPolicy | None
    stream_idle_timeout: float | None
    default_headers: Mapping[str, str] | None
    http_client: httpx.AsyncClient | None


class CopyOptions(TypedDict, total=False):
    """What ``with_options`` may change (see ``AsyncClient.with_options``); None keeps it."""

    base_url: str | None
    api_key: str | None
    timeout: Timeout | None
    max_retries: int | None
    stream_idle_timeout: float | None
    default_headers: Mapping[str, str] | None


class AsyncClient:
    """Async client of an OpenAI-compatible server (the prefixgate gateway or any other).

    Args:
        base_url: API root including ``/v1``; default ``$PREFIXGATE_BASE_URL``, else
            ``$OPENAI_BASE_URL`` (openai-python's variable), else ``http://127.0.0.1:8000/v1``.
        api_key: sent as ``Authorization: Bearer``; default ``$PREFIXGATE_API_KEY``, else
            ``$OPENAI_API_KEY`` (none: no header, for a local gateway without keys).
        max_concurrency: most requests of this client in flight at once (all calls share it);
            also the size of the HTTP connection pool.
        max_retries: retries after the first attempt (None: the policy's, default 2; see
            ``RetryPolicy``).
        timeout: seconds or ``httpx.Timeout`` per attempt (default 600 s, 5 s to connect).
        rate_limit: optional client-side ``RateLimit`` (requests/min, tokens/min).
        adaptive_concurrency: shrink the in-flight limit on 429 and grow it back (AIMD); a
            429 is then flow control, retried without spending ``max_retries`` while the call
            is younger than ``RetryPolicy.max_retry_after`` seconds.
        retry_policy: backoff parameters and the injectable sleep/clock/rng; ``max_retries``
            overrides its count when given.
        stream_idle_timeout: default seconds allowed between two stream chunks (None: the
            read timeout).
        default_headers: headers sent with every request.
        http_client: your own ``httpx.AsyncClient`` (then you size its pool).

    Raises:
        ValueError: bad limits, a ``base_url`` that is not an http(s) URL, an ``api_key`` with
            control characters, a negative timeout.
        TypeError: an option of the wrong type.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        max_concurrency: int = 64,
        max_retries: int | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        rate_limit: RateLimit | None = None,
        adaptive_concurrency: bool = False,
        retry_policy: RetryPolicy | None = None,
        stream_idle_timeout: float | None = None,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        base_url = (
            base_url
            or os.environ.get("PREFIXGATE_BASE_URL")
            or os.environ.get("OPENAI_BASE_URL")
            or DEFAULT_BASE_URL
        )
        self.base_url = _checked_base_url(base_url)
        if api_key is None:
            api_key = os.environ.get("PREFIXGATE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self.api_key = api_key
        _check_header_value("api_key", self.api_key)
        self.timeout = _checked_timeout(timeout)
        check_seconds("stream_idle_timeout", stream_idle_timeout)
        policy = retry_policy or RetryPolicy()
        if max_retries is not None:
            policy = dataclasses.replace(policy, max_retries=max_retries)
        self.retry_policy = policy
        self.limiter = ConcurrencyLimiter(max_concurrency, adaptive=adaptive_concurrency)
        self.rate_limiter = (
            RateLimiter(rate_limit, sleep=policy.sleep) if rate_limit is not None else None
        )
        self.stream_idle_timeout = stream_idle_timeout
        self._default_headers = dict(default_headers or {})
        self._headers = self._make_headers()
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(
            timeout=self.timeout,
            limits=httpx.Limits(
                max_connections=max_concurrency, max_keepalive_connections=max_concurrency
            ),
        )
        self._bind_resources()

    def _bind_resources(self) -> None:
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)
        self.models = AsyncModels(self)
        self.prefixes = AsyncPrefixes(self)
        self.responses = AsyncResponses(self)
        self.embeddings = AsyncEmbeddings(self)

    def _make_headers(self) -> dict[str, str]:
        headers = {"User-Agent": f"prefixgate-sdk/{_VERSION}", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(self._default_headers)
        return headers

    def with_options(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        stream_idle_timeout: float | None = None,
        default_headers: Mapping[str, str] | None = None,
    ) -> AsyncClient:
        """A copy of this client with some options changed (openai-python's ``with_options``).

        The copy shares the connection pool, the concurrency limiter and the rate limiter (one
        budget for both), so ``client.with_options(timeout=5).chat.completions.create(...)``
        is cheap; closing the copy leaves the pool open. ``default_headers`` are merged into
        this client's.

        Raises:
            ValueError / TypeError: as the constructor.
        """
        new = copy.copy(self)
        new._owns_http = False
        if base_url is not None:
            new.base_url = _checked_base_url(base_url)
        if api_key is not None:
            _check_header_value("api_key", api_key)
            new.api_key = api_key
        if timeout is not None:
            new.timeout = _checked_timeout(timeout)
        if max_retries is not None:
            new.retry_policy = dataclasses.replace(self.retry_policy, max_retries=max_retries)
        if stream_idle_timeout is not None:
            check_seconds("stream_idle_timeout", stream_idle_timeout)
            new.stream_idle_timeout = stream_idle_timeout
        if default_headers is not None:
            new._default_headers = {**self._default_headers, **default_headers}
        new._headers = new._make_headers()
        new._bind_resources()
        return new

    copy = with_options

    @property
    def max_concurrency(self) -> int:
        """The ceiling of requests in flight."""
        return self.limiter.max_concurrency

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool (only when the client created it)."""
        if self._owns_http:
            await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        cast: Callable[[Any], T],
        body: Mapping[str, Any] | None = None,
        stream: bool = False,
        options: RequestOptions | None = None,
        end_events: frozenset[str] | None = None,
    ) -> Any:
        """Send one API call with retries; return ``cast(json)`` or an ``AsyncStream[T]``.

        Args:
            method: HTTP method.
            path: path under ``base_url`` (``"chat/completions"``).
            cast: builds the typed result (or each stream chunk) from decoded JSON.
            body: JSON body; ``options.extra_body`` is merged into it.
            stream: return an ``AsyncStream`` of ``cast`` chunks (never retried once returned).
            end_events: a stream that ends with one of these event ``type``s instead of
                ``data: [DONE]`` (``AsyncStream.end_events``: the Responses API's).

        Raises:
            APIStatusError: a non-2xx answer (its subclass per status) after the retries.
            APIConnectionError / APITimeoutError: no answer after the retries.
            APIResponseValidationError: a 2xx answer that is not JSON.
        """
        opts = options or RequestOptions()
        mode = response_mode.get()
        payload: dict[str, Any] | None = None
        if body is not None or opts.extra_body:
            payload = dict(body or {})
            payload.update(opts.extra_body or {})
        tokens = estimate_tokens(payload) if payload is not None and self.rate_limiter else 0
        retrying = self.retry_policy.retrying(opts.max_retries)
        async for attempt in retrying:
            with attempt:
                retry = attempt.retry_state.attempt_number > 1
                return await self._attempt(
                    method, path, payload, cast, stream, opts, tokens, retry, mode, end_events
                )
        raise AssertionError("unreachable: tenacity re-raises the last error")  # pragma: no cover

    def _build(
        self, method: str, path: str, payload: dict[str, Any] | None, opts: RequestOptions
    ) -> httpx.Request:
        headers = dict(self._headers)
        if opts.extra_headers:
            headers.update(opts.extra_headers)
        timeout = opts.timeout if opts.timeout is not None else self.timeout
        return self._http.build_request(
            method,
            self.base_url.join(path.lstrip("/")),
            json=payload,
            params=opts.extra_query,
            headers=headers,
            timeout=timeout,
        )

    async def _attempt(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None,
        cast: Callable[[Any], T],
        stream: bool,
        opts: RequestOptions,
        tokens: int,
        retry: bool,
        mode: str,
        end_events: frozenset[str] | None = None,
    ) -> Any:
        charge: Charge | None = None
        if self.rate_limiter is not None:
            charge = await self.rate_limiter.acquire(tokens)
        try:
            slot = await self.limiter.acquire(retry=retry)
            request = self._build(method, path, payload, opts)
        except BaseException:
            # Never reached the server (cancelled or failed while waiting, or an unsendable
            # request): it costs no rate budget.
            if charge is not None:
                self.rate_limiter.refund(charge)  # type: ignore[union-attr]
            raise
        handed_off = False
        response: httpx.Response | None = None
        try:
            with _map_httpx_errors(request):
                response = await self._http.send(request, stream=True)
                if not response.is_success:
                    await response.aread()
                    err = status_error(response, _decode(response))
                    if isinstance(err, RateLimitError):
                        err.retry_after = parse_retry_after(
                            response.headers, self.retry_policy.clock()
                        )
                        # new attempts held for the hint, capped as a retry's own wait is
                        # (a promised slot up to 600 s away is that one request's)
                        hold = err.retry_after
                        if hold is not None:
                            hold = min(hold, self.retry_policy.max_retry_after)
                        promised = response.headers.get(PROMISE_HEADER) is not None
                        if promised and not self.retry_policy.retryable(err):
                            hold = None  # raised at once: a place past the cap held for that
                            # one request, which nobody else waits for
                        self.limiter.on_overload(slot, hold)
                        err.flow_control = self.limiter.adaptive
                    raise err
                if stream or mode == "streaming":
                    self.limiter.on_success(slot)
                    handed_off = True
                    release = _releaser(self.limiter, slot)
                    chunks = AsyncStream(
                        response,
                        cast,
                        idle_timeout=self._idle_timeout(opts),
                        on_close=release,
                        end_events=end_events,
                    )
                    if mode == "streaming":
                        return AsyncAPIResponse(chunks, stream=stream)
                    return APIResponse(response, chunks) if mode == "raw" else chunks
                await response.aread()
            data = _decode(response)
            if not isinstance(data, (dict, list)):
                raise APIResponseValidationError(
                    f"Expected a JSON body, got {response.text[:200]!r}", response, body=data
                )
            self.limiter.on_success(slot)
            if self.rate_limiter is not None and isinstance(data, dict):
                usage = data.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
                    self.rate_limiter.correct(tokens, usage["total_tokens"])
            try:
                result = cast(data)
            except (TypeError, ValueError) as exc:
                raise APIResponseValidationError(
                    f"Unexpected response shape: {exc}", response, body=data
                ) from exc
            return APIResponse(response, result) if mode == "raw" else result
        finally:
            if not handed_off:
                if response is not None:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
                self.limiter.release(slot)

    def _idle_timeout(self, opts: RequestOptions) -> float | None:
        if opts.idle_timeout is not None:
            return opts.idle_timeout
        if self.stream_idle_timeout is not None:
            return self.stream_idle_timeout
        timeout = opts.timeout if opts.timeout is not None else self.timeout
        return timeout.read if isinstance(timeout, httpx.Timeout) else timeout


def _checked_base_url(base_url: str) -> httpx.URL:
    """``base_url`` with one trailing slash; ValueError unless an http(s) URL with a host."""
    if not isinstance(base_url, str):
        raise TypeError(f"base_url must be a str, got {type(base_url).__name__}")
    try:
        url = httpx.URL(base_url.rstrip("/") + "/")
    except httpx.InvalidURL as exc:
        raise ValueError(f"base_url {base_url!r} is not a URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(
            f"base_url must be an http:// or https:// URL with a host, got {base_url!r}"
        )
    return url


def _check_header_value(name: str, value: Any) -> None:
    """TypeError unless ``value`` is None or a str; ValueError on control characters (a CR/LF
    would end the header: httpx refuses it at send time, after the call has started)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"{name} must not hold control characters (CR, LF, NUL, ...)")


def _checked_timeout(timeout: Any) -> httpx.Timeout:
    """``timeout`` (seconds or ``httpx.Timeout``) as an ``httpx.Timeout``."""
    if isinstance(timeout, httpx.Timeout):
        return timeout
    check_seconds("timeout", timeout)
    return httpx.Timeout(timeout)


def _releaser(limiter: ConcurrencyLimiter, slot: Any) -> Callable[[], None]:
    """A callback that gives ``slot`` back to ``limiter`` (for a stream's close)."""
    return lambda: limiter.release(slot)


def _decode(response: httpx.Response) -> Any:
    """The body as JSON, else as text (None when empty)."""
    if not response.content:
        return None
    try:
        return json.loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text
