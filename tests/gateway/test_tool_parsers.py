"""Tool-call parsers on recorded model outputs of each format, whole and streamed in fragments
split anywhere (names and JSON cut mid-way): the stream always yields the final result."""

from __future__ import annotations

import json
import random

import pytest
from prefixgate.gateway.wire.tool_parsers import ToolStream, get_parser
from prefixgate.gateway.wire.tools import RequiredStream, ToolDeltas, ToolPlan, parse_output

# (parser, recorded output, expected content, expected [(name, arguments dict)])
RECORDED = [
    (  # Qwen2.5-7B-Instruct, two parallel calls after a sentence
        "hermes",
        "Let me check both cities.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n'
        "</tool_call>",
        "Let me check both cities.\n\n",
        [
            ("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("get_weather", {"city": "Zürich", "unit": "celsius"}),
        ],
    ),
    (  # Hermes-2-Pro: arguments with nested objects and a string holding "</tool"
        "hermes",
        '<tool_call>\n{"arguments": {"q": {"text": "a </tool b", "n": [1, 2]}}, "name": "search"}\n</tool_call>',
        "",
        [("search", {"q": {"text": "a </tool b", "n": [1, 2]}})],
    ),
    (  # hermes: a malformed block stays text
        "hermes",
        "I will call <tool_call>{not json}</tool_call> now",
        "I will call <tool_call>{not json}</tool_call> now",
        [],
    ),
    ("hermes", "Plain answer, no tools <tool", "Plain answer, no tools <tool", []),
    (  # Llama-3.1-8B-Instruct JSON tool calling
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    ("llama3_json", "The weather is {sunny}.", "The weather is {sunny}.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, not a call
    (  # Mistral-7B-Instruct-v0.3
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        "",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "CET"})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "f", "arguments": {}}]',
        "Sure. ",
        [("f", {})],
    ),
    ("mistral", "No calls [TOOL_CA", "No calls [TOOL_CA", []),
    # prose after a complete call: the call is kept, the prose is content (never all-or-nothing)
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nDone, I called f.',
        "\nDone, I called f.",
        [("f", {"a": 1})],
    ),
    (  # an unclosed last block: its call, then the prose the model went on with
        "hermes",
        'Ok <tool_call>{"name": "f", "arguments": {}} and then some words',
        "Ok  and then some words",
        [("f", {})],
    ),
    (
        "llama3_json",
        '{"name": "a", "parameters": {"x": 1}} I hope this helps!',
        "I hope this helps!",
        [("a", {"x": 1})],
    ),
    (  # a complete call, then a cut one: the complete call is kept, the rest is content
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "param',
        '{"name": "b", "param',
        [("a", {})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}] Anything else?',
        "Sure. Anything else?",
        [("f", {"q": "x"})],
    ),
    (  # an item that is not a call: the whole array stays text
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, 3] tail',
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, 3] tail',
        [],
    ),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_whole_output(name, text, content, calls):
    got_content, got_calls = get_parser(name).split(text, True)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_streamed_in_fragments_split_anywhere(name, text, content, calls):
    rng = random.Random(hash(text) & 0xFFFF)
    splits = [[1] * len(text), [len(text)]] + [
        [rng.randint(1, 7) for _ in range(len(text))] for _ in range(20)
    ]
    for sizes in splits:
        stream = ToolStream(get_parser(name))
        got_content, got_calls, pos = "", [], 0
        for size in sizes:
            if pos >= len(text):
                break
            piece, new = stream.feed(text[pos : pos + size])
            pos += size
            got_content += piece
            got_calls += new
            # nothing sent early is ever taken back
            assert content.startswith(got_content)
            assert _calls(got_calls) == calls[: len(got_calls)]
        piece, new = stream.finish()
        got_content += piece
        got_calls += new
        assert got_content == content, sizes
        assert _calls(got_calls) == calls, sizes


def test_unknown_parser_named():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


def test_required_stream_any_split():
    text = '[{"name": "a", "parameters": {"s": "x}]{\\"y"}}, {"name": "b", "parameters": {}}]'
    for size in (1, 2, 3, 5, 100):
        rs = RequiredStream()
        calls = []
        for i in range(0, len(text), size):
            calls += rs.feed(text[i : i + size])
        assert _calls(calls) == [("a", {"s": 'x}]{"y'}), ("b", {})]


def test_tool_deltas_named_streams_arguments_with_index():
    td = ToolDeltas(ToolPlan("named", [], "get_weather"))
    chunks = td.feed('{"city": ') + td.feed('"Paris"}') + td.finish()
    first = chunks[0]["tool_calls"][0]
    assert first["index"] == 0 and first["function"]["name"] == "get_weather"
    assert first["id"].startswith("call_") and first["type"] == "function"
    args = "".join(c["tool_calls"][0]["function"]["arguments"] for c in chunks)
    assert json.loads(args) == {"city": "Paris"}
    assert all(c["tool_calls"][0]["index"] == 0 for c in chunks) and td.called


def test_tool_deltas_auto_indexes_calls_in_order():
    td = ToolDeltas(ToolPlan("auto", [], None, None, get_parser("hermes")))
    text = RECORDED[0][1]
    out = []
    for i in range(0, len(text), 4):
        out += td.feed(text[i : i + 4])
    out += td.finish()
    calls = [d["tool_calls"][0] for d in out if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0, 1]
    assert "".join(d.get("content", "") for d in out) == RECORDED[0][2]


def test_auto_without_parallel_tool_calls_keeps_the_first_call():
    plan = ToolPlan("auto", [], None, None, get_parser("hermes"), parallel=False)
    text = RECORDED[0][1]
    content, calls = parse_output(plan, text)
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments)[
        "city"
    ] == "Paris"
    td = ToolDeltas(plan)
    out = td.feed(text) + td.finish()
    assert len([d for d in out if "tool_calls" in d]) == 1
