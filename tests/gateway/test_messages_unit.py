"""The Messages API's parts without a model: the request as a chat, its breakpoints, the usage
split (read + written + input == prompt), the breakpoint pins' share of a key, and upstream
mode's own errors in Anthropic's error shape."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.cache_marks import Mark, cache_header
from prefixgate.gateway.local.cache_pins import CachePins, pin_key
from prefixgate.gateway.local.messages import anthropic_usage
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.wire.anthropic_models import MessagesRequest, parse_request, to_chat
from support.fake_engine import FakeEngine

CC = {"type": "ephemeral"}


def _req(**body) -> MessagesRequest:
    import json

    base = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return parse_request(MessagesRequest, json.dumps({**base, **body}).encode())


def _refusal(**body) -> APIError:
    """The error ``to_chat`` raises on the request ``_req(**body)``."""
    with pytest.raises(APIError) as info:
        to_chat(_req(**body))
    return info.value


def test_to_chat_system_tools_tool_use_and_results():
    req = _req(
        system=[
            {"type": "text", "text": "A. "},
            {"type": "text", "text": "B.", "cache_control": CC},
        ],
        tools=[
            {
                "name": "f",
                "description": "d",
                "input_schema": {"type": "object", "properties": {}},
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            }
        ],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                    {"type": "text", "text": "thanks", "cache_control": CC},
                ],
            },
        ],
        cache_control=CC,
    )
    chat = to_chat(req)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert chat.messages == [
        {"role": "system", "content": "A. B."},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"x": 1}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "42"},
        {"role": "user", "content": "thanks"},
    ]
    where = [(b.where, b.ttl_s, len(b.messages)) for b in chat.breakpoints]
    assert where == [
        ("tools.0", 3600.0, 0),
        ("system.1", 300.0, 1),
        ("messages.2.content.1", 300.0, 5),
        ("cache_control", 300.0, 5),
    ]


def test_more_than_four_breakpoints_is_a_400_naming_the_fifth():
    blocks = [{"type": "text", "text": f"s{i}", "cache_control": CC} for i in range(4)]
    err = _refusal(system=blocks, cache_control=CC)
    assert err.status == 400 and err.param == "cache_control.cache_control"


def test_a_final_assistant_turn_prefill_is_refused():
    err = _refusal(
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "The answer is"},
        ]
    )
    assert err.status == 400 and err.param == "messages.1.role"


def test_tool_result_in_an_assistant_turn_is_refused():
    err = _refusal(
        messages=[
            {
                "role": "assistant",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
            },
            {"role": "user", "content": "q"},
        ]
    )
    assert err.param == "messages.0.content.0"


@pytest.mark.parametrize(
    ("prompt", "cached", "marks", "expect"),
    [
        (100, 0, [], (100, 0, 0)),
        (100, 0, [Mark("system.0", 64, 300.0)], (36, 64, 0)),
        (100, 64, [Mark("system.0", 64, 300.0)], (36, 0, 64)),
        (100, 96, [Mark("system.0", 64, 300.0)], (4, 0, 96)),  # more read than marked
        (100, 32, [Mark("a", 32, 3600.0), Mark("b", 80, 300.0)], (20, 48, 32)),
        (100, 0, [Mark("b", 80, 300.0), Mark("a", 32, 3600.0)], (20, 80, 0)),
        (100, 0, [Mark("tools.0", 0, 300.0)], (100, 0, 0)),  # below one block
    ],
)
def test_usage_splits_the_prompt_exactly(prompt, cached, marks, expect):
    u = anthropic_usage(prompt, cached, 3, marks)
    got = (u["input_tokens"], u["cache_creation_input_tokens"], u["cache_read_input_tokens"])
    assert got == expect
    assert sum(got) == prompt
    split = u["cache_creation"]
    assert split["ephemeral_5m_input_tokens"] + split["ephemeral_1h_input_tokens"] == got[1]


def test_usage_ttl_split():
    u = anthropic_usage(100, 0, 1, [Mark("a", 32, 3600.0), Mark("b", 80, 300.0)])
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": 48, "ephemeral_1h_input_tokens": 32}


def test_cache_header():
    marks = [Mark("system.0", 64, 300.0, "hit"), Mark("tools.0", 0, 300.0, "below_one_block")]
    assert cache_header(marks, 64) == "read=64; system.0=64:hit; tools.0=0:below_one_block"
    assert cache_header([Mark("system.0", 64, 300.0)]) == "system.0=64"


def test_breakpoint_pins_keep_to_the_key_share():
    async def scenario() -> None:
        engine = FakeEngine(num_blocks=64, max_pinned_fraction=0.5)  # 32 blocks may be pinned
        other = {"k": 1}  # the key's prefixes (prefix API) pin 1 block of its share
        pins = CachePins(engine, lambda owner: other.get(owner, 0))
        a, b, c = list(range(64)), list(range(100, 164)), list(range(400, 416))
        big = list(range(200, 312))  # 7 blocks

        async def pin(ids, owner="k", share=9, salt="s"):
            pins.pin_soon([(ids, 300.0)], salt, owner, share)
            await pins.settle()
            return pins.outcomes[pin_key(salt, ids)]

        assert await pin(a) == "pinned"  # 4 blocks (+ 1 of the prefixes) of 9
        assert await pin(a) == "kept"  # the same breakpoint with its TTL mostly left
        assert pins.held_blocks("k") == 4 and len(engine._pins) == 1
        assert await pin(b) == "pinned"  # 4 + 4 + 1 = 9: fits
        assert await pin(c) == "pinned"  # 1 more: the least recently used (a) released
        assert pins.live("s", a) is None and pins.live("s", b) is not None
        assert await pin(big) == "pinned"  # 7 more: b released too
        assert pins.live("s", b) is None and pins.live("s", c) is not None
        assert pins.held_blocks("k") + other["k"] == 9
        assert await pin(list(range(500, 660))) == "over_share"  # 10 blocks > the share
        assert pins.live("s", big) is not None  # nothing released for it
        # another tenant never releases this key's pins
        assert await pin(a, owner="j", share=0, salt="t") == "pinned"
        assert pins.live("s", big) is not None and pins.live("s", c) is not None
        # the engine's pinned space is full: not pinned, and said so
        huge = list(range(1000, 1000 + 16 * 30))
        assert await pin(huge, owner="j", share=0, salt="t") == "pinned_space_full"
        pins.clear()
        assert engine.pinned_blocks == 0

    asyncio.run(scenario())


def test_messages_routes_answer_in_anthropic_shape_in_upstream_mode():
    """Upstream mode serves both routes (``proxy.messages_relay``); its own errors take
    Anthropic's shape: a bad body a 400 naming the field, no live upstream a 5xx."""
    with BackgroundServer(
        lambda: create_proxy_app(["http://127.0.0.1:9"], GatewaySettings())
    ) as gw:
        for path, extra in (("/v1/messages", {"max_tokens": 1}), ("/v1/messages/count_tokens", {})):
            r = httpx.post(gw.url + path, json={"model": "m", "messages": [], **extra})
            assert r.status_code == 400
            body = r.json()
            assert body["type"] == "error" and "messages" in body["error"]["message"]
            ok = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
            r = httpx.post(gw.url + path, json=ok)
            assert r.status_code in (502, 503) and r.json()["type"] == "error"


def test_prefixes_and_breakpoints_share_one_pin_share():
    """A key's prefixes (prefix API) and breakpoint pins count in one max_pinned_blocks; a
    prefix needing room releases the key's least recently used breakpoints first."""
    from prefixgate.gateway.local.prefixes import PrefixQuota, PrefixRegistry

    async def scenario() -> None:
        engine = FakeEngine(num_blocks=64, max_pinned_fraction=0.5)
        registry = PrefixRegistry(engine)
        pins = CachePins(engine, registry.pinned_blocks)
        registry.breakpoints = pins
        pins.pin_soon([(list(range(64)), 300.0), (list(range(100, 164)), 300.0)], "s", "k", 9)
        await pins.settle()
        assert pins.held_blocks("k") == 8
        quota = PrefixQuota(max_prefixes=0, max_pinned_blocks=9)
        entry = await registry.create(
            [{"role": "system", "content": "x"}], list(range(300, 365)), 60.0, "s", "s", "k", quota
        )
        assert entry.pinned_blocks == 4
        assert pins.held_blocks("k") == 4  # the older breakpoint gave way
        assert pins.live("s", list(range(100, 164))) is not None
        assert registry.pinned_blocks("k") + pins.held_blocks("k") <= 9
        # a breakpoint now has room for at most 1 more block: 4 blocks releases the other one
        pins.pin_soon([(list(range(500, 564)), 300.0)], "s", "k", 9)
        await pins.settle()
        assert pins.held_blocks("k") == 4 and registry.pinned_blocks("k") == 4
        registry.clear()
        pins.clear()
        assert engine.pinned_blocks == 0

    asyncio.run(scenario())


def test_errors_before_the_handler_take_anthropic_shape(serve_fake):
    """Body limits and the admission queue answer /v1/messages in Anthropic's shape too."""
    srv, _ = serve_fake(GatewaySettings(model_name="fake", max_body_bytes=1024))
    big = {"model": "fake", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 4096}]}
    r = httpx.post(srv.url + "/v1/messages", json=big)
    assert r.status_code == 413
    assert r.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": r.json()["error"]["message"]},
    }
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(srv.url + "/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_fake_engine_message_and_stream(serve_fake):
    srv, _ = serve_fake()
    body = {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]}
    r = httpx.post(srv.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
    u = msg["usage"]
    assert u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"] > 0
    assert r.headers["x-prefixgate-cache"].startswith("read=")
    with httpx.stream("POST", srv.url + "/v1/messages", json={**body, "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    import json

    events = [json.loads(ln[6:]) for ln in lines]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == msg["content"][0]["text"]
    assert events[-2]["usage"]["output_tokens"] == u["output_tokens"]
    assert events[-2]["delta"]["stop_reason"] == msg["stop_reason"]


def test_cache_miss_reasons():
    from prefixgate.gateway.local.cache_diagnostics import PromptLog, cache_miss_reason

    log = PromptLog(size=8)
    tools = [{"type": "function", "function": {"name": "f"}}]
    sys_a = [{"role": "system", "content": "a"}, {"role": "user", "content": "q"}]
    log.add("m1", "s", list(range(40)), sys_a, tools)
    prev = log.get("m1", "s")
    assert log.get("m1", "other-tenant") is None and log.get("nope", "s") is None

    def cur(ids, messages=sys_a, tl=tools):
        log.add("cur", "s", ids, messages, tl)
        return log.get("cur", "s")

    assert cache_miss_reason(None, cur(list(range(40))), 0, 16) == {
        "type": "previous_message_not_found"
    }
    assert cache_miss_reason(prev, cur(list(range(50))), 32, 16) is None  # read all 32
    assert cache_miss_reason(prev, cur(list(range(50))), 16, 16) == {"type": "unavailable"}
    changed = [9, *range(1, 40)]
    assert cache_miss_reason(prev, cur(changed, tl=[]), 0, 16) == {
        "type": "tools_changed",
        "cache_missed_input_tokens": 32,
    }
    other_sys = [{"role": "system", "content": "b"}, sys_a[1]]
    assert cache_miss_reason(prev, cur(changed, other_sys), 0, 16)["type"] == "system_changed"
    turns = [sys_a[0], {"role": "user", "content": "r"}]
    assert cache_miss_reason(prev, cur(list(range(20)) + [0] * 20, turns), 16, 16) == {
        "type": "messages_changed",
        "cache_missed_input_tokens": 16,
    }


@pytest.mark.parametrize("field", ["tools", "messages"])
def test_a_non_list_tools_or_messages_is_a_400_naming_it(field):
    from prefixgate.gateway.wire.anthropic_models import CountTokensRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: -9276}
    with pytest.raises(APIError) as caught:
        parse_request(CountTokensRequest, json.dumps(body).encode())
    assert caught.value.status == 400 and field in caught.value.message
