"""``tool_choice: "required"`` / a named function without wrapper tokens (``ToolPlan.shape``)
and the constrained answer's calls (``ConstrainedCalls``): one tool is the call by name, several
tools without parallel calls one ``{"name", "parameters"}`` object; a cut answer never shows its
JSON as content; a stream split anywhere sends exactly the whole answer's calls and finish."""

from __future__ import annotations

import json
import random

import pytest
from prefixgate.gateway.wire.tools import (
    ToolDeltas,
    parse_output,
    plan_tools,
    tool_finish_reason,
)

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TZ = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}


def _tool(name: str, params: dict, strict: bool | None = None) -> dict:
    fn: dict = {"name": name, "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


WEATHER, TIME = _tool("get_weather", CITY), _tool("get_time", TZ)


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_with_one_tool_is_the_call_by_name(parallel):
    named = plan_tools(
        [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, parallel, None
    )
    required = plan_tools([_tool("get_weather", CITY, True)], "required", parallel, None)
    assert required.shape == named.shape == "arguments"
    assert required.named == "get_weather"
    assert required.structured.json == named.structured.json == CITY  # no wrapper, no array


def test_required_shapes_by_tools_and_parallel():
    one = plan_tools([WEATHER, TIME], "required", False, None)
    assert one.shape == "call" and "anyOf" in one.structured.json
    assert one.structured.json["type"] == "object"  # the object alone: no array around it
    many = plan_tools([WEATHER, TIME], "required", None, None)
    assert many.shape == "calls" and many.structured.json["type"] == "array"


def _stream(plan, text: str, sizes: list[int]):
    """Feed ``text`` in pieces of ``sizes``; returns (content, calls [(name, args)], called)."""
    td = ToolDeltas(plan)
    deltas, pos = [], 0
    for size in sizes:
        if pos >= len(text):
            break
        deltas += td.feed(text[pos : pos + size])
        pos += size
    deltas += td.finish()
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], ["", ""])
            assert ("id" in tc) == (slot == ["", ""] and "name" in tc["function"])
            slot[0] += tc["function"].get("name", "")
            slot[1] += tc["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], td.called


PLANS = {
    "one_tool": plan_tools([WEATHER], "required", None, None),
    "named": plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                        None, None),
    "call": plan_tools([WEATHER, TIME], "required", False, None),
    "calls": plan_tools([WEATHER, TIME], "required", True, None),
}  # fmt: skip
WHOLE = {
    "one_tool": '{"city": "Paris", "unit": "c"}',
    "named": '{"city": "Pa}ris\\"", "unit": "f"}',
    "call": '{"name": "get_weather", "parameters": {"city": "x{]", "unit": "c"}}',
    "calls": '[{"name": "get_time", "parameters": {"tz": "UTC"}}, '
    '{"name": "get_weather", "parameters": {"city": "a", "unit": "c"}}]',
}


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_every_prefix_agrees_streamed_and_whole(kind):
    """Every cut of the answer (finish "length" or a stop string) and the whole one: the
    stream in any fragments equals the whole answer's parse; content is always None / empty;
    "tool_calls" only for the complete JSON."""
    plan, text = PLANS[kind], WHOLE[kind]
    rng = random.Random(7)
    for cut in range(len(text) + 1):
        part = text[:cut]
        content, calls = parse_output(plan, part)
        assert content is None, (kind, part)
        whole = [(c.name, c.arguments) for c in calls]
        finish = tool_finish_reason(plan, part, calls, "stop")
        assert (finish == "tool_calls") == (cut == len(text)), (kind, part, finish)
        assert tool_finish_reason(plan, part, calls, "length") == "length"
        for sizes in ([1] * len(part), [len(part) or 1], [rng.randint(1, 5) for _ in part]):
            got_content, got_calls, called = _stream(plan, part, sizes)
            assert got_content == "" and got_calls == whole, (kind, part, sizes)
            assert called == (finish == "tool_calls")
    _, calls = parse_output(plan, text)
    for c in calls:  # the complete answer: every call's arguments are its JSON
        json.loads(c.arguments)


def test_complete_answers_read_back():
    assert parse_output(PLANS["one_tool"], WHOLE["one_tool"])[1][0].name == "get_weather"
    (call,) = parse_output(PLANS["call"], WHOLE["call"])[1]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "x{]", "unit": "c"}
    calls = parse_output(PLANS["calls"], WHOLE["calls"])[1]
    assert [c.name for c in calls] == ["get_time", "get_weather"]


def test_a_cut_single_call_keeps_its_name_and_arguments_so_far():
    """pydantic-ai's case cut at the limit: the call with the arguments written so far, never
    the internal ``{"name": ...`` text as content."""
    plan = PLANS["call"]
    content, calls = parse_output(plan, '{"name": "get_time", "parameters": {"tz": "U')
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"tz": "U')]
    assert parse_output(plan, '{"name": "get_ti') == (None, [])
    content, calls = parse_output(PLANS["calls"], '[{"name": "get_time", "parameters": {"t')
    assert content is None and calls == []


def test_a_scalar_parameters_value_is_sent_at_the_end():
    plan = plan_tools(
        [_tool("a", {"type": "integer"}), _tool("b", {"type": "string"})], "required", False, None
    )
    text = '{"name": "a", "parameters": 42}'
    content, calls = parse_output(plan, text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("a", "42")]
    assert _stream(plan, text, [1] * len(text))[1] == [("a", "42")]
