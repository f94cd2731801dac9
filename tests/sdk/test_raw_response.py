"""openai-python's response helpers: ``with_raw_response``, ``with_streaming_response``,
``with_options``; ``model_dump`` / ``model_dump_json`` on results."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
import respx
from prefixgate.sdk import (
    APIResponse,
    AsyncAPIResponse,
    AsyncClient,
    AsyncStream,
    Client,
    NotFoundError,
    SyncStream,
)
from prefixgate.sdk.types import ChatCompletion, ChatCompletionChunk, ModelList

from .conftest import BASE, MSG

pytestmark = pytest.mark.anyio
OK = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
SSE = (
    b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
    b'data: {"choices": [{"index": 0, "delta": {"content": "b"}}]}\n\ndata: [DONE]\n\n'
)


def chat_route(request: httpx.Request) -> httpx.Response:
    headers = {"x-request-id": "req-7", "x-ratelimit-remaining-requests": "99"}
    if json.loads(request.content).get("stream"):
        return httpx.Response(200, content=SSE, headers=headers)
    return httpx.Response(200, json=OK, headers=headers)


@respx.mock
async def test_with_raw_response(make_client) -> None:
    respx.post(f"{BASE}/chat/completions").mock(side_effect=chat_route)
    respx.get(f"{BASE}/models/nope").mock(
        return_value=httpx.Response(404, json={"error": {"message": "no such model"}})
    )
    async with make_client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG)
        assert isinstance(raw, APIResponse)
        assert raw.status_code == 200 and raw.request_id == "req-7"
        assert raw.headers["x-ratelimit-remaining-requests"] == "99"
        assert raw.json()["id"] == "c1" and raw.http_request.method == "POST"
        completion = raw.parse()
        assert (
            isinstance(completion, ChatCompletion) and completion.choices[0].message.content == "yo"
        )
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=MSG, stream=True
        )
        stream = raw.parse()
        assert isinstance(stream, AsyncStream) and raw.request_id == "req-7"
        assert [c.choices[0].delta.content async for c in stream] == ["a", "b"]
        with pytest.raises(NotFoundError):  # errors still raise, as openai-python's
            await client.models.with_raw_response.retrieve("nope")
        assert client.limiter.in_flight == 0


@respx.mock
async def test_with_streaming_response_reads_on_demand_and_holds_the_slot(make_client) -> None:
    respx.post(f"{BASE}/chat/completions").mock(side_effect=chat_route)
    async with make_client(max_concurrency=1) as client:
        async with client.chat.completions.with_streaming_response.create(
            model="m", messages=MSG, stream=True
        ) as response:
            assert isinstance(response, AsyncAPIResponse)
            assert response.status_code == 200 and client.limiter.in_flight == 1
            lines = [line async for line in response.iter_lines()]
        assert lines[0].startswith("data: ") and lines[-2] == "data: [DONE]"
        assert client.limiter.in_flight == 0
        async with client.chat.completions.with_streaming_response.create(
            model="m", messages=MSG
        ) as response:
            parsed = await response.parse()
        assert isinstance(parsed, ChatCompletion) and parsed.id == "c1"
        async with client.chat.completions.with_streaming_response.create(
            model="m", messages=MSG, stream=True
        ) as response:
            chunks = await response.parse()
            assert [c.choices[0].delta.content async for c in chunks] == ["a", "b"]
        assert client.limiter.in_flight == 0


@respx.mock
def test_sync_raw_and_streaming_responses() -> None:
    respx.post(f"{BASE}/chat/completions").mock(side_effect=chat_route)
    with Client(BASE, max_concurrency=1) as client:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MSG)
        assert raw.headers["x-request-id"] == "req-7" and raw.parse().id == "c1"
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MSG, stream=True)
        stream = raw.parse()
        assert isinstance(stream, SyncStream)
        assert [c.choices[0].delta.content for c in stream] == ["a", "b"]
        with client.chat.completions.with_streaming_response.create(
            model="m", messages=MSG, stream=True
        ) as response:
            assert response.status_code == 200
            text = "".join(response.iter_text())
        assert text.endswith("data: [DONE]\n\n")
        with client.chat.completions.with_streaming_response.create(model="m", messages=MSG) as r:
            assert r.parse().choices[0].message.content == "yo"
        assert client.async_client.limiter.in_flight == 0


@respx.mock
async def test_with_options_copies_settings_and_shares_pool_and_limits(make_client) -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(side_effect=chat_route)
    other = respx.post("http://other.local/v1/chat/completions").mock(side_effect=chat_route)
    async with make_client(max_concurrency=3) as client:
        fast = client.with_options(
            timeout=2.5, max_retries=0, default_headers={"x-team": "a"}, api_key="sk-copy"
        )
        assert fast.limiter is client.limiter and fast._http is client._http
        assert fast.retry_policy.max_retries == 0 and client.retry_policy.max_retries == 2
        await fast.chat.completions.create(model="m", messages=MSG)
        req = route.calls[0].request
        assert req.extensions["timeout"]["read"] == 2.5
        assert req.headers["x-team"] == "a" and req.headers["authorization"] == "Bearer sk-copy"
        await client.chat.completions.create(model="m", messages=MSG)
        assert "x-team" not in route.calls[1].request.headers
        moved = client.with_options(base_url="http://other.local/v1")
        await moved.chat.completions.create(model="m", messages=MSG)
        assert other.calls.call_count == 1
        await fast.close()  # a copy closes nothing shared
        await client.chat.completions.create(model="m", messages=MSG)
        assert route.calls.call_count == 3


@respx.mock
def test_sync_with_options() -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(side_effect=chat_route)
    with Client(BASE) as client:
        copy = client.with_options(timeout=1.5)
        assert copy.chat.completions.create(model="m", messages=MSG).id == "c1"
        copy.close()  # closes nothing shared
        assert client.chat.completions.create(model="m", messages=MSG).id == "c1"
    assert route.calls[0].request.extensions["timeout"]["read"] == 1.5


@pytest.mark.parametrize(
    ("ours", "theirs", "expected_url", "expected_key"),
    [
        (
            {},
            {"OPENAI_BASE_URL": "http://oa.local/v1", "OPENAI_API_KEY": "sk-oa"},
            "http://oa.local/v1/",
            "sk-oa",
        ),
        (
            {"PREFIXGATE_BASE_URL": "http://pg.local/v1", "PREFIXGATE_API_KEY": "sk-pg"},
            {"OPENAI_BASE_URL": "http://oa.local/v1", "OPENAI_API_KEY": "sk-oa"},
            "http://pg.local/v1/",
            "sk-pg",
        ),
        ({}, {}, "http://127.0.0.1:8000/v1/", None),
    ],
)
def test_env_fallbacks_openai_variables(
    monkeypatch, ours, theirs, expected_url, expected_key
) -> None:
    for name in ("PREFIXGATE_BASE_URL", "PREFIXGATE_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**ours, **theirs}.items():
        monkeypatch.setenv(name, value)
    client = AsyncClient()
    assert str(client.base_url) == expected_url and client.api_key == expected_key
    assert client._headers.get("Authorization") == (
        f"Bearer {expected_key}" if expected_key else None
    )
    explicit = AsyncClient("http://x.local/v1", api_key="sk-arg")
    assert str(explicit.base_url) == "http://x.local/v1/" and explicit.api_key == "sk-arg"


@respx.mock
async def test_env_openai_variables_used_on_the_wire(monkeypatch) -> None:
    for name in ("PREFIXGATE_BASE_URL", "PREFIXGATE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://oa.local/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-oa")
    route = respx.get("http://oa.local/v1/models").mock(
        return_value=httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
    )
    async with AsyncClient() as client:
        models = await client.models.list()
    assert isinstance(models, ModelList) and [m.id for m in models] == ["m"]
    assert route.calls[0].request.headers["authorization"] == "Bearer sk-oa"


def test_model_dump_and_json_on_results() -> None:
    completion = ChatCompletion.model_validate({**OK, "service_tier": "default"})
    dumped = completion.model_dump()
    assert dumped["choices"][0]["message"]["content"] == "yo"
    assert dumped["service_tier"] == "default"  # fields the SDK does not declare survive
    assert json.loads(completion.model_dump_json())["usage"]["total_tokens"] == 4
    assert completion.to_dict() == {**OK, "service_tier": "default"}  # as sent
    assert json.loads(completion.to_json()) == {**OK, "service_tier": "default"}
    chunk = ChatCompletionChunk.model_validate({"choices": [{"delta": {"content": "a"}}]})
    assert chunk.model_dump(exclude_none=True)["choices"][0]["delta"] == {"content": "a"}


async def test_streaming_response_cancelled_frees_the_slot(make_client) -> None:
    """Leaving the block early (cancellation included) closes the response and the slot."""

    class Endless(httpx.AsyncByteStream):
        async def __aiter__(self):
            while True:
                yield b": keep-alive\n\n"
                await anyio.sleep(0.005)

    with respx.mock:
        respx.post(f"{BASE}/chat/completions").mock(
            return_value=httpx.Response(200, stream=Endless())
        )
        async with make_client(max_concurrency=1) as client:
            with anyio.move_on_after(0.1):
                async with client.chat.completions.with_streaming_response.create(
                    model="m", messages=MSG, stream=True
                ) as response:
                    async for _ in response.iter_bytes():
                        pass
            assert client.limiter.in_flight == 0
