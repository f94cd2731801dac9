"""Proxy mode reads an upstream's gzip-encoded answer (``Content-Encoding: gzip``, sent though
the gateway asks for none) as its JSON or event stream on every route that reads one: the
model list an open proxy asks with the client's key, the translated Anthropic and Gemini
answers, chat's answer and stream; the client gets them decoded (``proxy.upstream``: the
session's decompression)."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.chat_upstream import proxy_over_chat

KEY = "sk-good"
HI = [{"role": "user", "content": "hi"}]
GEMINI_BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


def _gzipped(body: bytes, content_type: str) -> web.Response:
    """``body`` gzip-encoded as an upstream sends it unasked."""
    return web.Response(
        body=gzip.compress(body),
        headers={"Content-Type": content_type, "Content-Encoding": "gzip"},
    )


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "stub",
        "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


USAGE = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}


async def _gzip_chat(request: web.Request) -> web.Response:
    """A chat upstream whose every answer, JSON or event stream, is gzip-encoded."""
    body = await request.json()
    if body.get("stream"):
        events = (
            _chunk({"role": "assistant", "content": "ok"})
            + _chunk({}, "stop")
            + _chunk({}, usage=USAGE)
            + b"data: [DONE]\n\n"
        )
        return _gzipped(events, "text/event-stream")
    answer = {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
    return _gzipped(json.dumps(answer).encode(), "application/json")


@pytest.mark.parametrize("stream", [False, True])
def test_gzip_answers_are_read_on_every_dialects_route(stream: bool):
    """Was: chat passed the encoded body through, but the Messages and Gemini relays parsed
    it as JSON (or as events) undecoded: a healthy upstream marked failed and the client a
    502/503."""
    gemini = "streamGenerateContent?alt=sse" if stream else "generateContent"
    routes = [
        ("/v1/chat/completions", {"model": "stub", "messages": HI, "stream": stream}),
        ("/v1/messages", {"model": "stub", "messages": HI, "max_tokens": 4, "stream": stream}),
        (f"/v1beta/models/stub:{gemini}", GEMINI_BODY),
    ]
    bad = []
    with proxy_over_chat(_gzip_chat, models=["stub"]) as http:
        for path, body in routes:
            r = http.post(path, json=body)
            encoding = r.headers.get("Content-Encoding")
            if r.status_code != 200 or encoding is not None or "ok" not in r.text:
                bad.append((path, r.status_code, encoding, r.text))
            elif not stream:
                r.json()  # a JSON answer, decoded
    assert not bad, bad


def _keyed_gzip_upstream() -> web.Application:
    """An upstream that lists its models only to ``KEY`` (so an open proxy knows none of
    them and asks with the client's key), its list gzip-encoded."""

    async def models(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "no key"}}, status=401)
        cards = {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "x"}]}
        return _gzipped(json.dumps(cards).encode(), "application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


def test_an_upstreams_gzip_model_list_is_read_for_a_google_client():
    """``proxy.routes.upstream_model_cards`` parsed the relayed list without undoing its
    encoding: Gemini's list and get were a 500 for every model."""
    with (
        BackgroundServer(_keyed_gzip_upstream) as up,
        BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw,
    ):
        headers = {"x-goog-api-key": KEY}
        r = httpx.get(gw.url + "/v1beta/models", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        assert [m["name"] for m in r.json()["models"]] == ["models/fake"], r.text
        r = httpx.get(gw.url + "/v1beta/models/fake", headers=headers, timeout=10)
        assert r.status_code == 200 and r.json()["name"] == "models/fake", r.text
        r = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        assert "Content-Encoding" not in r.headers and r.json()["data"][0]["id"] == "fake"
