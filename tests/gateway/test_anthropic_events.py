"""The shared Anthropic message/event builder (``wire.anthropic_events``) both modes feed."""

from __future__ import annotations

import json

import pytest
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.wire.anthropic_events import (
    MessageEvents,
    content_blocks,
    error_event,
    stop_reason,
    usage_block,
)


@pytest.mark.parametrize(
    ("finish", "called", "sequence", "want"),
    [
        ("stop", False, None, ("end_turn", None)),
        ("stop", False, "END", ("stop_sequence", "END")),
        ("stop", True, "END", ("tool_use", None)),
        ("length", True, "END", ("max_tokens", None)),
        ("tool_calls", False, None, ("tool_use", None)),
        ("function_call", False, None, ("tool_use", None)),
        ("content_filter", True, None, ("refusal", None)),
        ("abort", False, None, ("end_turn", None)),
    ],
)
def test_stop_reason(finish, called, sequence, want):
    assert stop_reason(finish, called, sequence) == want


def _parse(frames: list[bytes]) -> list[dict]:
    out = []
    for frame in frames:
        head, data = frame.decode().removesuffix("\n\n").split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == "event: " + body["type"]
        out.append(body)
    return out


def test_event_order_blocks_and_usage():
    ev = MessageEvents("msg_1", "m")
    start_usage = usage_block(0, 0, None, 0)
    frames = ev.start(start_usage) + ev.text("hé") + ev.text("llo")
    frames += ev.tool_use("toolu_a", "f")
    first = ev.index
    frames += ev.tool_use("toolu_b", "g")
    frames.append(ev.input_json(first, '{"a":1}'))
    frames += ev.finish(("tool_use", None), {**usage_block(7, 0, 3, 5), "service_tier": "x"})
    events = _parse(frames)
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["cache_read_input_tokens"] is None  # unknown, not 0
    assert events[9] == {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"a":1}'},
    }
    assert events[11]["usage"] == {
        "input_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 3,
        "output_tokens": 5,
    }
    assert b"h\xc3\xa9" in frames[3]  # UTF-8 as is


def test_nothing_said_is_one_empty_text_block():
    ev = MessageEvents("msg_1", "m")
    events = _parse(
        ev.start(usage_block(0, 0, 0, 0)) + ev.finish(("end_turn", None), usage_block(1, 0, 0, 0))
    )
    assert events[2] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert events[3] == {"type": "content_block_stop", "index": 0}
    assert content_blocks("", []) == [{"type": "text", "text": ""}]
    assert content_blocks(None, [("t", "f", {})]) == [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    ]


def test_error_event_is_anthropics_shape():
    frame = error_event(APIError(503, "shutting down"))
    assert frame.startswith(b"event: error\ndata: ") and frame.endswith(b"\n\n")
    body = json.loads(frame.split(b"data: ", 1)[1])
    assert body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "shutting down"},
    }
