"""A tool call cut by ``max_tokens`` (aidreams-260k, a forced call): the Anthropic body's
``tool_use.input`` is what the ``anthropic`` package makes of the same answer streamed
(``input_json_delta`` fragments parsed leniently), and a Gemini ``functionCall``'s ``args`` the
same object of the call's text, in local mode and through the proxy translating for an
OpenAI-compatible upstream (``wire.partial_json``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import aiohttp
import anthropic
import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.wire.partial_json import arguments_object

from tests.support.chat_upstream import chat_app
from tests.support.gateway import module_server

MODEL = "aidreams-260k"
server = module_server(MODEL)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "note": {"type": "string"}},
    "required": ["ok", "note"],
    "additionalProperties": False,
}
GEMINI_SCHEMA = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def proxy(server: BackgroundServer) -> Iterator[BackgroundServer]:
    """A proxy gateway over an OpenAI-compatible upstream (its ``/v1/models`` cards are not
    prefixgate's, so Messages are translated to chats) whose chats the aidreams server
    answers."""

    async def chat(request: web.Request) -> web.StreamResponse:
        async with (
            aiohttp.ClientSession() as http,
            http.post(server.url + "/v1/chat/completions", data=await request.read()) as r,
        ):
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.content_type})
            await out.prepare(request)
            async for piece in r.content.iter_any():
                await out.write(piece)
            await out.write_eof()
            return out

    up = BackgroundServer(chat_app(chat, [MODEL])).__enter__()
    gw = BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())).__enter__()
    yield gw
    gw.close()
    up.close()


def _chat_arguments(base: str, max_tokens: int, schema: dict = SCHEMA) -> tuple[str, str]:
    """The forced call's ``arguments`` text and ``finish_reason`` of a chat completion."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [{"type": "function", "function": {"name": "say", "parameters": schema}}],
        "tool_choice": {"type": "function", "function": {"name": "say"}},
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["tool_calls"][0]["function"]["arguments"], choice["finish_reason"]


@pytest.fixture(scope="module")
def cut(server: BackgroundServer) -> int:
    """A ``max_tokens`` that cuts the call after its first member (``ok``), inside ``note``."""
    for n in range(2, 40):
        text, finish = _chat_arguments(server.url, n)
        if finish == "length" and arguments_object(text):
            with pytest.raises(ValueError):
                json.loads(text)
            return n
    pytest.fail("no max_tokens cut the call after a whole member")


def _anthropic_request(max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [{"name": "say", "input_schema": SCHEMA}],
        "tool_choice": {"type": "tool", "name": "say"},
        "extra_body": {"temperature": 0},  # anthropic 2.x takes it no more by name
    }


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_cut_tool_use_body_holds_what_its_stream_sent(server, proxy, cut, mode):
    base = server.url if mode == "local" else proxy.url
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    body = client.messages.create(**_anthropic_request(cut))
    with client.messages.stream(**_anthropic_request(cut)) as stream:
        fragments = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        streamed = stream.get_final_message()
    assert body.stop_reason == streamed.stop_reason == "max_tokens"
    [use] = [b for b in body.content if b.type == "tool_use"]
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert use.input == streamed_use.input == arguments_object("".join(fragments))
    assert use.input and "ok" in use.input, use.input  # the whole member kept, not {}
    text, _ = _chat_arguments(base, cut)
    assert "".join(fragments) == text  # the chat's truncated arguments, sent as they are


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_cut_function_call_keeps_its_whole_members_body_and_stream(server, proxy, cut, mode):
    base = server.url if mode == "local" else proxy.url
    body = {
        "contents": [{"role": "user", "parts": [{"text": PROMPT}]}],
        "tools": [{"functionDeclarations": [{"name": "say", "parameters": GEMINI_SCHEMA}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["say"]}},
        "generationConfig": {"maxOutputTokens": cut, "temperature": 0},
    }
    url = f"{base}/v1beta/models/{MODEL}"
    r = httpx.post(url + ":generateContent", json=body, timeout=60)
    assert r.status_code == 200, r.text
    [cand] = r.json()["candidates"]
    assert cand["finishReason"] == "MAX_TOKENS"
    [call] = [p["functionCall"] for p in cand["content"]["parts"] if "functionCall" in p]
    with httpx.stream("POST", url + ":streamGenerateContent?alt=sse", json=body, timeout=60) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ")]
    streamed = [
        p["functionCall"]
        for c in chunks
        for cand in c.get("candidates", [])
        for p in cand.get("content", {}).get("parts", [])
        if "functionCall" in p
    ]
    text, _ = _chat_arguments(base, cut, GEMINI_SCHEMA)
    assert call["args"] == arguments_object(text)
    assert call["args"] and "ok" in call["args"], call  # the whole member kept, not {}
    assert [c["args"] for c in streamed] == [call["args"]]
