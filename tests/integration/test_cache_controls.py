"""OpenAI's cache controls on the real gateway and aidreams-260k, through the official
``openai`` client: ``prompt_cache_retention``, ``prompt_cache_options`` and
``prompt_cache_breakpoint`` become the same engine pins as Anthropic's ``cache_control``
(``usage.prompt_tokens_details.cache_write_tokens`` then ``cached_tokens``), and the
``x-prefixgate-cache`` header says where each breakpoint fell and whether it hit, for chat
and messages alike."""

from __future__ import annotations

import uuid

import httpx
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from support.gateway import openai_client, serve_aidreams, wait_idle  # noqa: E402

MODEL = "aidreams"


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(aidreams_path, model_name=MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _system(tag: str) -> str:
    return f"[{tag}] " + "You are a friendly storyteller who tells short tales about animals. " * 2


def _settle(server) -> None:
    server.call(server.app[LOCAL].cache_pins.settle)


def _create(client, **kw):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2, **kw)
    return raw.parse(), raw.headers.get("x-prefixgate-cache")


def test_prompt_cache_retention_24h_pins_the_messages(server, client, pool_whole):
    system = {"role": "system", "content": _system(uuid.uuid4().hex[:8])}
    first, header = _create(
        client,
        messages=[system, {"role": "user", "content": "Tell me a story."}],
        prompt_cache_retention="24h",
    )
    details = first.usage.prompt_tokens_details
    assert details.cached_tokens == 0 and details.cache_write_tokens >= 64
    assert header.startswith("read=0; prompt_cache_retention=") and header.endswith(":written")
    _settle(server)
    pins = server.app[LOCAL].cache_pins
    assert len(pins) >= 1
    # the same conversation again: everything marked is read, nothing written
    again, header = _create(
        client,
        messages=[system, {"role": "user", "content": "Tell me a story."}],
        prompt_cache_retention="24h",
    )
    d = again.usage.prompt_tokens_details
    assert d.cached_tokens >= details.cache_write_tokens and d.cache_write_tokens == 0
    assert header.endswith(":hit")
    # in_memory is the prefix cache every prompt has: no pin, no cache_write_tokens
    plain, header = _create(
        client,
        messages=[system, {"role": "user", "content": "Another."}],
        prompt_cache_retention="in_memory",
    )
    assert plain.usage.prompt_tokens_details.cache_write_tokens is None
    assert plain.usage.prompt_tokens_details.cached_tokens >= 64
    assert header.startswith("read=")
    wait_idle(server, pool_whole, pinned_ok=True)


def test_explicit_breakpoint_on_the_system_part(server, client, pool_whole):
    text = _system(uuid.uuid4().hex[:8])
    messages = [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": text, "prompt_cache_breakpoint": {"mode": "explicit"}}
            ],
        },
        {"role": "user", "content": "Tell me a story."},
    ]
    first, header = _create(
        client, messages=messages, extra_body={"prompt_cache_options": {"mode": "explicit"}}
    )
    written = first.usage.prompt_tokens_details.cache_write_tokens
    assert written >= 64
    assert f"messages.0.content.0.prompt_cache_breakpoint={written}:written" in header
    _settle(server)
    other = [messages[0], {"role": "user", "content": "A different question."}]
    again, header = _create(client, messages=other, extra_body={"prompt_cache_options": {}})
    d = again.usage.prompt_tokens_details
    assert d.cached_tokens >= written
    assert f"messages.0.content.0.prompt_cache_breakpoint={written}:hit" in header
    # stream == non-stream usage (include_usage)
    stream = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=other,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"prompt_cache_options": {}},
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.model_dump() == d.model_dump()
    wait_idle(server, pool_whole, pinned_ok=True)


def test_cache_control_bad_values_are_400s_naming_them(server):
    part = {"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit"}}
    cases = [
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
        ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
        ({"prompt_cache_options": {"mode": "x"}}, "prompt_cache_options.mode"),
        (
            {"messages": [{"role": "user", "content": [part] * 5}]},
            "messages.0.content.4.prompt_cache_breakpoint",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "x", "prompt_cache_breakpoint": {"ttl": "30m"}}
                        ],
                    }
                ]
            },
            "messages.0.content.0.prompt_cache_breakpoint.mode",
        ),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        body.update(extra)
        r = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)


def test_messages_header_says_written_then_hit(server, pool_whole):
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "system": [
            {
                "type": "text",
                "text": _system(uuid.uuid4().hex[:8]),
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200
    written = r.json()["usage"]["cache_creation_input_tokens"]
    assert r.headers["x-prefixgate-cache"] == f"read=0; system.0={written}:written"
    _settle(server)
    body["messages"] = [{"role": "user", "content": "Another one."}]
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    read = r.json()["usage"]["cache_read_input_tokens"]
    assert r.headers["x-prefixgate-cache"] == f"read={read}; system.0={written}:hit"
    body["stream"] = True
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as s:
        assert s.headers["x-prefixgate-cache"] == f"system.0={written}"
        s.read()
    wait_idle(server, pool_whole, pinned_ok=True)


def test_responses_cache_controls(server, client, pool_whole):
    """The Responses API takes the chat's cache controls: ``prompt_cache_key`` (no effect),
    ``prompt_cache_options`` (implicit: the end of the input pinned, its ttl), a part's
    ``prompt_cache_breakpoint``; usage ``cache_write_tokens`` then ``cached_tokens``."""
    text = _system(uuid.uuid4().hex[:8])
    first = client.responses.create(
        model=MODEL,
        max_output_tokens=2,
        instructions=text,
        input="Tell me a story.",
        prompt_cache_key="stories",
        prompt_cache_options={"mode": "implicit", "ttl": "12h"},
    )
    d = first.usage.input_tokens_details
    assert d.cached_tokens == 0 and d.cache_write_tokens >= 64
    assert d.cache_write_tokens_details.ttl_12h_tokens == d.cache_write_tokens
    assert first.prompt_cache_key == "stories"
    assert first.prompt_cache_options.ttl == "12h"
    _settle(server)
    pins = server.app[LOCAL].cache_pins
    assert any(p.ttl_s == 43_200.0 for p in pins._pins.values())  # the 12h TTL took effect
    part = {
        "type": "input_text",
        "text": text,
        "prompt_cache_breakpoint": {"mode": "explicit"},
    }
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        max_output_tokens=2,
        input=[
            {"role": "system", "content": [part]},
            {"role": "user", "content": "Tell me a story."},
        ],
        prompt_cache_options={"mode": "explicit"},
    )
    again = raw.parse()
    d2 = again.usage.input_tokens_details
    assert d2.cached_tokens >= d.cache_write_tokens and d2.cache_write_tokens == 0
    assert "input.0.content.0.prompt_cache_breakpoint=" in raw.headers["x-prefixgate-cache"]
    assert raw.headers["x-prefixgate-cache"].endswith(":hit")
    assert d2.cached_tokens + d2.cache_write_tokens <= again.usage.input_tokens
    wait_idle(server, pool_whole, pinned_ok=True)


def _tokens(server, messages) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages})
    return r.json()["tokens"]


def test_responses_prompt_cache_diagnostics_against_a_token_diff(server, client, pool_whole):
    """``prompt_cache_options.comparison_response_id``: the answer's
    ``prompt_cache_diagnostics`` in OpenAI's shape, checked against the two prompts' token
    ids (the header's ``at=`` is their first differing index)."""
    tag = uuid.uuid4().hex[:8]
    first = client.responses.create(
        model=MODEL, max_output_tokens=2, instructions=_system(tag), input="A?"
    )
    assert first.prompt_cache_diagnostics is None  # not asked for
    _settle(server)
    first_ids = _tokens(
        server, [{"role": "system", "content": _system(tag)}, {"role": "user", "content": "A?"}]
    )
    assert len(first_ids) == first.usage.input_tokens
    reusable = len(first_ids) // 16 * 16

    def ask(instructions, text, **kw):
        raw = client.responses.with_raw_response.create(
            model=MODEL,
            max_output_tokens=2,
            instructions=instructions,
            input=text,
            prompt_cache_options={"comparison_response_id": first.id},
            **kw,
        )
        return raw.parse(), raw.headers["x-prefixgate-cache"]

    same, header = ask(_system(tag), "B?")
    assert same.prompt_cache_diagnostics.type == "cache_hit"
    assert same.usage.input_tokens_details.cached_tokens >= reusable
    b_ids = _tokens(
        server, [{"role": "system", "content": _system(tag)}, {"role": "user", "content": "B?"}]
    )
    b_at = next(i for i, (a, b) in enumerate(zip(first_ids, b_ids, strict=False)) if a != b)
    assert b_at >= reusable and header.endswith(f"compare=hit:at={b_at}")
    changed_sys = _system(tag + "x")
    changed, header = ask(changed_sys, "A?")
    d = changed.prompt_cache_diagnostics
    assert d.type == "cache_miss" and d.reason == "input_changed"
    ids = _tokens(
        server, [{"role": "system", "content": changed_sys}, {"role": "user", "content": "A?"}]
    )
    at = next(i for i, (a, b) in enumerate(zip(first_ids, ids, strict=False)) if a != b)
    read = changed.usage.input_tokens_details.cached_tokens
    assert read == at // 16 * 16  # the prefix cache reads the whole blocks before the divergence
    assert d.comparison_reusable_tokens == reusable and d.cache_missed_tokens == reusable - read
    assert header.endswith(f"compare=system_changed:missed={reusable - read}:at={at}")
    salted, header = ask(_system(tag), "A?", extra_body={"cache_salt": "another"})
    assert salted.prompt_cache_diagnostics.type == "comparison_response_not_found"
    assert header.endswith("compare=salt_differs")
    assert salted.usage.input_tokens_details.cached_tokens == 0
    short = client.responses.create(model=MODEL, max_output_tokens=2, input="hi")
    assert short.usage.input_tokens < 16
    below = client.responses.create(
        model=MODEL,
        max_output_tokens=2,
        input="hi",
        prompt_cache_options={"comparison_response_id": short.id},
    )
    assert below.prompt_cache_diagnostics.type == "unavailable"
    with client.responses.stream(
        model=MODEL,
        max_output_tokens=2,
        instructions=_system(tag),
        input="C?",
        prompt_cache_options={"comparison_response_id": "resp_unknown"},
    ) as stream:
        last = list(stream)[-1]  # response.incomplete here: max_output_tokens cut it
    assert last.response.prompt_cache_diagnostics.type == "comparison_response_not_found"
    wait_idle(server, pool_whole, pinned_ok=True)
