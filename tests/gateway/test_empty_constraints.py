"""An output constraint sent empty is a constraint, never dropped as an absent field
(``request_models.EMPTY_MEANS``): the vLLM spellings (``guided_*``) and ``response_format``
are judged as the same constraint under ``structured_outputs`` is. ``guided_choice: []``,
``guided_regex: ""`` and ``response_format: {}`` answered 200 with unconstrained text, where
``structured_outputs: {"choice": []}`` was a 400 (a new user's probe)."""

from __future__ import annotations

import json

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.wire.request_fields import structured_from
from prefixgate.gateway.wire.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)

USER = [{"role": "user", "content": "hi"}]
REFUSED_EMPTY = [  # (field, its empty value, the param the 400 names)
    ("guided_choice", [], "guided_choice"),
    ("guided_regex", "", "guided_regex"),
    ("guided_grammar", "", "guided_grammar"),
    ("structured_outputs", {}, "structured_outputs"),
    ("response_format", {}, "response_format.type"),
]


def _bodies(field: str, value: object) -> list[tuple[type, bytes]]:
    chat = {"model": "m", "messages": USER, field: value}
    completion = {"model": "m", "prompt": "hi", field: value}
    kinds: list[tuple[type, dict]] = [(ChatCompletionRequest, chat)]
    if field != "response_format":  # completions have no response_format
        kinds.append((CompletionRequest, completion))
    return [(kind, json.dumps(body).encode()) for kind, body in kinds]


@pytest.mark.parametrize(("field", "empty", "param"), REFUSED_EMPTY)
def test_an_empty_constraint_is_a_400_naming_it(field, empty, param):
    for kind, body in _bodies(field, empty):
        with pytest.raises(APIError) as exc:
            structured_from(parse(kind, body))
        assert exc.value.status == 400, (kind, field)
        assert exc.value.param == param, (kind, field, exc.value.param)


def test_an_empty_json_schema_is_any_json_as_under_structured_outputs():
    for kind, body in _bodies("guided_json", {}):
        spec, field = structured_from(parse(kind, body))
        assert spec is not None and field == "guided_json"
        assert (spec.kind, spec.json) == ("json", {})
    nested = json.dumps({"model": "m", "messages": USER, "structured_outputs": {"json": {}}})
    spec, _ = structured_from(parse(ChatCompletionRequest, nested.encode()))
    assert spec is not None and (spec.kind, spec.json) == ("json", {})


@pytest.mark.parametrize("field", [f for f, _, _ in REFUSED_EMPTY] + ["guided_json"])
def test_a_null_constraint_is_still_its_absence(field):
    for kind, body in _bodies(field, None):
        assert structured_from(parse(kind, body)) == (None, None)


def test_both_modes_answer_an_empty_constraint_400(serve_fake):
    up, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    with BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw:
        for url in (up.url, gw.url):
            for field, empty, param in REFUSED_EMPTY:
                body = {"model": "fake", "messages": USER, "max_tokens": 2, field: empty}
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
                assert r.status_code == 400, (url, field, r.text)
                assert r.json()["error"]["param"] == param, (url, field, r.text)
