"""The counting routes (``/tokenize``, Anthropic's ``count_tokens``, Gemini's ``countTokens``)
count texts beyond the context, bounded only by ``local/tokenize.counting`` (a text's length
alone showing 8 x max_model_len tokens), and say that bound truly (docs/serving.md)."""

from __future__ import annotations

import httpx
import pytest
from prefixgate.gateway.local.tokenize import TOKENIZE_CONTEXTS

from tests.support.gateway import module_server

MODEL = "aidreams-260k"
server = module_server(MODEL)

LONG = "word " * 307  # 1,538 characters: more tokens than the 128-token context holds


def _count(http: httpx.Client, route: str, text: str) -> httpx.Response:
    if route == "tokenize":
        return http.post("/tokenize", json={"prompt": text})
    if route == "anthropic":
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        return http.post("/v1/messages/count_tokens", json=body)
    body = {"contents": [{"parts": [{"text": text}]}]}
    return http.post(f"/v1beta/models/{MODEL}:countTokens", json=body)


def _number(route: str, r: httpx.Response) -> int:
    key = {"tokenize": "count", "anthropic": "input_tokens", "gemini": "totalTokens"}[route]
    return r.json()[key]


@pytest.mark.parametrize("route", ["tokenize", "anthropic", "gemini"])
def test_count_routes_count_beyond_the_context(server, route):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = _count(http, route, LONG)
        assert r.status_code == 200, r.text
        assert _number(route, r) > 128
        r = _count(http, route, "word " * 2000)  # 10 kB: under the byte bound, counted
        assert r.status_code == 200, r.text
        assert _number(route, r) > TOKENIZE_CONTEXTS * 128  # more than 8 contexts: counted


@pytest.mark.parametrize("route", ["tokenize", "anthropic", "gemini"])
def test_count_routes_refuse_past_the_byte_bound_in_counting_words(server, route):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = _count(http, route, "word " * 20_000)  # 100 kB
        assert r.status_code == 400, r.text
        said = r.text
        assert "room to generate" not in said
        assert "counts a text unless its length alone shows" in said
        assert f"{TOKENIZE_CONTEXTS} x max_model_len = {TOKENIZE_CONTEXTS * 128} tokens" in said
        assert "this messages" not in said and "this prompt has" not in said


def _violations(r: httpx.Response) -> list[str]:
    details = r.json()["error"].get("details") or []
    return [v["field"] for d in details for v in d.get("fieldViolations", [])]


def test_gemini_refusals_name_gemini_fields(server):
    """The chat's own refusals (rendering bound, tool turns) on the Gemini routes name
    Gemini's fields, for any prompt length (``client_fields.in_client_words`` in local mode)."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for text in ("word " * 2000, "word " * 307):
            body = {"contents": [{"parts": [{"text": text}]}]}
            r = http.post(f"/v1beta/models/{MODEL}:generateContent", json=body)
            assert r.status_code == 400, r.text
            assert _violations(r) == ["contents"], r.text
        r = _count(http, "gemini", "word " * 20_000)
        assert r.status_code == 400 and "text of contents" in r.text, r.text
        assert _violations(r) == ["contents"], r.text


def test_anthropic_refusals_name_messages_fields(server):
    """A chat-side refusal on /v1/messages names the Messages path (the block), not the
    translated chat's (a ``tool_result`` block is a chat message of its own)."""
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}],
            },
        ],
    }
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 400, r.text
        said = r.json()["error"]["message"]
        assert said.startswith("messages.2.content.0"), said
