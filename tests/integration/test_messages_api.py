"""Anthropic's Messages API on the real gateway and the real aidreams-260k model, driven by the
official ``anthropic`` package: cached system blocks written then read, stream == non-stream,
``count_tokens`` == usage, stop sequences, tool use, Anthropic-shaped 400s, ``x-api-key``.

aidreams has a 128-token context: the cached system prompt is ~96 tokens (6 KV blocks of 16)
and answers are a few tokens.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from support.gateway import module_server, wait_idle  # noqa: E402

MODEL = "aidreams"
server = module_server(MODEL, max_queued_requests=32)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def _system(tag: str) -> str:
    """A system prompt of ~90 tokens, unique per test (no test reads another's cache)."""
    return f"[{tag}] " + "You are a friendly storyteller who tells short tales about animals. " * 2


def _cached_system(tag: str, ttl: str | None = None) -> list[dict]:
    cc: dict = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    return [{"type": "text", "text": _system(tag), "cache_control": cc}]


def _total(u) -> int:
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


def _settle(server) -> None:
    server.call(server.app[LOCAL].cache_pins.settle)


def test_cached_system_block_written_then_read(server, client, pool_whole):
    tag = uuid.uuid4().hex[:8]
    system = _cached_system(tag)
    first_msgs = [{"role": "user", "content": "Tell me a story."}]
    first = client.messages.create(
        model=MODEL, max_tokens=4, system=system, messages=first_msgs, extra_body={"temperature": 0}
    )
    u = first.usage
    assert u.cache_read_input_tokens == 0
    assert u.cache_creation_input_tokens >= 64
    assert u.cache_creation.ephemeral_5m_input_tokens == u.cache_creation_input_tokens
    assert u.cache_creation.ephemeral_1h_input_tokens == 0
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=first_msgs)
    assert _total(u) == counted.input_tokens
    _settle(server)
    assert server.app[LOCAL].engine.stats()["pinned_blocks"] >= 4
    # another question on the same system prompt reads the pinned blocks
    again_msgs = [{"role": "user", "content": "Now a different one, please."}]
    again = client.messages.create(
        model=MODEL, max_tokens=4, system=system, messages=again_msgs, extra_body={"temperature": 0}
    )
    v = again.usage
    assert v.cache_read_input_tokens >= 64
    assert v.cache_read_input_tokens >= u.cache_creation_input_tokens
    assert v.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=again_msgs)
    assert _total(v) == counted.input_tokens
    wait_idle(server, pool_whole, pinned_ok=True)


def test_breakpoint_pin_survives_cache_pressure(server, client, pool_whole):
    """The pinned breakpoint is read even after other prompts have cycled more than the
    whole KV cache through (without the pin it would be evicted)."""
    tag = uuid.uuid4().hex[:8]
    system = _cached_system(tag, ttl="1h")
    msgs = [{"role": "user", "content": "Tell me a story."}]
    first = client.messages.create(model=MODEL, max_tokens=2, system=system, messages=msgs)
    assert first.usage.cache_creation.ephemeral_1h_input_tokens >= 64
    # a prompt with no breakpoint: its blocks are only cached, so the pressure evicts them
    control = dict(model=MODEL, max_tokens=1, system=_system(tag + "-control"), messages=msgs)
    unpinned = client.messages.create(**control)
    _settle(server)
    total_blocks = server.app[LOCAL].engine.stats()["kv_blocks_total"]
    # ~7 blocks per prompt: 3x the KV capacity of distinct prompts, none cached
    for i in range(3 * total_blocks // 7 + 1):
        client.messages.create(
            model=MODEL,
            max_tokens=1,
            system=_system(f"{tag}-{i}"),
            messages=[{"role": "user", "content": f"noise {i}"}],
        )
    stats = server.app[LOCAL].engine.stats()
    assert stats["prefix_cache_evictions"] > 0
    probe = client.messages.create(
        model=MODEL,
        max_tokens=2,
        system=system,
        messages=[{"role": "user", "content": "Another one."}],
    )
    assert probe.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    # the same unpinned prompt again, compared with its first answer: evicted, by the diagnosis
    raw = client.messages.with_raw_response.create(
        **control, extra_body={"diagnostics": {"previous_message_id": unpinned.id}}
    )
    again = raw.parse()
    assert again.diagnostics.cache_miss_reason.type == "unavailable"
    reusable = unpinned.usage.input_tokens // 16 * 16
    missed = reusable - again.usage.cache_read_input_tokens
    assert missed > 0 and raw.headers["x-prefixgate-cache"] == (
        f"read={again.usage.cache_read_input_tokens}; compare=evicted:missed={missed}"
    )
    wait_idle(server, pool_whole, pinned_ok=True)


def test_stream_equals_non_stream_at_temperature_0(server, client, pool_whole):
    tag = uuid.uuid4().hex[:8]
    kwargs = dict(
        model=MODEL,
        max_tokens=8,
        system=_cached_system(tag),
        messages=[{"role": "user", "content": "Once upon a time there was a little"}],
        extra_body={"temperature": 0},
    )
    whole = client.messages.create(**kwargs)
    _settle(server)
    whole_again = client.messages.create(**kwargs)  # both reads: the same usage
    events = []
    with client.messages.stream(**kwargs) as stream:
        for ev in stream:
            events.append(ev.type)
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.model_dump() == whole_again.usage.model_dump()
    assert _total(streamed.usage) == _total(whole.usage)
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert "message_delta" in events
    wait_idle(server, pool_whole, pinned_ok=True)


def test_raw_stream_event_sequence(server, pool_whole):
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Once upon a time there was a little"}],
    }
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        kinds = [ln.split(": ", 1)[1] for ln in r.iter_lines() if ln.startswith("event: ")]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) <= {"content_block_delta"}
    wait_idle(server, pool_whole, pinned_ok=True)


def test_stop_sequences(server, client, pool_whole):
    kwargs = dict(
        model=MODEL,
        max_tokens=20,
        messages=[{"role": "user", "content": "Once upon a time there was a little"}],
        extra_body={"temperature": 0},
    )
    free = client.messages.create(**kwargs)
    text = free.content[0].text
    assert len(text) > 4, text
    stop = text[2:4]
    cut = client.messages.create(stop_sequences=[stop], **kwargs)
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    wait_idle(server, pool_whole, pinned_ok=True)


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_forced_tool_use_and_tool_result(server, client, pool_whole):
    kwargs = dict(
        model=MODEL,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_body={"temperature": 0},
    )
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use", whole
    (call,) = [b for b in whole.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    assert call.id.startswith("toolu_")
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    (scall,) = [b for b in streamed.content if b.type == "tool_use"]
    assert scall.input == call.input and streamed.stop_reason == "tool_use"
    # the answer goes back as a tool_result turn
    reply = client.messages.create(
        model=MODEL,
        max_tokens=4,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
            },
        ],
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")
    wait_idle(server, pool_whole, pinned_ok=True)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"container": "c1"}, "container"),
        ({"output_config": {"effort": "low"}}, "output_config"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"inference_geo": "us"}, "inference_geo"),
        ({"speed": "fast"}, "speed"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"temperature": 1.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "url", "url": "http://x/y.png"},
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.type",
        ),
        (
            {
                "system": [
                    {"type": "text", "text": f"s{i}", "cache_control": {"type": "ephemeral"}}
                    for i in range(5)
                ]
            },
            "cache_control",
        ),
    ],
)
def test_unimplemented_fields_are_anthropic_400s(client, extra, named):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body=body, cast_to=dict)
    err = info.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert named in err["error"]["message"]


def test_missing_max_tokens_and_unknown_model(server):
    r = httpx.post(
        server.url + "/v1/messages",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400
    assert r.json()["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: field required",
    }
    r = httpx.post(
        server.url + "/v1/messages",
        json={
            "model": "claude-x",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages/count_tokens", content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"


keyed_server = module_server(MODEL, name="keyed_server", api_keys=["sk-ant-test"])


def test_x_api_key_and_bearer(keyed_server, pool_whole):
    msgs = [{"role": "user", "content": "hi"}]
    by_x_api_key = anthropic.Anthropic(
        base_url=keyed_server.url, api_key="sk-ant-test", max_retries=0
    )
    assert by_x_api_key.messages.create(model=MODEL, max_tokens=1, messages=msgs).usage
    by_bearer = anthropic.Anthropic(
        base_url=keyed_server.url, auth_token="sk-ant-test", max_retries=0
    )
    assert by_bearer.messages.count_tokens(model=MODEL, messages=msgs).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=keyed_server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=MODEL, max_tokens=1, messages=msgs)
    assert info.value.body["error"]["type"] == "authentication_error"
    wait_idle(keyed_server, pool_whole)


def test_pool_whole_after_pins_released(server, client, pool_whole):
    client.messages.create(
        model=MODEL,
        max_tokens=1,
        system=_cached_system(uuid.uuid4().hex[:8]),
        messages=[{"role": "user", "content": "hi"}],
    )
    _settle(server)
    server.app[LOCAL].cache_pins.clear()
    wait_idle(server, pool_whole)


def test_cache_diagnostics_against_a_previous_message(server, client, pool_whole):
    tag = uuid.uuid4().hex[:8]
    system = _cached_system(tag)
    first = client.messages.create(
        model=MODEL, max_tokens=2, system=system, messages=[{"role": "user", "content": "A?"}]
    )
    assert first.diagnostics is None  # not asked for
    _settle(server)

    def ask(**kw):
        return client.messages.create(
            model=MODEL,
            max_tokens=2,
            extra_body={"diagnostics": {"previous_message_id": first.id}},
            **kw,
        )

    same = ask(system=system, messages=[{"role": "user", "content": "B?"}])
    assert same.usage.cache_read_input_tokens >= 64
    assert same.diagnostics is not None and same.diagnostics.cache_miss_reason is None
    changed = ask(system=_cached_system(tag + "x"), messages=[{"role": "user", "content": "A?"}])
    reason = changed.diagnostics.cache_miss_reason
    assert reason.type == "system_changed"
    assert reason.cache_missed_input_tokens >= 64
    assert changed.usage.cache_read_input_tokens + reason.cache_missed_input_tokens >= 96
    with client.messages.stream(
        model=MODEL,
        max_tokens=2,
        system=system,
        messages=[
            {"role": "user", "content": "A?"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "C?"},
        ],
        extra_body={"diagnostics": {"previous_message_id": "msg_unknown"}},
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    wait_idle(server, pool_whole, pinned_ok=True)
