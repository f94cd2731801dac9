"""Anthropic-dialect deployments (``proxy.anthropic``): the openai client's chat through the
gateway reaches a Messages API stub with cache breakpoints placed on the system prompt and
the conversation's head, its repeat reports ``cached_tokens`` from the stub's cache reads;
streams, tools and errors translated; what the dialect cannot take refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.anthropic import MIN_CACHE_CHARS, place_breakpoints, to_messages
from prefixgate.gateway.proxy.config import load_config
from prefixgate.gateway.settings import GatewaySettings
from support.anthropic_stub import SECRET, AnthropicStub, claude_config
from support.http import assert_openai_error
from support.stub_upstream import StubServer

SYSTEM = "You are the harbour master's assistant; answer about tides and berths. " * 80


@pytest.fixture
def gateway(tmp_path: Path):
    """A gateway with model ``claude`` on the Anthropic stub and ``local`` on an OpenAI stub."""
    claude = AnthropicStub()
    local = StubServer(name="local", ttft_s=0.0, token_delay_s=0.0).start()
    with BackgroundServer(claude.app) as up:
        local_model = f"""[[models]]
name = "local"
[[models.deployments]]
url = "{local.base_url}"
"""
        cfg = claude_config(tmp_path / "proxy.toml", up.url, local_model)
        with BackgroundServer(lambda: create_proxy_app(cfg, GatewaySettings())) as gw:
            yield gw, claude
    local.stop()


def test_chat_reaches_the_messages_api_with_breakpoints_and_reports_cache_reads(gateway):
    gw, claude = gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "High tide?"}]
    first = client.chat.completions.create(model="claude", messages=messages, max_tokens=50)
    assert first.choices[0].message.content == "hello there"
    assert first.choices[0].finish_reason == "stop" and first.model == "claude"
    sent = claude.seen[-1]
    assert sent["model"] == "claude-sonnet-4-5" and sent["max_tokens"] == 50
    assert sent["system"] == [
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "5m"}}
    ]
    assert sent["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "High tide?"}]}
    ]
    headers = claude.headers[-1]
    assert headers["x-api-key"] == "sk-ant-test" and headers["anthropic-version"] == "2023-06-01"
    assert "Authorization" not in headers
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    details = first.usage.prompt_tokens_details.model_dump()
    assert details["cache_write_tokens"] > 0  # the system prompt written to the cache
    again = client.chat.completions.create(model="claude", messages=messages, max_tokens=50)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == details["cache_write_tokens"] and cached > 0  # the stub's cache reads
    assert again.usage.prompt_tokens == first.usage.prompt_tokens


def test_streams_tools_and_tool_results_are_translated(gateway):
    gw, claude = gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "tide",
                "description": "the next high tide",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    stream = client.chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        stop=["END"],
        temperature=0.2,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    sent = claude.seen[-1]
    assert sent["stream"] is True and sent["stop_sequences"] == ["END"]
    assert sent["temperature"] == 0.2
    calls = client.chat.completions.create(
        model="claude", messages=[{"role": "user", "content": "tide?"}], tools=tools,
        tool_choice="required",
    )  # fmt: skip
    (call,) = calls.choices[0].message.tool_calls
    assert calls.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "tide" and call.function.arguments == '{"city": "Oslo"}'
    assert claude.seen[-1]["tools"][0]["input_schema"]["properties"]["city"]
    assert claude.seen[-1]["tool_choice"] == {"type": "any"}
    streamed = list(
        client.chat.completions.create(
            model="claude", messages=[{"role": "user", "content": "tide?"}], tools=tools,
            tool_choice={"type": "function", "function": {"name": "tide"}}, stream=True,
        )
    )  # fmt: skip
    args = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or ""
        for c in streamed
        if c.choices and c.choices[0].delta.tool_calls
    )
    assert args == '{"city": "Oslo"}'
    follow = [
        {"role": "user", "content": "tide?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "14:05"},
        {"role": "user", "content": "thanks"},
    ]
    client.chat.completions.create(model="claude", messages=follow)
    turns = claude.seen[-1]["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[1]["content"][0] == {
        "type": "tool_use",
        "id": call.id,
        "name": "tide",
        "input": {"city": "Oslo"},
    }
    assert turns[2]["content"][0] == {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": "14:05",
    }
    assert turns[2]["content"][1] == {"type": "text", "text": "thanks"}


def test_what_the_dialect_cannot_take_is_refused_by_name_and_errors_never_leak(gateway):
    gw, claude = gateway
    with httpx.Client(base_url=gw.url, timeout=10) as http:
        tiff = {"type": "image_url", "image_url": {"url": "data:image/tiff;base64,AAAA"}}
        body = {"model": "claude", "messages": [{"role": "user", "content": [tiff]}]}
        r = http.post("/v1/chat/completions", json=body)
        assert_openai_error(r, 400, param="messages")
        assert "image/tiff images are not supported" in r.json()["error"]["message"]
        for field, value in (
            ("logprobs", True),
            ("n", 2),
            ("response_format", {"type": "json_object"}),
        ):
            body = {"model": "claude", "messages": [{"role": "user", "content": "x"}], field: value}
            assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=field)
        r = http.post("/v1/completions", json={"model": "claude", "prompt": "x"})
        assert_openai_error(r, 400, code="unsupported_for_model")
        n = len(claude.seen)
        assert n == 0  # none of those reached the upstream
        claude.status = 529
        r = http.post(
            "/v1/chat/completions",
            json={"model": "claude", "messages": [{"role": "user", "content": "x"}]},
        )
        assert_openai_error(r, 503, code="upstream_error")  # overloaded: not marked down
        assert SECRET not in r.text and "overloaded_error" in r.text
        claude.status = 400
        r = http.post(
            "/v1/chat/completions",
            json={"model": "claude", "messages": [{"role": "user", "content": "x"}]},
        )
        err = assert_openai_error(r, 400)  # the request's own fault: its words kept
        assert err["message"] == SECRET and err["type"] == "overloaded_error"


def test_breakpoints_only_where_the_head_is_long_enough_and_at_most_four():
    short = to_messages(
        {
            "model": "c",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "x"},
            ],
        },
        "c",
    )
    assert "cache_control" not in short["system"][0]
    long_chat = {
        "model": "c",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "a" * MIN_CACHE_CHARS},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
    }
    req = to_messages(long_chat, "c")
    assert req["system"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "5m"}
    assert req["messages"][1]["content"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "5m"}
    assert "cache_control" not in req["messages"][2]["content"][-1]  # the new turn is not cached
    assert place_breakpoints(req) <= 4


def test_images_and_a_registered_prefix_s_breakpoint_with_its_ttl(gateway):
    gw, claude = gateway
    with httpx.Client(base_url=gw.url, timeout=10) as http:
        png = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}
        web_image = {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}}
        text = {"type": "text", "text": "what is this?"}
        body = {
            "model": "claude",
            "messages": [{"role": "user", "content": [text, png, web_image]}],
        }
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        blocks = claude.seen[-1]["messages"][0]["content"]
        assert blocks[1] == {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"},
        }
        assert blocks[2] == {
            "type": "image",
            "source": {"type": "url", "url": "https://example.com/a.jpg"},
        }
        # A registered prefix (an hour to live): its end carries a 1h breakpoint.
        prefix = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "The berth list follows."},
            {"role": "assistant", "content": "Ready."},
        ]
        r = http.post(
            "/v1/prefixes", json={"model": "claude", "messages": prefix, "ttl_seconds": 3600}
        )
        assert r.status_code == 200, r.text
        pid = r.json()["id"]
        usage = []
        for _ in range(2):
            chat = {
                "model": "claude",
                "prefix_id": pid,
                "messages": [{"role": "user", "content": "Berth 4?"}],
            }
            r = http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"]["prompt_tokens_details"])
        sent = claude.seen[-1]
        assert sent["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
        turns = sent["messages"]
        assert turns[1]["content"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
        assert "cache_control" not in turns[2]["content"][-1]  # the new turn
        assert usage[0]["cached_tokens"] == 0 and usage[1]["cached_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_an_anthropic_deployments_401_is_about_the_key_actually_sent(tmp_path: Path, path: str):
    """Was: with ``--upstream-api-key`` set (a key for the OpenAI-compatible upstreams, never
    sent to an Anthropic deployment), a keyless Anthropic deployment's 401 on the Messages
    relay was told as the gateway's own credential refused (502 ``upstream_auth_failed``),
    though the key it refused was the client's, forwarded. Both routes now judge it by what
    was sent (``UpstreamRouter.gateway_credential``): the client's key, a 401."""
    claude = AnthropicStub(status=401)
    with BackgroundServer(claude.app) as up:
        (tmp_path / "proxy.toml").write_text(
            f'[[models]]\nname = "claude"\n[[models.deployments]]\nurl = "{up.url}"\n'
            'dialect = "anthropic"\nmodel = "claude-sonnet-4-5"\n'
        )
        cfg = load_config(tmp_path / "proxy.toml", env={})
        settings = GatewaySettings(upstream_api_key="sk-openai-upstreams")
        with BackgroundServer(lambda: create_proxy_app(cfg, settings)) as gw:
            body = {
                "model": "claude",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
            }
            r = httpx.post(gw.url + path, json=body, headers={"x-api-key": "sk-client"}, timeout=10)
    assert r.status_code == 401, r.text
    assert "sk-openai-upstreams" not in str(claude.headers)
    assert SECRET not in r.text


def test_an_anthropic_stream_gone_silent_ends_with_a_timeout_saying_so(tmp_path: Path):
    """An Anthropic deployment silent mid-stream past ``--upstream-timeout-s``: the chat
    stream ends with the event an OpenAI upstream's silence gets, code ``upstream_timeout``
    and how long it waited (was "connection broke mid-stream: SocketTimeoutError"), the
    keep-alive comments sent meanwhile not pushing the limit back."""
    claude = AnthropicStub(stall_s=30)
    with BackgroundServer(claude.app) as up:
        cfg = claude_config(tmp_path / "proxy.toml", up.url)
        settings = GatewaySettings(upstream_timeout_s=0.5, keepalive_s=0.1)
        with BackgroundServer(lambda: create_proxy_app(cfg, settings)) as gw:
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={"model": "claude", "messages": [{"role": "user", "content": "hi"}],
                      "stream": True, "max_tokens": 5},
                timeout=10,
            )  # fmt: skip
    last = [ln for ln in r.text.splitlines() if ln.startswith("data: ")][-1]
    err = json.loads(last[6:])["error"]
    assert err["code"] == "upstream_timeout" and "sent nothing for 0.5 s" in err["message"], err
    assert ": keep-alive" in r.text.splitlines(), r.text


def test_an_anthropic_stream_paused_gets_keepalives_then_the_rest(tmp_path: Path):
    """An Anthropic deployment silent mid-stream for longer than ``--keepalive-s``: the chat
    stream gets ``: keep-alive`` comments, as from an OpenAI upstream, then the rest."""
    claude = AnthropicStub(stall_s=0.7)
    with BackgroundServer(claude.app) as up:
        cfg = claude_config(tmp_path / "proxy.toml", up.url)
        settings = GatewaySettings(keepalive_s=0.2)
        with BackgroundServer(lambda: create_proxy_app(cfg, settings)) as gw:
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={"model": "claude", "messages": [{"role": "user", "content": "hi"}],
                      "stream": True, "max_tokens": 5},
                timeout=10,
            )  # fmt: skip
    lines = r.text.splitlines()
    assert ": keep-alive" in lines and lines[-2] == "data: [DONE]", r.text
    assert any('"content"' in ln for ln in lines[lines.index(": keep-alive") :]), r.text
