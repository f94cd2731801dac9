"""Structured outputs and tool calling through the real gateway on aidreams-260k (a model that
never saw JSON), driven by the official ``openai`` client: every answer that finishes with
"stop" validates; tool calls match their function's parameters; bad input is a 400 naming the
field and disturbs nothing in flight; the block pool ends whole."""

from __future__ import annotations

import json
import re
import threading
import typing

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.gateway.wire.request_fields import (  # noqa: E402
    CHAT_EXTRAS,
    CHAT_SUPPORTED,
    COMPLETIONS_SUPPORTED,
    EXTRAS,
    REFUSED,
)
from support.gateway import hermes_fixtures, wait_idle  # noqa: E402
from support.schemas import NESTED_SCHEMA as SCHEMA  # noqa: E402
from support.schemas import TIME_TOOL as TIME
from support.schemas import weather_tool

MODEL = "aidreams-260k"
WEATHER = weather_tool(10, description="weather of a city")
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MSGS = [{"role": "user", "content": "Tell me"}]

server, client = hermes_fixtures(MODEL)


def _rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_json_schema_response_format_validates(client, server, pool_whole):
    stopped = 0
    for seed in range(5):
        r = client.chat.completions.create(
            model=MODEL, messages=MSGS, temperature=1.0, seed=seed, n=8, max_tokens=90,
            response_format=_rf(SCHEMA),
        )  # fmt: skip
        for c in r.choices:
            if c.finish_reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert stopped >= 36  # of 40
    for seed in range(4):  # streamed
        chunks = client.chat.completions.create(
            model=MODEL, messages=MSGS, temperature=1.0, seed=seed, max_tokens=90, stream=True,
            response_format=_rf(SCHEMA),
        )  # fmt: skip
        parts, finish = [], None
        for ch in chunks:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
        if finish == "stop":
            jsonschema.validate(json.loads("".join(parts)), SCHEMA)
    wait_idle(server, pool_whole)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r"[a-z]{3}-\d{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "boolean"}},
                          "required": ["a"], "additionalProperties": False}},
         lambda t: isinstance(json.loads(t)["a"], bool)),
        ({"guided_grammar": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch(r"x[0-9]", t)),
        ({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {
            "type": "sequence", "elements": [
                {"type": "const_string", "value": "id-"},
                {"type": "json_schema", "json_schema": {"type": "integer", "minimum": 0,
                                                         "maximum": 99}}]}}}},
         lambda t: re.fullmatch(r"id-\d{1,2}", t) and int(t[3:]) <= 99),
    ],
)  # fmt: skip
def test_vllm_extras_map_to_the_same_constraint(client, server, extra, check, pool_whole):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=1.0, n=4, max_tokens=40, extra_body=extra
    )
    for c in r.choices:
        assert c.finish_reason == "stop" and check(c.message.content), c.message.content
    comp = client.completions.create(
        model=MODEL, prompt="Once", temperature=1.0, max_tokens=40, extra_body=extra
    )
    assert comp.choices[0].finish_reason == "stop" and check(comp.choices[0].text)
    for seed in range(2):  # the same with stream: true
        parts, finish = [], None
        for ch in client.chat.completions.create(
            model=MODEL, messages=MSGS, temperature=1.0, seed=seed, max_tokens=40, stream=True,
            extra_body=extra,
        ):  # fmt: skip
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
        assert finish == "stop" and check("".join(parts)), parts
    wait_idle(server, pool_whole)


def test_json_object_mode(client, server, pool_whole):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=1.0, n=4, max_tokens=100,
        response_format={"type": "json_object"},
    )  # fmt: skip
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    wait_idle(server, pool_whole)


SMALL = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_grammar_meets_min_tokens_and_stop_ids(client, server, pool_whole):
    """Where features meet (engine/logits_processors.py): ``min_tokens`` beyond the complete
    answer was a 500 (every logit -inf); a stop id the grammar allows as text cut the JSON
    mid-object with "stop". Now: the grammar wins, the answer validates, stream == non-stream."""
    # aidreams ids of '"' and '1', both in its greedy answer '{"n": 12}' (as text, mid-object)
    extra = {"min_tokens": 25, "stop_token_ids": [455, 469]}
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL, messages=MSGS, temperature=0.0, max_tokens=30,
            response_format=_rf(SMALL), extra_body=extra, stream=stream,
        )  # fmt: skip
        if stream:
            parts, finish = [], None
            for ch in r:
                if ch.choices:
                    parts.append(ch.choices[0].delta.content or "")
                    finish = ch.choices[0].finish_reason or finish
            text = "".join(parts)
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            want = text
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), SMALL)
    assert text == want
    wait_idle(server, pool_whole)


def test_named_and_required_tool_choice(client, server, pool_whole):
    named = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=1.0, n=4, max_tokens=60, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    for c in named.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])
    required = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=1.0, n=4, max_tokens=90, tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    for c in required.choices:
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    wait_idle(server, pool_whole)


def test_tool_calls_streamed_with_index(client, server, pool_whole):
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        complete = 0
        for seed in range(6):
            chunks = list(
                client.chat.completions.create(
                    model=MODEL, messages=MSGS, temperature=1.0, seed=seed, max_tokens=110,
                    tools=[WEATHER, TIME], tool_choice=choice, stream=True,
                    parallel_tool_calls=False,  # one call fits aidreams' 128-token context
                )
            )  # fmt: skip
            calls: dict[int, dict] = {}
            finish = None
            for ch in chunks:
                d = ch.choices[0].delta
                finish = ch.choices[0].finish_reason or finish
                for tc in d.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                    slot["id"] = slot["id"] or tc.id
                    if tc.function and tc.function.name:
                        slot["name"] = tc.function.name
                    if tc.function and tc.function.arguments:
                        slot["arguments"] += tc.function.arguments
            assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... in order
            if finish == "length":
                continue
            complete += 1
            assert finish == "tool_calls" and calls
            for slot in calls.values():
                assert slot["id"].startswith("call_")
                jsonschema.validate(json.loads(slot["arguments"]), PARAMS[slot["name"]])
        assert complete >= 3, choice
    wait_idle(server, pool_whole)


def test_auto_without_a_call_is_plain_content(client, server, pool_whole):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=10, tools=[WEATHER]
    )
    c = r.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length")
    wait_idle(server, pool_whole)


BAD = [
    ({"response_format": _rf({"type": "foo"})}, "response_format"),
    ({"response_format": _rf({"type": "array", "uniqueItems": True})}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                 "parameters": {"type": "bogus"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag",
                                                "format": {"type": "bogus"}}}},
     "structured_outputs"),
    ({"response_format": _rf(SCHEMA), "tools": [WEATHER], "tool_choice": "required"},
     "response_format"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"store": True}, "store"),
    ({"frobnicate": 1}, "frobnicate"),
    # JSON Schema keywords the grammar would drop (tests/engine/test_schema_keywords.py)
    ({"response_format": _rf({"type": "string", "pattern": "^a+$", "maxLength": 2})},
     "response_format"),
    ({"response_format": _rf({"type": "number", "multipleOf": 0.5})}, "response_format"),
    ({"response_format": _rf({"oneOf": [{"type": "integer"}, {"type": "number"}]})},
     "response_format"),
    ({"guided_regex": "(?!a)b"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "date",
                                               "maxLength": 4}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
]  # fmt: skip


def test_bad_input_is_400_naming_the_field_and_disturbs_nothing(server, pool_whole):
    """A long streamed request runs while every bad request is refused; it completes."""
    result: dict = {}

    def long_stream() -> None:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        text = ""
        for ch in c.chat.completions.create(
            model=MODEL, messages=MSGS, temperature=0, max_tokens=80, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            text += ch.choices[0].delta.content or ""
            result["finish"] = ch.choices[0].finish_reason or result.get("finish")
        result["text"] = text

    t = threading.Thread(target=long_stream)
    t.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for extra, param in BAD:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 5, **extra}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (extra, err)
            assert param.split("[")[0].split(".")[0] in err["message"], err
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "frobnicate": 1})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "Unrecognized request argument supplied: frobnicate"
    t.join(60)
    assert result["finish"] == "length" and len(result["text"]) > 20
    wait_idle(server, pool_whole)


GRAMMAR_ERRORS = [
    ("/v1/chat/completions", {"guided_regex": "a(b"}, "guided_regex: invalid regex at position 4"),
    ("/v1/chat/completions", {"guided_regex": "a{3,1}"}, "guided_regex: invalid regex: Lower"),
    ("/v1/completions", {"guided_regex": "(?<=a)b"}, "guided_regex: invalid regex at position 3"),
    ("/v1/completions", {"guided_grammar": "root ::= nope"}, "guided_grammar: invalid EBNF"),
    ("/v1/chat/completions", {"response_format": _rf({"$ref": "#/nope"})},
     "response_format: invalid JSON schema: "),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "[z-a]"}},
     "structured_outputs: invalid regex: "),
]  # fmt: skip


def test_grammar_errors_name_the_field_never_compiler_paths(server, pool_whole):
    """A constraint the grammar compiler refuses is a 400 naming the request's field and the
    problem; xgrammar's log prefix and source paths (``/project/cpp/regex_converter.cc:94``)
    never reach the client."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, extra, want in GRAMMAR_ERRORS:
            body = {"model": MODEL, "max_tokens": 5, **extra}
            body.update({"messages": MSGS} if "chat" in path else {"prompt": "x"})
            r = http.post(path, json=body)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == next(iter(extra)), err
            assert err["message"].startswith(want), err
            assert not re.search(r"\.(cc|h|cpp)\b|/cpp/|/project/|\[\d\d:\d\d", err["message"])
    wait_idle(server, pool_whole)


def test_every_openai_field_is_handled_or_refused(server, pool_whole):
    """openai-python's own field lists: each is implemented (documented in request_fields)
    or, with a non-default value, answered 400 naming it."""
    from openai.types import completion_create_params as comp
    from openai.types.chat import completion_create_params as chat

    chat_fields = set(typing.get_type_hints(chat.CompletionCreateParamsBase)) | {"stream"}
    comp_fields = set(typing.get_type_hints(comp.CompletionCreateParamsBase)) | {"stream"}
    for name in chat_fields:
        assert name in CHAT_SUPPORTED or name in REFUSED, f"chat field {name} unclassified"
    for name in comp_fields:
        assert name in COMPLETIONS_SUPPORTED or name in REFUSED, f"completions field {name}"
    assert not set(CHAT_SUPPORTED) & set(REFUSED)
    values = {
        "audio": {"voice": "alloy", "format": "mp3"}, "function_call": "auto",
        "functions": [{"name": "f"}], "metadata": {"a": "b"}, "moderation": {"x": 1},
        "prediction": {"type": "content", "content": "x"}, "prompt_cache_options": "on",
        "prompt_cache_retention": "forever", "reasoning_effort": "high", "verbosity": "low",
        "web_search_options": {}, "echo": True, "suffix": "end",
    }  # fmt: skip
    # implemented since the cache controls (test_cache_controls.py); bad values still 400
    assert set(values) == set(REFUSED) | {"prompt_cache_options", "prompt_cache_retention"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, value in values.items():
            if name in chat_fields:
                body = {"model": MODEL, "messages": MSGS, "max_tokens": 2, name: value}
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
            if name in comp_fields:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 2, name: value}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        # the no-op values and the accepted identifiers pass
        ok = {
            "user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k", "store": False,
            "service_tier": "auto", "modalities": ["text"], "logit_bias": {"5": -1},
            "parallel_tool_calls": True, "min_tokens": 1, "top_k": 5,
        }  # fmt: skip
        r = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "max_tokens": 2, **ok}
        )
        assert r.status_code == 200, r.text
        r = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2, "best_of": 1, "echo": False},
        )
        assert r.status_code == 200, r.text
    for name in EXTRAS | CHAT_EXTRAS:
        assert name not in chat_fields  # extras are ours, sent via extra_body
    wait_idle(server, pool_whole)


def test_tool_messages_render_through_the_template():
    """Assistant tool_calls (arguments as objects) and tool results reach the template."""
    from prefixgate.engine.tokenizer import Tokenizer
    from prefixgate.gateway.wire.prompts import _render_chat
    from prefixgate.gateway.wire.request_models import ChatCompletionRequest
    from prefixgate.gateway.wire.tools import template_messages

    base = Tokenizer.builtin()
    template = (
        "{% for t in tools or [] %}[T:{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}:{% endif %}{{ m.content }}"
        "{% endfor %}"
    )
    tok = Tokenizer(
        base._tok, bos_token="<s>", eos_token="</s>", chat_templates={"default": template}
    )
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "w?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
            ],
        }
    )  # fmt: skip
    ids = _render_chat(tok, template_messages(req.messages), True, tools=[WEATHER])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == "[T:get_weather]<user>w?<assistant>get_weather(Oslo)<tool>#call_1:cold"
