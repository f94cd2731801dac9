"""A field a client sends is used or refused by name, never ignored or read as something else:
unknown keys inside objects (``stream_options``, ``response_format`` and its ``json_schema``,
``/tokenize`` and ``/v1/prefixes`` bodies, chat messages, their parts and tool calls,
Responses input items and parts) and ``logit_bias`` keys that only look like token ids (fake
engine, fast)."""

from __future__ import annotations

import pytest
from support.http import assert_openai_error as _error

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # a typo was answered 200 without its effect; vLLM's continuous_usage_stats is taken
        # (test_continuous_usage.py), as a boolean only
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
            "stream_options.continuous_usage_stats",
        ),
        (
            {"stream": True, "stream_options": {"include_usage": True, "inclde_usage": True}},
            "stream_options.inclde_usage",
        ),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
        (
            {"response_format": {"type": "json_object", "schema": {"type": "integer"}}},
            "response_format.schema",
        ),
        (
            {"response_format": {"type": "text", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "strictly": True},
                }
            },
            "response_format.json_schema.strictly",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x"},
                    "strict": True,
                }
            },
            "response_format.strict",
        ),
    ],
)
def test_unknown_nested_keys_are_refused_by_name(serve_fake, gw, extra, param):
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        err = _error(http.post(CHAT, json=gw.chat_body(max_tokens=2, **extra)), 400, param=param)
        assert param.rsplit(".", 1)[-1] in err["message"]
    assert engine.requests_seen == []


def test_the_defined_nested_keys_are_served(serve_fake, gw):
    srv, engine = serve_fake()
    schema = {"name": "n", "description": "a number", "schema": {"type": "integer"}, "strict": True}
    with gw.client(srv) as http:
        for extra in (
            {
                "stream": True,
                "stream_options": {"include_usage": True, "include_obfuscation": False},
            },
            {"response_format": {"type": "json_schema", "json_schema": schema}},
            {"response_format": {"type": "text"}},
        ):
            r = http.post(CHAT, json=gw.chat_body(max_tokens=2, **extra))
            assert r.status_code == 200, r.text
    assert len(engine.requests_seen) == 3


@pytest.mark.parametrize("key", [" 5", "5 ", "+5", "5_0", "\u0665", "05", "5.0", "0x5", ""])
def test_logit_bias_keys_must_be_decimal_token_ids(serve_fake, gw, key):
    # int() read "5_0" as token 50 and "\u0665" (Arabic-Indic five) as 5: the bias landed on a
    # token the client never named, answered 200.
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        body = gw.chat_body(max_tokens=2, logit_bias={key: 10})
        err = _error(http.post(CHAT, json=body), 400, param="logit_bias")
        assert "not a token id" in err["message"]
        comp = {"model": "fake", "prompt": "hi", "max_tokens": 2, "logit_bias": {key: 10}}
        _error(http.post("/v1/completions", json=comp), 400, param="logit_bias")
        ok = http.post(CHAT, json=gw.chat_body(max_tokens=2, logit_bias={"5": 10, "0": -1}))
        assert ok.status_code == 200, ok.text
    assert len(engine.requests_seen) == 1


def test_tokenize_fields_are_used_or_refused(serve_fake, gw):
    # add_special_tokens=false was ignored (BOS still counted) and unknown fields passed.
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        plain = http.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
        bare = http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False})
        assert bare.status_code == 200, bare.text
        assert bare.json()["tokens"] == engine.tokenizer.encode("hello", False)
        assert plain == engine.tokenizer.encode("hello", True) and plain != bare.json()["tokens"]
        msgs = {"messages": [{"role": "user", "content": "hi"}]}
        without = http.post("/tokenize", json={**msgs, "add_generation_prompt": False})
        assert without.status_code == 200, without.text
        for body, param in (
            ({"prompt": "hi", "foo": 1}, "foo"),
            ({"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt"),
            ({**msgs, "add_special_tokens": True}, "add_special_tokens"),
            ({"prompt": "", "add_special_tokens": False}, "prompt"),
        ):
            _error(http.post("/tokenize", json=body), 400, param=param)
    assert engine.requests_seen == []


def test_prefix_create_refuses_unknown_fields(serve_fake, gw):
    # {"ttl": 60} (for ttl_seconds) was ignored: the prefix was pinned for the default 300 s.
    srv, engine = serve_fake()
    body = {"model": "fake", "messages": [{"role": "system", "content": "x " * 40}], "ttl": 60}
    with gw.client(srv) as http:
        _error(http.post("/v1/prefixes", json=body), 400, param="ttl")
    assert engine.stats()["pinned_blocks"] == 0


USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        # each was answered 200 with the key dropped (found by a new user's probe)
        ([{**USER, "foo": 1}], "messages.0.foo"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}], "foo"),
        ([USER, {"role": "assistant", "tool_calls": [{**CALL, "zzz": 1}]}], "zzz"),
        (
            [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {**CALL["function"], "zzz": 1}}],
                },
            ],
            "zzz",
        ),
        ([USER, {"role": "assistant", "content": "", "refusal": "no"}], "messages.1.refusal"),
        ([USER, {"role": "assistant", "content": "x", "audio": {"id": "a"}}], "messages.1.audio"),
        (
            [USER, {"role": "assistant", "content": "x", "function_call": {"name": "f"}}],
            "messages.1.function_call",
        ),
    ],
)
def test_unknown_or_unsupported_message_keys_are_refused(serve_fake, gw, messages, param):
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        body = {"model": "fake", "messages": messages, "max_tokens": 2}
        err = _error(http.post(CHAT, json=body), 400)
        assert param in (err["param"] or "") and param.rsplit(".", 1)[-1] in err["message"], err
        prefix = {"model": "fake", "messages": messages}
        _error(http.post("/v1/prefixes", json=prefix), 400)
    assert engine.requests_seen == []


def test_an_assistant_message_given_back_as_openai_returns_it_is_served(serve_fake, gw):
    """openai-python's ``message.model_dump()`` of an answer (refusal, audio, function_call
    and annotations all empty) is valid history."""
    srv, engine = serve_fake()
    given_back = {
        "role": "assistant",
        "content": "hello",
        "refusal": None,
        "audio": None,
        "function_call": None,
        "annotations": [],
        "tool_calls": None,
    }
    with gw.client(srv) as http:
        body = {"model": "fake", "messages": [USER, given_back, USER], "max_tokens": 2}
        r = http.post(CHAT, json=body)
        assert r.status_code == 200, r.text
    assert len(engine.requests_seen) == 1


def test_responses_input_refuses_unknown_keys_and_takes_its_own_output_back(serve_fake, gw):
    srv, engine = serve_fake()
    output_item = {  # an earlier response's output message, as openai-python returns it
        "id": "msg_1",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}],
    }
    with gw.client(srv) as http:
        for item, param in (
            ({"role": "user", "content": "hi", "foo": 1}, "foo"),
            ({"role": "user", "content": [{"type": "input_text", "text": "hi", "zzz": 1}]}, "zzz"),
        ):
            body = {"model": "fake", "input": [item], "max_output_tokens": 2}
            err = _error(http.post("/v1/responses", json=body), 400)
            assert param in (err["param"] or ""), err
        body = {"model": "fake", "input": [{"role": "user", "content": "hi"}, output_item]}
        r = http.post("/v1/responses", json={**body, "max_output_tokens": 2})
        assert r.status_code == 200, r.text
    assert len(engine.requests_seen) == 1
