"""The ``x-prefixgate-cache`` answer header in proxy mode: one rule for every relayed route
(``relay.passed_cache_header``). The upstream's header is passed on as it came, on whole
answers and streams; an upstream that sends none (vLLM, any server other than prefixgate)
gives an answer without it, never one the proxy made up (the one addition: the Messages
breakpoints a translation to chat dropped, named ``WHERE=dropped``; the one rewording: a
Responses answer names the chat's marks by their ``input`` items, as local mode does)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

HEADER = "x-prefixgate-cache"
UPSTREAM_SAYS = "read=16; messages.0.content.0=16:hit"
USAGE = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def _stub(header: str | None) -> web.Application:
    """An OpenAI-compatible upstream (model ``m``) whose chat and completions answers, whole
    or streamed, carry ``header`` as ``x-prefixgate-cache`` (None: no such header)."""
    extra = {} if header is None else {HEADER: header}

    def choice(chat: bool, stream: bool, finish: str | None, text: str) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        key = "delta" if stream else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": "x", "created": 0, "model": "m"}
        if not body.get("stream"):
            obj = {**base, "object": kind, "choices": [choice(chat, False, "stop", "ok")]}
            return web.json_response({**obj, "usage": USAGE}, headers=extra)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **extra})
        await resp.prepare(request)
        kind += ".chunk" if chat else ""
        for finish, text in ((None, "o"), ("stop", "k")):
            obj = {**base, "object": kind, "choices": [choice(chat, True, finish, text)]}
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {**base, "object": kind, "choices": [], "usage": USAGE}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        card = {"id": "m", "object": "model", "created": 0, "owned_by": "vllm"}
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/v1/completions", answer)
    app.router.add_get("/v1/models", models)
    return app


ASK = "hi"
ROUTES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # route: (path, whole body, what makes it a stream)
    "chat": (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": ASK}], "max_tokens": 2},
        {"stream": True},
    ),
    "completions": (
        "/v1/completions",
        {"model": "m", "prompt": ASK, "max_tokens": 2},
        {"stream": True},
    ),
    "messages": (
        "/v1/messages",
        {"model": "m", "messages": [{"role": "user", "content": ASK}], "max_tokens": 2},
        {"stream": True},
    ),
    "gemini": ("/v1beta/models/m:generateContent", {"contents": [{"parts": [{"text": ASK}]}]}, {}),
    "responses": ("/v1/responses", {"model": "m", "input": ASK}, {"stream": True}),
}


def _ask(gw: BackgroundServer, route: str, stream: bool, **extra: Any) -> httpx.Response:
    path, body, streamed = ROUTES[route]
    if stream:
        body = {**body, **streamed}
        if route == "gemini":
            path = "/v1beta/models/m:streamGenerateContent?alt=sse"
    r = httpx.post(gw.url + path, json={**body, **extra}, timeout=10)
    assert r.status_code == 200, r.text
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        assert '"error":{' not in r.text and "event: error" not in r.text, r.text  # ended well
    return r


@pytest.fixture
def proxy(servers: Callable[..., BackgroundServer]) -> Callable[[str | None], BackgroundServer]:
    def start(header: str | None) -> BackgroundServer:
        up = servers(lambda: _stub(header))
        return servers(lambda: create_proxy_app([up.url], GatewaySettings()))

    return start


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_each_relayed_route_passes_the_upstream_s_header_on(proxy, route, stream):
    r = _ask(proxy(UPSTREAM_SAYS), route, stream)
    # Responses: the chat's marks named as the client sent them (local mode's words)
    said = UPSTREAM_SAYS.replace("messages.", "input.") if route == "responses" else UPSTREAM_SAYS
    assert r.headers.get(HEADER) == said, r.headers


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_an_upstream_without_the_header_gives_answers_without_it(proxy, route, stream):
    r = _ask(proxy(None), route, stream)
    assert HEADER not in r.headers, r.headers


@pytest.mark.parametrize("header", [UPSTREAM_SAYS, None])
def test_a_translated_messages_answer_names_its_dropped_breakpoints_after_the_upstream_s(
    proxy, header
):
    """The one header the proxy writes itself: the Messages breakpoints a translation to chat
    left out, after what the upstream said (when it said anything)."""
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    r = _ask(proxy(header), "messages", False, system=system)
    said = [header] if header is not None else []
    assert r.headers[HEADER] == "; ".join([*said, "system.0=dropped"]), r.headers
