"""``tool_choice: "required"`` on aidreams-260k through the real gateway: pydantic-ai's
structured output (``required``, one strict tool, 60 tokens) takes exactly the tokens of the
call by name; every cut (``max_tokens``) returns no internal JSON as content; stream and
non-stream agree at temperature 0 on content, calls and finish reason, for every shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from support.gateway import openai_client, serve_aidreams, wait_idle  # noqa: E402
from support.schemas import PET_SCHEMA as PET  # noqa: E402
from support.schemas import TIME_TOOL as TIME  # noqa: E402

MODEL = "aidreams-260k"
FINAL = {
    "type": "function",
    "function": {
        "name": "final_result",
        "description": "The final response which ends this conversation",
        "parameters": PET,
        "strict": True,
    },
}
PARAMS = {"final_result": PET, "get_time": TIME["function"]["parameters"]}
MSGS = [{"role": "user", "content": "A pet, please"}]
BY_NAME = {"type": "function", "function": {"name": "final_result"}}


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(aidreams_path, model_name=MODEL, max_queued_requests=64)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _streamed(client, **kw):
    """(content, [(name, arguments)], finish_reason, completion_tokens) of a stream."""
    content, calls, finish, usage = "", {}, None, None
    for ch in client.chat.completions.create(
        model=MODEL, messages=MSGS, stream=True, stream_options={"include_usage": True}, **kw
    ):
        usage = ch.usage or usage
        if not ch.choices:
            continue
        c = ch.choices[0]
        finish = c.finish_reason or finish
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, ["", ""])
            slot[0] += (tc.function.name or "") if tc.function else ""
            slot[1] += (tc.function.arguments or "") if tc.function else ""
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, usage.completion_tokens


def _whole(client, **kw):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, **kw)
    c = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    return c.message.content, calls, c.finish_reason, r.usage.completion_tokens


def test_required_with_one_strict_tool_fits_like_the_call_by_name(client, server, pool_whole):
    """pydantic-ai: ``required``, one strict tool, 60 tokens. Before: the wrapper array cost
    tokens and the answer was cut at the limit, its array text returned as content."""
    kw = {"tools": [FINAL], "temperature": 0, "max_tokens": 60}
    by_name = _whole(client, tool_choice=BY_NAME, **kw)
    required = _whole(client, tool_choice="required", **kw)
    assert required[2] == by_name[2] == "tool_calls", (required, by_name)
    assert required[3] == by_name[3] <= 60  # the same tokens: no wrapper
    assert required[0] is None and required[1] == by_name[1]
    jsonschema.validate(json.loads(required[1][0][1]), PET)
    assert _streamed(client, tool_choice="required", **kw)[1:] == required[1:]
    wait_idle(server, pool_whole)


SHAPES = [  # (tools, tool_choice, parallel_tool_calls)
    ([FINAL], "required", None),
    ([FINAL, TIME], BY_NAME, None),
    ([FINAL, TIME], "required", False),
    ([FINAL, TIME], "required", None),
]


@pytest.mark.parametrize(("tools", "choice", "parallel"), SHAPES)
def test_cut_or_whole_stream_equals_non_stream_and_no_json_leaks(
    client, server, pool_whole, tools, choice, parallel
):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    finishes = set()
    for max_tokens in (1, 3, 8, 15, 25, 90):
        kw = {"tools": tools, "tool_choice": choice, "temperature": 0, "max_tokens": max_tokens}
        whole = _whole(client, **kw, **extra)
        streamed = _streamed(client, **kw, **extra)
        content, calls, finish, tokens = whole
        assert content is None, whole  # never the internal JSON
        assert streamed == ("", calls, finish, tokens), (whole, streamed)
        assert finish in ("length", "tool_calls") and tokens <= max_tokens
        if finish == "tool_calls":
            assert calls
            for name, args in calls:
                jsonschema.validate(json.loads(args), PARAMS[name])
        finishes.add(finish)
    assert "length" in finishes  # the cut cases were exercised
    wait_idle(server, pool_whole)
