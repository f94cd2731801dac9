"""POST /tokenize against the fake engine: counts as the generation routes render prompts."""

from __future__ import annotations

import httpx
import openai


def test_tokenize_counts_what_chat_and_completions_send(serve_fake):
    srv, engine = serve_fake()
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(srv.url + "/tokenize", json={"model": "fake", "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    chat = client.chat.completions.create(model="fake", messages=messages, max_tokens=1)
    assert body["count"] == chat.usage.prompt_tokens == len(body["tokens"])
    assert body["max_model_len"] == engine.max_model_len
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "hello"})
    done = client.completions.create(model="fake", prompt="hello", max_tokens=1)
    assert r.json()["count"] == done.usage.prompt_tokens
    assert len(engine.requests_seen) == 2  # counting ran no engine request


def test_tokenize_bad_input(serve_fake):
    srv, _ = serve_fake()
    both = {"messages": [{"role": "user", "content": "a"}], "prompt": "a"}
    for body in ({}, both, {"prompt": 5}):
        r = httpx.post(srv.url + "/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(srv.url + "/tokenize", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_tokenize_takes_tools_as_vllm_does(serve_fake):
    """``tools`` (vLLM's ``/tokenize`` field, what a proxy sends to count a request with tools)
    is rendered as chat renders it; a bad tool is a 400 naming it. It was refused as an unknown
    field, so a proxy's Gemini ``countTokens`` / Anthropic ``count_tokens`` with tools was a 400
    where local mode counts (found by ``test_edge_combinations.py``)."""
    srv, _ = serve_fake()
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(srv.url + "/tokenize", json={"messages": messages, "tools": [TOOL]})
    assert r.status_code == 200, r.text
    chat = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "fake", "messages": messages, "tools": [TOOL], "tool_choice": "required",
              "max_tokens": 1},
    )  # fmt: skip
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"], chat.text
    bad = {**TOOL, "function": {"name": "f", "parameters": 5}}
    r = httpx.post(srv.url + "/tokenize", json={"messages": messages, "tools": [bad]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[0]"), r.text
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "hi", "tools": [TOOL]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_count_routes_with_tools_count_alike_in_both_modes(serve_fake):
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings

    local, _ = serve_fake()
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    gemini = {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "tools": [{"functionDeclarations": [{"name": "f", "parameters": {"type": "object"}}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY"}},
    }
    anthropic = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
    }
    with BackgroundServer(lambda: create_proxy_app([local.url], slow)) as proxy:
        for base in (local.url, proxy.url):
            r = httpx.post(
                base + "/v1beta/models/fake:countTokens",
                json={"generateContentRequest": {"model": "models/fake", **gemini}},
                timeout=120,
            )
            assert r.status_code == 200, (base, r.text)
            r = httpx.post(base + "/v1/messages/count_tokens", json=anthropic, timeout=120)
            assert r.status_code == 200, (base, r.text)
