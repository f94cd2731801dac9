"""Request keywords: every field named (an unknown one is a TypeError, nothing sent), the
server-specific rest through ``extra_body``; the sync client has the async one's signatures."""

from __future__ import annotations

import inspect
import json

import httpx
import pytest
import respx
from prefixgate.sdk import AsyncClient, Client
from prefixgate.sdk._options import CallOptions
from prefixgate.sdk._sync import (
    SyncChatCompletions,
    SyncCompletions,
    SyncModels,
    SyncPrefixes,
)
from prefixgate.sdk.resources import (
    AsyncChatCompletions,
    AsyncCompletions,
    AsyncModels,
    AsyncPrefixes,
)
from prefixgate.sdk.resources.chat import ChatCompletionCreateParams, ChatCompletionParseParams
from prefixgate.sdk.resources.completions import CompletionCreateParams
from prefixgate.sdk.resources.prefixes import PrefixCreateParams

from .conftest import BASE, MSG, OK, mock_chat, sent_chat

pytestmark = pytest.mark.anyio

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@respx.mock
async def test_unknown_keywords_are_type_errors_and_send_nothing(make_client) -> None:
    chat = mock_chat()
    comp = respx.post(f"{BASE}/completions").mock(return_value=httpx.Response(200, json=OK))
    async with make_client() as client:
        with pytest.raises(TypeError, match="guided_json"):
            await client.chat.completions.create(model="m", messages=MSG, guided_json={})  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="tool_chioce"):
            await client.chat.completions.create(model="m", messages=MSG, tool_chioce="auto")  # type: ignore[call-overload]
        with pytest.raises(TypeError):
            await client.completions.create(model="m", prompt="p", messages=MSG)  # type: ignore[call-overload]
        with pytest.raises(TypeError):
            await client.models.list(bogus=1)  # type: ignore[call-arg]
        with pytest.raises(TypeError):
            await client.prefixes.create(model="m", messages=MSG, ttl=5)  # type: ignore[call-arg]
        with pytest.raises(TypeError):
            await client.chat.completions.create(model="m", messages=MSG, extra_body=[1])  # type: ignore[call-overload]
        with pytest.raises(ValueError):
            await client.chat.completions.create(model="m", messages=MSG, max_retries=-1)
    with Client(BASE) as sync:
        with pytest.raises(TypeError, match="guided_json"):
            sync.chat.completions.create(model="m", messages=MSG, guided_json={})  # type: ignore[call-overload]
    assert chat.calls.call_count == 0 and comp.calls.call_count == 0


@respx.mock
async def test_named_fields_and_extra_body_reach_the_body(make_client) -> None:
    async with make_client() as client:
        req = await sent_chat(
            client,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            response_format={"type": "json_object"},
            logit_bias={5: -100},
            min_tokens=2,
            stop_token_ids=[7],
            top_k=20,
            cache_salt="tenant-a",
            extra_body={"structured_outputs": {"regex": "[a-z]+"}},
            extra_headers={"x-trace": "1"},
        )
    body = json.loads(req.content)
    assert body == {
        "model": "m",
        "messages": MSG,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "response_format": {"type": "json_object"},
        "logit_bias": {"5": -100},
        "min_tokens": 2,
        "stop_token_ids": [7],
        "top_k": 20,
        "cache_salt": "tenant-a",
        "structured_outputs": {"regex": "[a-z]+"},
    }
    assert req.headers["x-trace"] == "1"


@respx.mock
async def test_tool_calls_are_typed_in_answers_and_stream_deltas(make_client) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    answer = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ]
    }
    frags = [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"city": '}},
        {"index": 0, "function": {"arguments": '"Oslo"}'}},
    ]
    sse = b"".join(
        b"data: "
        + json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [f]}}]}).encode()
        + b"\n\n"
        for f in frags
    )
    route = respx.post(f"{BASE}/chat/completions")
    async with make_client() as client:
        route.mock(return_value=httpx.Response(200, json=answer))
        out = await client.chat.completions.create(model="m", messages=MSG, tools=TOOLS)
        tool_call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert (tool_call.id, tool_call.type, tool_call.function.name) == (
            "call_1",
            "function",
            "get_weather",
        )
        assert json.loads(tool_call.function.arguments) == {"city": "Oslo"}
        route.mock(return_value=httpx.Response(200, content=sse + b"data: [DONE]\n\n"))
        stream = await client.chat.completions.create(
            model="m", messages=MSG, tools=TOOLS, stream=True
        )
        args = ""
        async for chunk in stream:
            for frag in chunk.choices[0].delta.tool_calls or []:
                assert frag.index == 0 and frag.function is not None
                args += frag.function.arguments or ""
        assert json.loads(args) == {"city": "Oslo"}


def _params(fn) -> list[tuple[str, object, object, object]]:
    return [
        (p.name, p.kind, p.default, p.annotation)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


@pytest.mark.parametrize(
    ("sync_cls", "async_cls", "names"),
    [
        (SyncChatCompletions, AsyncChatCompletions, ["create", "parse"]),
        (SyncCompletions, AsyncCompletions, ["create"]),
        (SyncModels, AsyncModels, ["list", "retrieve"]),
        (SyncPrefixes, AsyncPrefixes, ["create", "get", "delete"]),
    ],
)
def test_sync_methods_have_the_async_signatures(sync_cls, async_cls, names) -> None:
    for name in names:
        sync_params = _params(getattr(sync_cls, name))
        assert sync_params == _params(getattr(async_cls, name)), name
        assert all(kind != inspect.Parameter.VAR_KEYWORD for _, kind, _, _ in sync_params)


def test_sync_client_constructor_matches_async() -> None:
    assert _params(Client.__init__) == _params(AsyncClient.__init__)
    assert _params(Client.with_options) == _params(AsyncClient.with_options)


@pytest.mark.parametrize(
    ("method", "params", "own"),
    [
        (AsyncChatCompletions.create, ChatCompletionCreateParams, {"stream"}),
        (SyncChatCompletions.create, ChatCompletionCreateParams, {"stream"}),
        (AsyncChatCompletions.parse, ChatCompletionParseParams, {"response_format"}),
        (SyncChatCompletions.parse, ChatCompletionParseParams, {"response_format"}),
        (AsyncCompletions.create, CompletionCreateParams, {"stream"}),
        (SyncCompletions.create, CompletionCreateParams, {"stream"}),
        (AsyncPrefixes.create, PrefixCreateParams, set()),
        (SyncPrefixes.create, PrefixCreateParams, set()),
        (AsyncPrefixes.get, CallOptions, {"prefix_id"}),
        (SyncModels.retrieve, CallOptions, {"model"}),
    ],
)
def test_each_endpoints_parameters_are_its_one_typeddict(method, params, own) -> None:
    """The keywords a method takes at run time are its TypedDict's keys (stated once for the
    async method and its blocking twin) plus its own; required keys have no default, the
    others default to None (omitted from the body)."""
    sig = inspect.signature(method).parameters
    assert set(sig) - {"self"} == set(params.__annotations__) | own
    for name in params.__annotations__:
        assert sig[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        required = name in params.__required_keys__
        assert sig[name].default is (inspect.Parameter.empty if required else None), name


@respx.mock
async def test_a_missing_required_keyword_is_a_type_error_and_sends_nothing(make_client) -> None:
    route = mock_chat()
    async with make_client() as client:
        with pytest.raises(TypeError, match="'model'"):
            await client.chat.completions.create(messages=MSG)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="'prompt'"):
            await client.completions.create(model="m")  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="multiple values"):
            await client.models.retrieve("a", model="b")  # type: ignore[misc]
    with Client(BASE) as sync:  # checked before the call reaches the loop thread
        with pytest.raises(TypeError, match="'messages'"):
            sync.chat.completions.create(model="m")  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="'model'"):
            sync.prefixes.create(messages=MSG)  # type: ignore[call-arg]
    assert route.calls.call_count == 0
