"""The SDK against servers that misbehave on loopback: non-object stream chunks, a dead port,
ids that would leave their path, bad client options, a bad header."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.sdk import AsyncClient
from prefixgate.sdk.errors import APIConnectionError, APIResponseValidationError
from support.net import free_port


def _garbage_app() -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + request.match_info["payload"].encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/{payload}/v1/chat/completions", stream)
    return app


def test_sdk_stream_of_non_object_chunks_is_a_validation_error():
    # `data: [1, 2]` raised a bare TypeError out of the SDK's stream (a non-stream body of the
    # same shape gives APIResponseValidationError).
    with BackgroundServer(_garbage_app) as srv:

        async def main():
            for payload in ("[1,2]", "5", "null", '"text"'):
                async with AsyncClient(
                    f"{srv.url}/{payload}/v1", max_retries=0, timeout=5
                ) as client:
                    stream = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                    )
                    with pytest.raises(APIResponseValidationError):
                        async for _ in stream:
                            pass
                    assert client.limiter.in_flight == 0  # the slot came back

        asyncio.run(main())


def test_sdk_dead_port_is_a_connection_error():
    port = free_port()  # nobody listens there

    async def main():
        async with AsyncClient(f"http://127.0.0.1:{port}/v1", max_retries=1, timeout=2) as c:
            with pytest.raises(APIConnectionError):
                await c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}]
                )
            with pytest.raises(APIConnectionError):
                await c.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "x"}]
                )

    asyncio.run(main())


def test_sdk_ids_cannot_leave_their_path():
    # prefixes.get("../models") sent GET /v1/models (and parsed the model list as a Prefix);
    # "a?x=1" became a query string. Ids are one percent-encoded path segment.
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path)
        return httpx.Response(
            404,
            json={
                "error": {
                    "message": "no",
                    "type": "not_found_error",
                    "param": None,
                    "code": "prefix_not_found",
                }
            },
        )

    async def main():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with AsyncClient("http://gw/v1", max_retries=0, http_client=http) as client:
            for pid in ("../models", "..", ".", "a/b", "a?x=1", "a#b", "ok-1"):
                for call in (client.prefixes.get, client.prefixes.delete):
                    with pytest.raises(Exception, match="404"):
                        await call(pid)
            for model in ("../prefixes/x", "org/name"):
                with pytest.raises(Exception, match="404"):
                    await client.models.retrieve(model)
        await http.aclose()

    asyncio.run(main())
    prefix_paths = seen[:14]
    assert all(p.startswith(b"/v1/prefixes/") and p.count(b"/") == 3 for p in prefix_paths), seen
    assert b"/v1/prefixes/ok-1" in seen and b"/v1/prefixes/a%3Fx%3D1" in seen
    assert seen[14].startswith(b"/v1/models/") and b"/../" not in seen[14], seen
    assert seen[15] == b"/v1/models/org/name"  # model ids keep their slashes (org/name)


def test_sdk_bad_client_options_fail_at_construction():
    # A base_url without http(s), a key with CR/LF (header injection) or a negative timeout
    # were accepted; each call then failed as a *connection* error and was retried.
    for kw, exc in [
        ({"base_url": "ftp://x/v1"}, ValueError),
        ({"base_url": "not a url"}, ValueError),
        ({"api_key": "sk\r\nX-Evil: 1"}, ValueError),
        ({"api_key": 5}, TypeError),
        ({"timeout": -1}, ValueError),
        ({"timeout": "x"}, TypeError),
        ({"stream_idle_timeout": -1}, ValueError),
    ]:
        with pytest.raises(exc):
            AsyncClient(**kw)


def test_sdk_bad_header_is_not_retried_as_a_connection_error():
    sleeps: list[float] = []

    async def no_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    from prefixgate.sdk.retry import RetryPolicy

    with BackgroundServer(_garbage_app) as srv:

        async def main():
            async with AsyncClient(
                f"{srv.url}/x/v1", max_retries=3, retry_policy=RetryPolicy(sleep=no_sleep)
            ) as client:
                with pytest.raises(ValueError):
                    await client.chat.completions.create(
                        model="m",
                        messages=[{"role": "user", "content": "hi"}],
                        extra_headers={"X-Bad": "a\r\nb"},
                    )
                assert client.limiter.in_flight == 0

        asyncio.run(main())
    assert sleeps == []  # a local mistake is final
