"""prefixgate.sdk: an OpenAI-shaped client with bounded concurrency, retries, streaming,
batches and prefix reuse. Depends only on httpx, anyio, tenacity, pydantic and tqdm (never
torch).

    from prefixgate.sdk import AsyncClient

    async with AsyncClient("http://127.0.0.1:8000/v1", max_concurrency=32) as client:
        r = await client.chat.completions.create(model="m", messages=[...])
        print(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)
"""

if __name__ != "prefixgate.sdk":  # the checkout's folder imported by its bare name
    from prefixgate.sdk._bare_name import step_aside

    step_aside(__name__, __file__)
else:
    from . import errors
    from ._client import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, AsyncClient
    from ._options import RequestOptions
    from ._response import APIResponse, AsyncAPIResponse
    from ._sync import Client, SyncAPIResponse, SyncStream
    from .errors import *  # noqa: F403  (the error classes, errors.__all__)
    from .flow_control import ConcurrencyLimiter, RateLimit, RateLimiter
    from .resources import PrefixSession
    from .retry import RetryPolicy, parse_retry_after
    from .streaming import AsyncStream, ServerSentEvent, SSEDecoder

    __all__ = [
        "AsyncClient",
        "Client",
        "RequestOptions",
        "APIResponse",
        "AsyncAPIResponse",
        "SyncAPIResponse",
        "DEFAULT_BASE_URL",
        "DEFAULT_TIMEOUT",
        "AsyncStream",
        "SyncStream",
        "ServerSentEvent",
        "SSEDecoder",
        "PrefixSession",
        "RetryPolicy",
        "parse_retry_after",
        "RateLimit",
        "RateLimiter",
        "ConcurrencyLimiter",
    ]
    __all__ += errors.__all__  # the error classes
