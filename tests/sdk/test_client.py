"""Client surface: env configuration, headers, models, input validation, the sync Client."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
import respx
from prefixgate.sdk import AsyncClient, Client, SyncStream
from prefixgate.sdk.types import ChatCompletionChunk

from .conftest import BASE, MSG, OK, sent_chat


@pytest.mark.anyio
@respx.mock
async def test_env_base_url_and_api_key(monkeypatch) -> None:
    monkeypatch.setenv("PREFIXGATE_BASE_URL", "http://env.local/v1/")
    monkeypatch.setenv("PREFIXGATE_API_KEY", "sk-env")
    route = respx.get("http://env.local/v1/models").mock(
        return_value=httpx.Response(200, json={"object": "list", "data": [{"id": "aidreams"}]})
    )
    async with AsyncClient() as client:
        models = await client.models.list(extra_headers={"x-test": "1"})
    assert [m.id for m in models] == ["aidreams"]
    req = route.calls[0].request
    assert req.headers["authorization"] == "Bearer sk-env" and req.headers["x-test"] == "1"


@pytest.mark.anyio
@respx.mock
async def test_extra_body_and_passthrough_fields(make_client) -> None:
    async with make_client() as client:
        req = await sent_chat(
            client,
            max_tokens=5,
            temperature=0.0,
            logit_bias={"1": 2},
            extra_body={"cache_salt": "s"},
            extra_query={"q": "1"},
        )
    body = json.loads(req.content)
    assert body == {
        "model": "m",
        "messages": MSG,
        "max_tokens": 5,
        "temperature": 0.0,
        "logit_bias": {"1": 2},
        "cache_salt": "s",
    }
    assert req.url.params["q"] == "1"


@pytest.mark.anyio
async def test_bad_input_raises_before_sending(make_client) -> None:
    async with make_client() as client:
        with pytest.raises(TypeError):
            await client.chat.completions.create(model=3, messages=MSG)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await client.chat.completions.create(model="m", messages=[])
        with pytest.raises(TypeError):
            await client.chat.completions.create(model="m", messages=[{"content": "no role"}])
        with pytest.raises(TypeError):
            await client.completions.create(model="m", prompt=5)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await client.models.list(bogus=1)
        with pytest.raises(TypeError):
            await client.chat.completions.create(model="m", messages=MSG, timeout="soon")
    with pytest.raises(ValueError):
        AsyncClient(BASE, max_concurrency=0)


@respx.mock
def test_sync_client_same_surface() -> None:
    respx.post(f"{BASE}/chat/completions").mock(
        side_effect=lambda req: (
            httpx.Response(200, json=OK)
            if not json.loads(req.content).get("stream")
            else httpx.Response(
                200,
                content=b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
                b'data: {"choices": [{"delta": {"content": "b"}}]}\n\ndata: [DONE]\n\n',
            )
        )
    )
    respx.get(f"{BASE}/models").mock(return_value=httpx.Response(200, json={"data": [{"id": "x"}]}))
    with Client(BASE, max_concurrency=2) as client:
        assert (
            client.chat.completions.create(model="m", messages=MSG).choices[0].message.content
            == "yo"
        )
        stream = client.chat.completions.create(model="m", messages=MSG, stream=True)
        assert isinstance(stream, SyncStream)
        with stream:
            chunks = list(stream)
        assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
        assert "".join(c.choices[0].delta.content for c in chunks) == "ab"
        out = client.chat.completions.batch([{"model": "m", "messages": MSG}] * 5)
        assert len(out) == 5 and all(r.id == "c1" for r in out)
        assert [m.id for m in client.models.list()] == ["x"]
        assert client.async_client.limiter.in_flight == 0


class Endless(httpx.AsyncByteStream):
    """An SSE body that never ends; records whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self):
        while True:
            yield b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
            await anyio.sleep(0.001)

    async def aclose(self) -> None:
        self.closed = True


@respx.mock
def test_sync_stream_break_closes_and_sync_prefix_session(monkeypatch) -> None:
    monkeypatch.delenv("PREFIXGATE_API_KEY", raising=False)
    body = Endless()
    chat = respx.post(f"{BASE}/chat/completions").mock(
        side_effect=[httpx.Response(200, stream=body), httpx.Response(200, json=OK)]
    )
    respx.post(f"{BASE}/prefixes").mock(return_value=httpx.Response(404))
    with Client(BASE, max_concurrency=1) as client:
        for _chunk in client.chat.completions.create(model="m", messages=MSG, stream=True):
            break
        assert body.closed and client.async_client.limiter.in_flight == 0
        with client.prefixes.session("sys", model="m") as s:
            r = s.create("hello")
        assert r.id == "c1" and s.session.supported is False
    sent = json.loads(chat.calls[1].request.content)["messages"]
    assert sent == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    assert "authorization" not in chat.calls[0].request.headers


@pytest.mark.anyio
@respx.mock
async def test_unexpected_2xx_bodies_are_validation_errors(make_client) -> None:
    from prefixgate.sdk import APIResponseValidationError

    respx.post(f"{BASE}/chat/completions").mock(
        side_effect=[
            httpx.Response(200, text="<html>proxy page</html>"),
            httpx.Response(200, json=[1]),
        ]
    )
    async with make_client() as client:
        for _ in range(2):
            with pytest.raises(APIResponseValidationError):
                await client.chat.completions.create(model="m", messages=MSG)
        assert client.limiter.in_flight == 0
