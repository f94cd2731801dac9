"""``AsyncClient``: one HTTP pool, one concurrency limiter, one retry policy for all its calls.

Each call runs tenacity's retry loop (``RetryPolicy``); each attempt waits for the rate limiter
(if any), takes a concurrency slot, sends the request and holds the slot until the response is
read (or, streaming, until the stream closes). The slot is not held while a retry waits, so
backing-off requests do not block fresh ones. The httpx pool has exactly ``max_concurrency``
connections: the limiter admits no more requests than connections, so an attempt never queues
for a connection (no httpx#1171-style ``PoolTimeout`` after cancellations: cancelled attempts
close their response shielded from the cancellation and release their slot in ``finally``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import anyio
import httpx

from .errors import (
    APIConnectionError,
    APIResponseValidationError,
    APITimeoutError,
    RateLimitError,
    status_error,
)
from .limits import ConcurrencyLimiter, RateLimit, RateLimiter, Slot, estimate_tokens
from .retry import RetryPolicy, parse_retry_after
from .streaming import AsyncStream

__all__ = ["AsyncClient", "RequestOptions", "DEFAULT_TIMEOUT", "DEFAULT_BASE_URL"]

T = TypeVar("T")

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
# openai-python's defaults: 10 min for a whole generation, 5 s to connect.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
_VERSION = "0.1.0"


@dataclass(slots=True)
class RequestOptions:
    """Per-call overrides (the ``extra_*`` keywords of every resource method).

    Args:
        extra_headers: headers added to (or overriding) the client's.
        extra_query: query parameters.
        extra_body: fields merged into the JSON body (e.g. ``prefix_id``, ``cache_salt``).
        timeout: seconds or ``httpx.Timeout`` for this call.
        max_retries: retries for this call.
        idle_timeout: stream only: seconds allowed between two chunks.
    """

    extra_headers: Mapping[str, str] | None = None
    extra_query: Mapping[str, Any] | None = None
    extra_body: Mapping[str, Any] | None = None
    timeout: float | httpx.Timeout | None = None
    max_retries: int | None = None
    idle_timeout: float | None = None


@contextmanager
def _map_httpx_errors(request: httpx.Request | None):
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


class AsyncClient:
    """Async client of an OpenAI-compatible server (the prefixgate gateway or any other).

    Args:
        base_url: API root including ``/v1``; default ``$PREFIXGATE_BASE_URL`` or
            ``http://127.0.0.1:8000/v1``.
        api_key: sent as ``Authorization: Bearer``; default ``$PREFIXGATE_API_KEY`` (none: no
            header, for a local gateway without keys).
        max_concurrency: most requests of this client in flight at once (all calls share it);
            also the size of the HTTP connection pool.
        max_retries: retries after the first attempt (None: the policy's, default 2; see
            ``RetryPolicy``).
        timeout: seconds or ``httpx.Timeout`` per attempt (default 600 s, 5 s to connect).
        rate_limit: optional client-side ``RateLimit`` (requests/min, tokens/min).
        adaptive_concurrency: shrink the in-flight limit on 429 and grow it back (AIMD).
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
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        rate_limit: RateLimit | None = None,
        adaptive_concurrency: bool = False,
        retry_policy: RetryPolicy | None = None,
        stream_idle_timeout: float | None = None,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        from .resources import AsyncChat, AsyncCompletions, AsyncModels, AsyncPrefixes

        base_url = base_url or os.environ.get("PREFIXGATE_BASE_URL") or DEFAULT_BASE_URL
        self.base_url = _checked_base_url(base_url)
        self.api_key = api_key if api_key is not None else os.environ.get("PREFIXGATE_API_KEY")
        _check_header_value("api_key", self.api_key)
        _check_seconds("timeout", timeout, httpx.Timeout)
        _check_seconds("stream_idle_timeout", stream_idle_timeout)
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        policy = retry_policy or RetryPolicy()
        if max_retries is not None:
            policy = dataclasses.replace(policy, max_retries=max_retries)
        self.retry_policy = policy
        self.limiter = ConcurrencyLimiter(max_concurrency, adaptive=adaptive_concurrency)
        self.rate_limiter = (
            RateLimiter(rate_limit, sleep=policy.sleep) if rate_limit is not None else None
        )
        self.stream_idle_timeout = stream_idle_timeout
        self._headers = {"User-Agent": f"prefixgate-sdk/{_VERSION}", "Accept": "application/json"}
        if self.api_key:
            self._headers["Authorization"] = f"Bearer {self.api_key}"
        self._headers.update(default_headers or {})
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(
            timeout=self.timeout,
            limits=httpx.Limits(
                max_connections=max_concurrency, max_keepalive_connections=max_concurrency
            ),
        )
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)
        self.models = AsyncModels(self)
        self.prefixes = AsyncPrefixes(self)

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
    ) -> Any:
        """Send one API call with retries; return ``cast(json)`` or an ``AsyncStream[T]``.

        Args:
            method: HTTP method.
            path: path under ``base_url`` (``"chat/completions"``).
            cast: builds the typed result (or each stream chunk) from decoded JSON.
            body: JSON body; ``options.extra_body`` is merged into it.
            stream: return an ``AsyncStream`` of ``cast`` chunks (never retried once returned).

        Raises:
            APIStatusError: a non-2xx answer (its subclass per status) after the retries.
            APIConnectionError / APITimeoutError: no answer after the retries.
            APIResponseValidationError: a 2xx answer that is not JSON.
        """
        opts = options or RequestOptions()
        payload: dict[str, Any] | None = None
        if body is not None or opts.extra_body:
            payload = dict(body or {})
            payload.update(opts.extra_body or {})
        tokens = estimate_tokens(payload) if payload is not None and self.rate_limiter else 0
        retrying = self.retry_policy.retrying(opts.max_retries)
        held: list[Slot] = []  # adaptive mode: the slot a 429'd call keeps for its retry
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._attempt(
                        method, path, payload, cast, stream, opts, tokens, held
                    )
        finally:
            for slot in held:
                self.limiter.release(slot)
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
        held: list[Slot],
    ) -> Any:
        if self.rate_limiter is not None:
            await self.rate_limiter.acquire(tokens)
        slot = held.pop() if held else await self.limiter.acquire()
        keep_slot = False
        handed_off = False
        response: httpx.Response | None = None
        try:
            request = self._build(method, path, payload, opts)
            with _map_httpx_errors(request):
                response = await self._http.send(request, stream=True)
                if not response.is_success:
                    await response.aread()
                    err = status_error(response, _decode(response))
                    if isinstance(err, RateLimitError):
                        err.retry_after = parse_retry_after(
                            response.headers, self.retry_policy.clock()
                        )
                        self.limiter.on_overload(slot, err.retry_after)
                        # Adaptive mode: the call keeps its place for the retry, so the calls
                        # queued behind the limiter cannot starve it of its retries.
                        keep_slot = self.limiter.adaptive
                    raise err
                if stream:
                    self.limiter.on_success()
                    handed_off = True
                    return AsyncStream(
                        response,
                        cast,
                        idle_timeout=self._idle_timeout(opts),
                        on_close=lambda: self.limiter.release(slot),
                    )
                await response.aread()
            data = _decode(response)
            if not isinstance(data, (dict, list)):
                raise APIResponseValidationError(
                    f"Expected a JSON body, got {response.text[:200]!r}", response, body=data
                )
            self.limiter.on_success()
            if self.rate_limiter is not None and isinstance(data, dict):
                usage = data.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
                    self.rate_limiter.correct(tokens, usage["total_tokens"])
            try:
                return cast(data)
            except (TypeError, ValueError) as exc:
                raise APIResponseValidationError(
                    f"Unexpected response shape: {exc}", response, body=data
                ) from exc
        finally:
            if not handed_off:
                if response is not None:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
                if keep_slot:
                    held.append(slot)
                else:
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


def _check_seconds(name: str, value: Any, *also: type) -> None:
    """A duration option: None, or a number >= 0 (or an instance of ``also``)."""
    if value is None or (also and isinstance(value, also)):
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be seconds (a number), got {value!r}")
    if not value >= 0:  # also NaN
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")


def _decode(response: httpx.Response) -> Any:
    """The body as JSON, else as text (None when empty)."""
    if not response.content:
        return None
    try:
        return json.loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text
