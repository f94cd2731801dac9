"""Stop strings under a constraint on the whole output (``gateway/wire/stop_strings.py``): a
stop string matched inside constrained text cut the answer — a tool call with arguments
``"{"`` and finish ``"stop"``, JSON that does not parse — so the combination is refused with a
400 naming the stop field before any work, in every dialect that has one, streamed or not,
in local mode and through the proxy. The official ``openai`` / ``anthropic`` clients on a
real gateway over aidreams-260k; the block pool ends whole."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.gateway.app import create_proxy_app  # noqa: E402
from prefixgate.gateway.http.server import BackgroundServer  # noqa: E402
from prefixgate.gateway.settings import GatewaySettings  # noqa: E402
from support.gateway import serve_aidreams, wait_idle  # noqa: E402

MODEL = "aidreams-260k"
MSGS = [{"role": "user", "content": "Tell me"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
RF = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
STOPS = ("{", ["\n", '"'])  # each appears in the constrained text of the answers

# (route, request fields, the constraint's field in the message)
REFUSED = [
    ("chat", {"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [TOOL], "tool_choice": NAMED}, "tool_choice"),
    ("chat", {"response_format": RF}, "response_format"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"extra_body": {"guided_regex": "[a-z]{3}"}}, "guided_regex"),
    ("chat", {"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}, "structured_outputs"),
    ("completions", {"extra_body": {"guided_json": SCHEMA}}, "guided_json"),
    ("completions", {"extra_body": {"guided_grammar": 'root ::= "ab"'}}, "guided_grammar"),
    ("completions", {"extra_body": {"guided_choice": ["x", "y"]}}, "guided_choice"),
]
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(aidreams_path, model_name=MODEL, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def proxy(server):
    with BackgroundServer(lambda: create_proxy_app([server.url], GatewaySettings())) as gw:
        yield gw


@pytest.fixture(params=["local", "proxy"])
def url(request, server, proxy) -> str:
    return (server if request.param == "local" else proxy).url


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _create(client: openai.OpenAI, route: str, fields: dict, **kw):
    common = {"model": MODEL, "max_tokens": 20, "temperature": 0.0, **kw}
    if route == "chat":
        return client.chat.completions.create(messages=MSGS, **common, **fields)
    return client.completions.create(prompt="Tell me", **common, **fields)


@pytest.mark.parametrize(("route", "fields", "constraint"), REFUSED)
def test_stop_with_a_whole_output_constraint_is_a_400_naming_stop(
    url, server, route, fields, constraint, pool_whole
):
    client = _openai(url)
    for stop in STOPS:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                _create(client, route, fields, stop=stop, stream=stream)
            err = info.value.body
            assert info.value.status_code == 400 and err["param"] == "stop", err
            assert err["message"].startswith(f"stop: cannot be combined with {constraint}"), err
    wait_idle(server, pool_whole)


def test_the_same_constraints_without_stop_still_answer(url, server, pool_whole):
    """No stop or an empty list: accepted; a forced call is a complete call."""
    client = _openai(url)
    r = _create(client, "chat", {"tools": [TOOL], "tool_choice": NAMED}, stop=[], max_tokens=40)
    (call,) = r.choices[0].message.tool_calls
    if r.choices[0].finish_reason == "tool_calls":
        assert isinstance(json.loads(call.function.arguments), dict)
    r = _create(client, "completions", {"extra_body": {"guided_choice": ["x", "y"]}})
    assert r.choices[0].text in ("x", "y") and r.choices[0].finish_reason == "stop"
    # unconstrained text and tool_choice "auto" keep their stop strings
    r = _create(client, "chat", {}, stop=["e"], max_tokens=40)
    assert "e" not in r.choices[0].message.content
    r = _create(client, "chat", {"tools": [TOOL], "tool_choice": "auto"}, stop="e", max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length")
    wait_idle(server, pool_whole)


def test_messages_stop_sequences_with_a_forced_tool_is_a_400(url, server, pool_whole):
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as info:
                client.messages.create(
                    model=MODEL, max_tokens=20, messages=MSGS, tools=[ANTHROPIC_TOOL],
                    tool_choice=choice, stop_sequences=["{"], stream=stream,
                )  # fmt: skip
            body = info.value.body
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith(
                "stop_sequences: cannot be combined with tool_choice"
            ), body
    # "auto" keeps its stop sequences
    m = client.messages.create(
        model=MODEL, max_tokens=20, messages=MSGS, tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "auto"}, stop_sequences=["e"],
    )  # fmt: skip
    assert m.stop_reason in ("stop_sequence", "end_turn", "max_tokens", "tool_use")
    wait_idle(server, pool_whole)


def test_responses_has_no_stop_field(server, pool_whole):
    """The Responses API has no stop strings: ``stop`` is an unrecognized field there."""
    with pytest.raises(openai.BadRequestError) as info:
        _openai(server.url).responses.create(
            model=MODEL, input="Tell me", max_output_tokens=16, extra_body={"stop": "{"}
        )
    assert info.value.body["param"] == "stop", info.value.body
    wait_idle(server, pool_whole)
