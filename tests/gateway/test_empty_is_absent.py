"""Empty is absent: for every top-level field of every request model of every dialect, its empty
values (``null``, ``[]``, ``{}``, ``""``) are answered as the field's absence is
(``request_models.without_empty``). The fields come from the models themselves
(``model_fields``) and from each dialect's list of fields refused unless they hold nothing, so
a field added later is covered without a line here. ``EMPTY_MEANS`` fields (an empty
prompt, input or token list is content; ``web_search_options: {}`` turns web search on) are
left out. openai-agents sends ``include: []`` on
every Responses call (it was a 400 "Unrecognized request argument supplied: include")."""

from __future__ import annotations

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.embeddings import EmbeddingRequest
from prefixgate.gateway.local.tokenize import DetokenizeRequest, TokenizeRequest
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.wire import anthropic_models, gemini_models, responses_models
from prefixgate.gateway.wire.anthropic_models import CountTokensRequest, MessagesRequest
from prefixgate.gateway.wire.request_fields import REFUSED
from prefixgate.gateway.wire.request_models import (
    EMPTY_MEANS,
    ChatCompletionRequest,
    CompletionRequest,
    PrefixCreateRequest,
)
from prefixgate.gateway.wire.responses_models import ResponsesRequest
from pydantic import BaseModel

EMPTIES = [None, [], {}, ""]
USER = [{"role": "user", "content": "hi"}]
CONTENTS = [{"role": "user", "parts": [{"text": "hi"}]}]

# (route, request model, the dialect's refused-unless-empty names, a valid body)
ROUTES: list[tuple[str, type[BaseModel], tuple[str, ...], dict]] = [
    (
        "/v1/chat/completions",
        ChatCompletionRequest,
        tuple(REFUSED),
        {"model": "fake", "messages": USER, "max_tokens": 2},
    ),
    (
        "/v1/completions",
        CompletionRequest,
        tuple(REFUSED),
        {"model": "fake", "prompt": "hi", "max_tokens": 2},
    ),
    (
        "/v1/responses",
        ResponsesRequest,
        responses_models.REFUSED,
        {"model": "fake", "input": "hi", "max_output_tokens": 2},
    ),
    (
        "/v1/messages",
        MessagesRequest,
        tuple(anthropic_models._REFUSED),
        {"model": "fake", "max_tokens": 2, "messages": USER},
    ),
    (
        "/v1/messages/count_tokens",
        CountTokensRequest,
        tuple(anthropic_models._REFUSED),
        {"model": "fake", "messages": USER},
    ),
    (
        "/v1/prefixes",
        PrefixCreateRequest,
        (),
        {"model": "fake", "messages": [{"role": "system", "content": "be brief"}]},
    ),
    ("/v1/embeddings", EmbeddingRequest, (), {"model": "fake", "input": "hi"}),
    (
        "/v1beta/models/fake:generateContent",
        gemini_models.GenerateContentRequest,
        (),
        {"contents": CONTENTS, "generationConfig": {"maxOutputTokens": 2}},
    ),
    (
        "/v1beta/models/fake:countTokens",
        gemini_models.CountTokensRequest,
        (),
        {"contents": CONTENTS},
    ),
    ("/tokenize", TokenizeRequest, (), {"model": "fake", "prompt": "hi"}),
    ("/detokenize", DetokenizeRequest, (), {"model": "fake", "tokens": [1, 2]}),
]


def _fields(model: type[BaseModel], refused: tuple[str, ...]) -> list[str]:
    return sorted((set(model.model_fields) | set(refused)) - EMPTY_MEANS)


def _outcome(r: httpx.Response) -> tuple[int, object]:
    """What a client sees of an answer: its status, and an error's code (Anthropic's: type)."""
    if r.status_code == 200:
        return 200, None
    body = r.json()
    err = body["error"]
    return r.status_code, err.get("code", err.get("type"))


@pytest.mark.parametrize("route", [r[0] for r in ROUTES])
def test_every_fields_empty_value_is_answered_as_its_absence(serve_fake, route):
    path, model, refused, base = next(r for r in ROUTES if r[0] == route)
    srv, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    assert srv.app is not None
    differ: list[str] = []
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.post(path, json=base).status_code in (200, 201, 400), path
        for name in _fields(model, refused):
            absent = {k: v for k, v in base.items() if k != name}
            expected = _outcome(http.post(path, json=absent))
            for empty in EMPTIES:
                got = _outcome(http.post(path, json={**absent, name: empty}))
                if got != expected:
                    differ.append(f"{name}={empty!r}: {got}, absent: {expected}")
    assert not differ, f"{path}: " + "; ".join(differ)


def test_openai_agents_responses_fields_are_taken_empty(serve_fake):
    """What openai-agents' Responses model sends on every call (its empty fields included)."""
    srv, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    body = {
        "model": "fake",
        "input": [{"role": "user", "content": "hi"}],
        "instructions": "be brief",
        "include": [],
        "tools": [],
        "previous_response_id": None,
        "reasoning": None,
        "background": None,
        "conversation": None,
        "prompt": None,
        "top_logprobs": None,
        "max_output_tokens": 2,
        "stream": False,
    }
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response"
    r = httpx.post(srv.url + "/v1/responses", json={**body, "include": ["reasoning"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include"


def test_a_required_field_sent_empty_is_told_as_empty_not_missing(serve_fake):
    """``messages: []`` / ``contents: []``: answered as the absence is (a 400 naming the
    field), in words that say it was sent empty, not "field required"."""
    import httpx

    srv, _ = serve_fake()
    anthropic = httpx.post(
        srv.url + "/v1/messages", json={"model": "fake", "max_tokens": 3, "messages": []}
    )
    gemini = httpx.post(srv.url + "/v1beta/models/fake:generateContent", json={"contents": []})
    assert anthropic.status_code == gemini.status_code == 400
    assert anthropic.json()["error"]["message"] == "messages: must not be empty"
    assert gemini.json()["error"]["message"] == "contents: must not be empty"


NULLED = [  # (route, body with a required field sent null, the field, the type it must have)
    ("/v1/chat/completions", {"model": None, "messages": USER}, "model", "string"),
    ("/v1/completions", {"model": None, "prompt": "hi"}, "model", "string"),
    ("/v1/messages", {"model": None, "max_tokens": 2, "messages": USER}, "model", "string"),
    ("/v1/messages", {"model": "fake", "max_tokens": None, "messages": USER}, "max_tokens", "integer"),
    ("/v1/messages/count_tokens", {"model": None, "messages": USER}, "model", "string"),
]  # fmt: skip


def test_a_required_field_sent_null_is_told_its_type_in_both_modes(serve_fake):
    """``"model": null`` was answered "model: must not be empty"; a null is a value of the
    wrong type, told as ``"model": 5`` is ("Input should be a valid string")."""
    up, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    with BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw:
        for url in (up.url, gw.url):
            for path, body, field, kind in NULLED:
                r = httpx.post(url + path, json=body, timeout=10)
                assert r.status_code == 400, (url, path, r.text)
                message = r.json()["error"]["message"]
                assert message == f"{field}: Input should be a valid {kind}", (url, path, message)


def test_a_whole_request_inside_count_tokens_takes_empty_fields_as_absent(serve_fake):
    """countTokens' ``generateContentRequest`` is a ``generateContent`` body: its fields' empty
    values are their absence there too (``labels: {}`` was a 400 "Unrecognized request
    argument supplied: generateContentRequest.labels"; found by test_edge_combinations.py)."""
    srv, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    inner = {"model": "models/fake", "contents": CONTENTS}
    fields = sorted(
        (set(gemini_models.GenerateContentRequest.model_fields) | {"labels"}) - set(inner)
    )
    differ: list[str] = []
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        path = "/v1beta/models/fake:countTokens"
        expected = _outcome(http.post(path, json={"generateContentRequest": inner}))
        assert expected == (200, None)
        for name in fields:
            for empty in EMPTIES:
                body = {"generateContentRequest": {**inner, name: empty}}
                got = _outcome(http.post(path, json=body))
                if got != expected:
                    differ.append(f"{name}={empty!r}: {got}")
    assert not differ, "; ".join(differ)
