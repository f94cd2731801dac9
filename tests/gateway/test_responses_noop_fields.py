"""/v1/responses takes the no-op values chat takes (``service_tier`` ``auto`` / ``default``,
``safety_identifier``) with no effect on the answer, and refuses every other value by name
with code ``unsupported_parameter``, as chat does (fake engine, fast)."""

from __future__ import annotations

import pytest
from support.http import assert_openai_error as _error

RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    "extra",
    [
        {"service_tier": "auto"},
        {"service_tier": "default"},
        {"service_tier": None},
        {"safety_identifier": "user-123"},
    ],
)
def test_the_no_op_values_chat_takes_are_taken(serve_fake, gw, extra):
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert http.post(CHAT, json={**chat, **extra}).status_code == 200
        body = {"model": "fake", "input": "hi", "max_output_tokens": 2, **extra}
        r = http.post(RESPONSES, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "incomplete"  # two tokens of the fake engine: cut
    assert len(engine.requests_seen) == 2


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"service_tier": "flex"}, "service_tier"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"store": True}, "store"),
    ],
)
def test_other_values_are_refused_by_name_as_chat_refuses_them(serve_fake, gw, extra, param):
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        _error(http.post(CHAT, json={**chat, **extra}), 400, "unsupported_parameter", param)
        body = {"model": "fake", "input": "hi", "max_output_tokens": 2, **extra}
        err = _error(http.post(RESPONSES, json=body), 400, "unsupported_parameter", param)
        assert str(next(iter(extra.values()))).lower() in err["message"].lower(), err
    assert engine.requests_seen == []


def test_a_safety_identifier_of_a_wrong_type_is_refused_by_name(serve_fake, gw):
    srv, _ = serve_fake()
    with gw.client(srv) as http:
        body = {"model": "fake", "input": "hi", "max_output_tokens": 2, "safety_identifier": 7}
        _error(http.post(RESPONSES, json=body), 400, param="safety_identifier")
