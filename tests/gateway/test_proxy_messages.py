"""Anthropic's Messages API in upstream mode (``proxy.messages_relay``), through the official
``anthropic`` client: translated to chat completions for an OpenAI-compatible upstream (a
scripted vLLM-shaped stub) and back, whole and streamed, tools round trip; relayed as is to a
prefixgate upstream (``create_app`` on the fake engine) with the key's salt; upstream errors
reworded, streams cut short ended by an ``error`` event, what cannot be mapped refused by
name, ``count_tokens`` by ``/tokenize`` or 501 naming the route."""

from __future__ import annotations

import json
from collections.abc import Callable

import anthropic
import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.keys import effective_salt
from support.chat_stub import SECRET, ChatStub
from support.fake_engine import FakeEngine
from support.http import counts_both_modes

SYSTEM = "You are the harbour master's assistant."


def _client(gw: BackgroundServer, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def _streamed_text(gw: BackgroundServer) -> str:
    """The whole body of a streamed ``/v1/messages`` call ("hi", 8 tokens, model ``llama``)."""
    with httpx.stream(
        "POST",
        gw.url + "/v1/messages",
        json={"model": "llama", "max_tokens": 8, "stream": True, "messages": [
            {"role": "user", "content": "hi"}]},
    ) as r:  # fmt: skip
        return r.read().decode()


@pytest.fixture
def vllm(servers: Callable[..., BackgroundServer]):
    stub = ChatStub()
    up = servers(stub.app)
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings()))
    return stub, gw


def test_a_message_to_an_openai_upstream_is_a_chat_and_comes_back_a_message(vllm):
    stub, gw = vllm
    client = _client(gw)
    raw = client.messages.with_raw_response.create(
        model="llama",
        max_tokens=32,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "High tide?"}]}],
        stop_sequences=["END"],
        metadata={"user_id": "u-1"},
        extra_body={"temperature": 0.5, "top_p": 0.9},
    )
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "llama"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "hello there"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    sent = stub.seen[-1]
    assert sent["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "High tide?"},
    ]
    assert sent["max_tokens"] == 32 and sent["stop"] == ["END"] and sent["user"] == "u-1"
    assert sent["temperature"] == 0.5 and sent["top_p"] == 0.9 and "stream" not in sent
    assert "cache_control" not in json.dumps(sent)
    prompt = len(SYSTEM) + len("High tide?")
    assert msg.usage.input_tokens == prompt - 8 and msg.usage.cache_read_input_tokens == 8
    assert msg.usage.cache_creation_input_tokens == 0 and msg.usage.output_tokens == 5
    assert raw.headers["x-prefixgate-cache"] == "system.0=dropped"


def test_a_stream_to_an_openai_upstream_is_translated_event_by_event(vllm):
    stub, gw = vllm
    stub.stop_reason, stub.finish_reason = "END", "stop"
    client = _client(gw)
    with client.messages.stream(
        model="llama",
        max_tokens=32,
        system=SYSTEM,
        messages=[{"role": "user", "content": "High tide?"}],
        stop_sequences=["END"],
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == "hello there"
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "END"
    prompt = len(SYSTEM) + len("High tide?")
    assert final.usage.input_tokens == prompt - 8 and final.usage.cache_read_input_tokens == 8
    assert final.usage.output_tokens == 5
    assert stub.seen[-1]["stream"] is True


TOOLS = [
    {
        "name": "tide",
        "description": "the next high tide",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def test_tools_round_trip_through_an_openai_upstream(vllm):
    stub, gw = vllm
    stub.calls = [("tide", '{"city": "Oslo"}')]
    client = _client(gw)
    ask = [{"role": "user", "content": "tide?"}]
    msg = client.messages.create(
        model="llama",
        max_tokens=32,
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    (use,) = msg.content
    assert use.type == "tool_use" and use.name == "tide" and use.input == {"city": "Oslo"}
    assert use.id == "call_0" and msg.stop_reason == "tool_use"
    sent = stub.seen[-1]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "tide",
                "parameters": TOOLS[0]["input_schema"],
                "description": "the next high tide",
            },
        }
    ]
    assert sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
    with client.messages.stream(model="llama", max_tokens=32, messages=ask, tools=TOOLS) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", {"city": "Oslo"})]
    assert streamed.stop_reason == "tool_use"
    stub.calls = []
    follow = [
        *ask,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "14:05"},
                {"type": "text", "text": "thanks"},
            ],
        },
    ]
    done = client.messages.create(model="llama", max_tokens=32, messages=follow, tools=TOOLS)
    assert done.content[0].text == "hello there"
    turns = stub.seen[-1]["messages"]
    assert turns[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "tide", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
    assert turns[2] == {"role": "tool", "tool_call_id": "call_0", "content": "14:05"}
    assert turns[3] == {"role": "user", "content": "thanks"}


def test_upstream_errors_are_reworded_a_5xx_never_shown(vllm):
    """One rewording for every dialect (``redact.upstream_error``): a 4xx keeps the
    upstream's message (about the request), a 5xx is said in the gateway's words."""
    stub, gw = vllm
    stub.status = 400
    client = _client(gw)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="llama", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == SECRET
    stub.status = 500
    with pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.create(
            model="llama", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert SECRET not in json.dumps(caught.value.body)


def test_a_stream_cut_short_ends_with_an_error_event(vllm):
    stub, gw = vllm
    stub.cut = True
    client = _client(gw)
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(
            model="llama", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            for _ in stream:
                pass
    assert "ended before its last event" in str(caught.value)
    text = _streamed_text(gw)
    assert text.rstrip().split("\n\n")[-1].startswith("event: error\ndata: ")
    assert "message_stop" not in text


def test_what_an_openai_upstream_cannot_take_is_refused_by_name(vllm):
    stub, gw = vllm
    client = _client(gw)
    # (an empty ``diagnostics: {}`` says nothing: taken as absent, test_empty_is_absent.py)
    diagnostics = {"diagnostics": {"previous_message_id": "msg_1"}}
    for extra, name in (({"top_k": 5}, "top_k"), (diagnostics, "diagnostics")):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(
                model="llama",
                max_tokens=8,
                messages=[{"role": "user", "content": "hi"}],
                extra_body=extra,
            )
        assert caught.value.body["error"]["message"].startswith(name + ":")
    with pytest.raises(anthropic.BadRequestError) as caught:  # the local dialect's own refusal
        client.messages.create(
            model="llama",
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}},
        )
    assert "thinking" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert stub.seen == []


def test_count_tokens_asks_the_upstream_tokenize_or_is_501_naming_the_route(vllm):
    stub, gw = vllm
    client = _client(gw)
    n = client.messages.count_tokens(
        model="llama", system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
    )
    assert n.input_tokens == len(SYSTEM) + 2
    assert stub.seen[-1]["add_generation_prompt"] is True
    stub.tokenize = False
    r = httpx.post(
        gw.url + "/v1/messages/count_tokens",
        json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 501
    body = r.json()
    assert body["type"] == "error" and "/v1/messages/count_tokens" in body["error"]["message"]


def _keys(tmp_path) -> str:
    path = tmp_path / "keys.json"
    keys = [{"key": "k1", "name": "a", "salt": "sa"}, {"key": "k2", "name": "b", "salt": "sb"}]
    path.write_text(json.dumps({"keys": keys}))
    return str(path)


def test_a_prefixgate_upstream_gets_the_message_as_is_with_the_key_salt(servers, tmp_path):
    holder: dict = {}

    def make():
        holder["engine"] = FakeEngine()
        return create_app(holder["engine"], GatewaySettings(model_name="fake"))

    up = servers(make)
    settings = GatewaySettings(keys_file=_keys(tmp_path))
    gw = servers(lambda: create_proxy_app([up.url], settings))
    engine: FakeEngine = holder["engine"]
    system = [{"type": "text", "text": SYSTEM * 2, "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "High tide?"}]
    raw = _client(gw, "k1").messages.with_raw_response.create(
        model="fake", max_tokens=4, system=system, messages=ask
    )
    msg = raw.parse()
    assert msg.type == "message" and msg.model == "fake" and msg.content[0].type == "text"
    assert msg.usage.cache_creation_input_tokens > 0  # the upstream's breakpoint, written
    assert "system.0=" in raw.headers["x-prefixgate-cache"]  # the upstream's own header
    with _client(gw, "k2").messages.stream(
        model="fake", max_tokens=4, system=system, messages=ask, extra_body={"cache_salt": "x"}
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and final.model == "fake"
    salts = [seen[3] for seen in engine.requests_seen]
    assert salts == [
        effective_salt(None, "sa"),  # the upstream nests the proxy's salt in its own
        effective_salt(None, effective_salt("sb", "x")),
    ]
    n = _client(gw, "k1").messages.count_tokens(model="fake", system=system, messages=ask)
    prompt = msg.usage.input_tokens + msg.usage.cache_creation_input_tokens
    assert n.input_tokens == prompt + msg.usage.cache_read_input_tokens


def _prefixgate_lookalike(events: list[tuple[str, dict]]) -> web.Application:
    """An upstream that says it is prefixgate and streams ``events`` (then ends)."""

    async def models(request: web.Request) -> web.Response:
        card = {"id": "pg", "object": "model", "created": 0, "owned_by": "prefixgate"}
        return web.json_response({"object": "list", "data": [card]})

    async def messages(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"type": "message", "content": "not blocks"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for kind, data in events:
            await resp.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/health", lambda r: web.json_response({}))
    return app


def test_a_prefixgate_upstream_s_broken_answers_never_pass_as_success(servers):
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "pg",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 0},
        },
    }  # fmt: skip
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "hi"},
    }
    up = servers(
        lambda: _prefixgate_lookalike(
            [
                ("message_start", start),
                ("content_block_start", block),
                ("content_block_delta", delta),
            ]
        )
    )
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings()))
    client = _client(gw)
    ask = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model="pg", max_tokens=8, messages=ask) as stream:
            for _ in stream:
                pass
    assert "ended before its last event" in str(caught.value)
    with pytest.raises(anthropic.APIStatusError) as caught:  # a body that is no message
        client.messages.create(model="pg", max_tokens=8, messages=ask)
    assert caught.value.status_code == 502


def test_an_anthropic_deployment_gets_the_message_as_is_with_its_own_key(servers, tmp_path):
    from support.anthropic_stub import SECRET as ANTHROPIC_SECRET
    from support.anthropic_stub import AnthropicStub, claude_config

    claude = AnthropicStub()
    up = servers(claude.app)
    cfg = claude_config(tmp_path / "proxy.toml", up.url)
    gw = servers(lambda: create_proxy_app(cfg, GatewaySettings()))
    client = _client(gw, "client-key")
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": [{"type": "text", "text": "High tide?"}]}]
    msg = client.messages.create(
        model="claude", max_tokens=16, system=system, messages=ask, extra_body={"cache_salt": "x"}
    )
    assert msg.model == "claude" and msg.content[0].text == "hello there"
    assert msg.usage.cache_creation_input_tokens > 0  # the breakpoint reached it as sent
    sent = claude.seen[-1]
    assert sent == {
        "model": "claude-sonnet-4-5",
        "max_tokens": 16,
        "system": system,
        "messages": ask,
    }
    headers = claude.headers[-1]
    assert headers["x-api-key"] == "sk-ant-test" and "Authorization" not in headers
    with client.messages.stream(model="claude", max_tokens=16, messages=ask) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "hello there" and final.model == "claude"
    assert final.usage.output_tokens == 3
    claude.status = 529
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(model="claude", max_tokens=16, messages=ask)
    assert caught.value.status_code == 529
    assert caught.value.body["error"]["type"] == "overloaded_error"
    assert ANTHROPIC_SECRET not in json.dumps(caught.value.body)


def test_a_failing_upstream_moves_the_message_to_the_next_of_its_model(servers):
    bad, good = ChatStub(status=503), ChatStub()
    urls = [servers(bad.app).url, servers(good.app).url]
    gw = servers(lambda: create_proxy_app(urls, GatewaySettings()))
    client = _client(gw)
    for _ in range(3):
        msg = client.messages.create(
            model="llama", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        assert msg.content[0].text == "hello there"
    assert len(good.seen) == 3 and len(bad.seen) <= 3  # ejected after its third 503 in a row


def test_reworded_errors_keep_status_type_and_code_and_a_4xx_message():
    from prefixgate.gateway.proxy.redact import upstream_error

    vllm_400 = {
        "error": {
            "message": f"This model's maximum context length is 2048 tokens ({SECRET})",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    err = upstream_error(400, json.dumps(vllm_400).encode(), {}, ())
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert "maximum context length" in err.message
    limited = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    err = upstream_error(429, json.dumps(limited).encode(), {"Retry-After": "7"}, ())
    assert err.status == 429 and err.retry_after == 7 and err.message == "slow down"
    assert err.anthropic_body()["error"]["type"] == "rate_limit_error"
    broken = {"error": {"message": SECRET, "type": "server_error", "code": "oom"}}
    err = upstream_error(500, json.dumps(broken).encode(), {}, ())
    assert err.status == 500 and SECRET not in err.message and err.code == "oom"
    assert err.message == "the upstream answered HTTP 500 (server_error, oom)"
    err = upstream_error(503, b"<html>" + SECRET.encode() + b"</html>", {}, ())
    assert err.status == 503 and SECRET not in err.message and err.code == "upstream_error"


def test_the_key_is_charged_the_usage_the_upstream_reported(servers, tmp_path):
    stub = ChatStub(cached=0)
    up = servers(stub.app)
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings(keys_file=_keys(tmp_path))))
    client = _client(gw, "k1")
    ask = [{"role": "user", "content": "hi"}]
    client.messages.create(model="llama", max_tokens=8, messages=ask)
    with client.messages.stream(model="llama", max_tokens=8, messages=ask) as stream:
        stream.get_final_message()
    metrics = httpx.get(gw.url + "/metrics", headers={"Authorization": "Bearer k1"}).text
    tokens = {
        line.split("kind=")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("prefixgate_key_tokens_total{") and 'key="a"' in line
    }
    assert tokens == {"prompt": 2 * len("hi"), "completion": 2 * 5}


@pytest.mark.parametrize("routing", ["cache_aware", "rendezvous"])
def test_messages_with_one_system_prompt_meet_on_one_upstream(servers, routing):
    engines: list[FakeEngine] = []

    def make():
        engines.append(FakeEngine())
        return create_app(engines[-1], GatewaySettings(model_name="fake"))

    urls = [servers(make).url for _ in range(3)]
    gw = servers(lambda: create_proxy_app(urls, GatewaySettings(routing=routing)))
    client = _client(gw)
    for i in range(4):
        client.messages.create(
            model="fake",
            max_tokens=2,
            system=SYSTEM * 2,  # two affinity blocks (64 characters each)
            messages=[{"role": "user", "content": f"question {i}"}],
        )
    assert sorted(len(e.requests_seen) for e in engines) == [0, 0, 4]


@pytest.mark.parametrize(
    "sent, said",
    [
        (b"data: {not json\n\n", "not JSON"),
        (b"<html>" + SECRET.encode() + b"</html>\n\n", "not server-sent events"),
        (
            b'data: {"error": {"message": "' + SECRET.encode() + b'", "type": "oom"}}\n\n',
            "the upstream ended its stream with an error (oom)",
        ),
    ],
)
def test_a_garbled_or_failed_stream_ends_with_an_error_event_never_showing_it(vllm, sent, said):
    stub, gw = vllm
    stub.after_first = sent
    text = _streamed_text(gw)
    last = text.rstrip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ") and said in last
    assert SECRET not in text and "message_stop" not in text


def test_an_upstream_refusing_the_gateway_key_is_a_502_not_the_client_s_401(servers):
    stub = ChatStub(status=401)
    up = servers(stub.app)
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings(upstream_api_key="sk-up")))
    with pytest.raises(anthropic.APIStatusError) as caught:
        _client(gw).messages.create(
            model="llama", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 502 and "sk-up" not in json.dumps(caught.value.body)
    assert stub.headers[-1]["Authorization"] == "Bearer sk-up"


def test_an_error_code_holding_the_gateway_key_is_not_named():
    from prefixgate.gateway.proxy.redact import upstream_error

    body = {"error": {"message": "x", "type": "sk_up_key", "code": "fine_code"}}
    err = upstream_error(400, json.dumps(body).encode(), {}, ("sk_up_key",))
    assert "sk_up_key" not in json.dumps(err.body())
    assert "sk_up_key" not in err.message and err.code == "fine_code"


def test_structured_output_is_translated_to_response_format(vllm):
    """``output_config.format`` (and the older ``output_format``) reach an OpenAI-compatible
    upstream as ``response_format`` json_schema, whole and streamed."""
    stub, gw = vllm
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "schema": schema}
    expected = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    for extra in ({"output_config": {"format": fmt}}, {"output_format": fmt}):
        for stream in (False, True):
            body = {
                "model": "llama",
                "max_tokens": 8,
                "stream": stream,
                "messages": [{"role": "user", "content": "hi"}],
                **extra,
            }
            r = httpx.post(gw.url + "/v1/messages", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert stub.seen[-1]["response_format"] == expected, (extra, stream)


def test_count_tokens_counts_a_format_beside_a_forced_tool_in_both_modes(serve_fake):
    """count_tokens generates nothing: an ``output_config`` format beside a forced tool call
    (a 400 on /v1/messages) is counted in local mode and was a 400 through a proxy (found by
    test_edge_combinations.py); the proxy now counts it as local mode does."""
    local, _ = serve_fake()
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    }
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    with BackgroundServer(lambda: create_proxy_app([local.url], slow)) as proxy:
        counts = []
        for base in (local.url, proxy.url):
            r = httpx.post(base + "/v1/messages/count_tokens", json=body, timeout=120)
            assert r.status_code == 200, (base, r.text)
            counts.append(r.json()["input_tokens"])
            r = httpx.post(base + "/v1/messages", json={**body, "max_tokens": 2}, timeout=120)
            assert r.status_code == 400 and "output_config" in r.text, (base, r.text)
        assert counts[0] == counts[1]


def _openai_relay(local_url: str) -> Callable[[], web.Application]:
    """An OpenAI-compatible upstream that is not prefixgate (its models owned by "vllm", no
    Messages API): ``/tokenize`` answered by the local gateway at ``local_url``."""

    async def tokenize(request: web.Request) -> web.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(local_url + "/tokenize", content=await request.read())
        return web.Response(body=r.content, status=r.status_code, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        card = {"id": "fake", "object": "model", "owned_by": "vllm"}
        return web.json_response({"object": "list", "data": [card]})

    def make() -> web.Application:
        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        app.router.add_get("/v1/models", models)
        return app

    return make


def test_count_tokens_under_tool_choice_none_counts_no_tools_in_both_modes(
    serve_fake, tools_in_prompt
):
    """``tool_choice: {"type": "none"}``: local mode renders the prompt without the tools (no
    tools in the plan), as generation does; the proxy sent ``tools`` to an OpenAI-compatible
    upstream's ``/tokenize`` anyway (a prefixgate upstream counts the Messages body itself).
    Both modes now give the count of the same body without its tools."""
    local, _ = serve_fake()
    bare = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    none = {
        **bare,
        "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "none"},
    }
    forced = {**none, "tool_choice": {"type": "any"}}
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    with (
        BackgroundServer(_openai_relay(local.url)) as up,  # counted by its /tokenize
        BackgroundServer(lambda: create_proxy_app([up.url], slow)) as proxy,
    ):
        bodies = {"bare": bare, "none": none, "forced": forced}
        counts = counts_both_modes(
            local.url, proxy.url, "/v1/messages/count_tokens", bodies, "input_tokens"
        )
    assert counts["local", "forced"] > counts["local", "none"], counts  # tools are rendered
    assert counts["local", "none"] == counts["local", "bare"], counts
    for name in ("bare", "none", "forced"):
        assert counts["proxy", name] == counts["local", name], (name, counts)


@pytest.mark.parametrize("choice", [None, {"type": "auto"}])
def test_count_tokens_counts_auto_tools_without_a_tool_call_parser_in_both_modes(
    serve_fake, tools_in_prompt, choice
):
    """A server started without ``--tool-call-parser`` counts a body with tools under
    ``tool_choice`` auto (the default with tools): the parser only parses a generated answer,
    the prompt declares the tools all the same. Local mode answered 400 "needs
    --tool-call-parser" where the proxy's count through ``/tokenize`` answered 200; both modes
    now give the same count, the tools' declarations in it, and generation keeps its 400."""
    local, _ = serve_fake()  # GatewaySettings(model_name="fake"): no tool-call parser
    bare = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    tools = {**bare, "tools": [{"name": "weather", "input_schema": {"type": "object"}}]}
    if choice is not None:
        tools["tool_choice"] = choice
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    with (
        BackgroundServer(_openai_relay(local.url)) as up,  # counted by its /tokenize
        BackgroundServer(lambda: create_proxy_app([up.url], slow)) as proxy,
    ):
        bodies = {"bare": bare, "tools": tools}
        counts = counts_both_modes(
            local.url, proxy.url, "/v1/messages/count_tokens", bodies, "input_tokens"
        )
    assert counts["local", "tools"] > counts["local", "bare"], counts  # tools are rendered
    assert counts["proxy", "tools"] == counts["local", "tools"], counts
    r = httpx.post(local.url + "/v1/messages", json={**tools, "max_tokens": 2}, timeout=120)
    assert r.status_code == 400 and "--tool-call-parser" in r.text, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_count_tokens_counts_strict_tools_a_parser_cannot_constrain_in_both_modes(
    serve_fake, tools_in_prompt
):
    """A strict tool under ``tool_choice`` auto on a server whose ``--tool-call-parser``
    format has no trigger (``llama3_json``) cannot be honoured when generating (400 naming
    ``tools[0].strict``), but the prompt declares it all the same: the count is the prompt's,
    as the proxy's count through ``/tokenize``."""
    local, _ = serve_fake(GatewaySettings(model_name="fake", tool_call_parser="llama3_json"))
    tool = {"name": "weather", "input_schema": {"type": "object"}, "strict": True}
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    with (
        BackgroundServer(_openai_relay(local.url)) as up,  # counted by its /tokenize
        BackgroundServer(lambda: create_proxy_app([up.url], slow)) as proxy,
    ):
        counts = []
        for base in (local.url, proxy.url):
            r = httpx.post(base + "/v1/messages/count_tokens", json=body, timeout=120)
            assert r.status_code == 200, (base, r.text)
            counts.append(r.json()["input_tokens"])
    assert counts[0] == counts[1], counts
    r = httpx.post(local.url + "/v1/messages", json={**body, "max_tokens": 2}, timeout=120)
    assert r.status_code == 400 and "strict" in r.text, r.text


def _paused(servers: Callable[..., BackgroundServer], pause_s: float, **settings_kw) -> str:
    """The whole streamed body from a proxy whose upstream pauses ``pause_s`` mid-stream."""
    up = servers(ChatStub(pause_s=pause_s).app)
    settings = GatewaySettings(**settings_kw)
    return _streamed_text(servers(lambda: create_proxy_app([up.url], settings)))


def test_a_silent_upstream_gets_keepalive_comments_then_the_rest(servers):
    """An upstream silent mid-stream for longer than ``--keepalive-s``: ``: keep-alive``
    comment lines (as every relay's) between the first delta and the rest; the ``anthropic``
    client reads such a stream whole."""
    lines = _paused(servers, 0.7, keepalive_s=0.2).splitlines()
    kept = lines.index(": keep-alive")
    assert "event: content_block_delta" in lines[:kept], lines
    assert "event: message_stop" in lines[kept:], lines
    up = servers(ChatStub(pause_s=0.7).app)
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings(keepalive_s=0.2)))
    with _client(gw).messages.stream(
        model="llama", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        assert stream.get_final_message().content[0].text == "hello there"


def test_a_stream_whose_upstream_goes_silent_ends_with_a_timeout(servers):
    """Silent past ``--upstream-timeout-s``: an ``error`` event saying how long it waited, the
    keep-alives sent meanwhile not pushing the limit back."""
    lines = _paused(servers, 30, keepalive_s=0.1, upstream_timeout_s=0.5).splitlines()
    assert ": keep-alive" in lines and "event: error" in lines, lines
    last = [ln for ln in lines if ln.startswith("data: ")][-1]
    assert "sent nothing for 0.5 s" in last and "message_stop" not in "".join(lines), lines


def test_an_upstream_abort_is_an_error_never_end_turn(vllm):
    """vLLM's ``finish_reason: "abort"`` (it aborted the request) has no ``stop_reason``: a
    whole message is a 502 ``request_aborted`` in Anthropic's shape, a stream ends with an
    ``error`` event (no ``message_delta`` / ``message_stop``) — as local mode ends one its
    engine aborted."""
    stub, gw = vllm
    stub.finish_reason = "abort"
    with pytest.raises(anthropic.InternalServerError) as caught:
        _client(gw).messages.create(
            model="llama", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 502 and "aborted" in caught.value.message
    text = _streamed_text(gw)
    last = text.rstrip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ") and "aborted the request" in last
    assert "message_stop" not in text and "end_turn" not in text


KEY = "sk-upstream-key-1234"


def test_an_upstream_4xx_error_event_mid_stream_keeps_its_message_scrubbed(servers):
    error = {"message": f"bad logit_bias for {KEY}", "type": "BadRequestError", "code": 400}
    stub = ChatStub(after_first=b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
    up = servers(stub.app)
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings(upstream_api_key=KEY)))
    text = _streamed_text(gw)
    last = text.rstrip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: "), last
    err = json.loads(last.split("data: ", 1)[1])["error"]
    assert err == {"type": "invalid_request_error", "message": "bad logit_bias for [redacted]"}
    assert KEY not in text and "message_stop" not in text
