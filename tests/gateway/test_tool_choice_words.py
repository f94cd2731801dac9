"""Gemini and Messages refusals in their own terms, in local mode and through the proxy.
Tools without a tool choice (the official clients' default) on a server without
``--tool-call-parser``: the 400 gives the advice in the route's own terms (``wire.tools.
ChoiceWords``), never OpenAI's ``'required'``. An empty Gemini ``contents``: 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

SCHEMA = {"type": "object", "properties": {}}


@pytest.fixture(params=["local", "proxy"])
def url(request, serve_fake):
    srv, _ = serve_fake(GatewaySettings(model_name="fake"))
    if request.param == "local":
        yield srv.url
        return
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        yield gw.url


def test_anthropic_tools_without_a_parser_get_messages_advice(url):
    body = {
        "model": "fake",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"name": "f", "input_schema": SCHEMA}],
    }
    r = httpx.post(url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    said = r.json()["error"]["message"]
    assert '{"type": "any"}' in said and '{"type": "tool", "name": ...}' in said, said
    assert "'required'" not in said and "named function" not in said, said


def test_gemini_tools_without_a_parser_get_gemini_advice(url):
    body = {
        "contents": [{"parts": [{"text": "q"}]}],
        "tools": [{"functionDeclarations": [{"name": "f", "parameters": SCHEMA}]}],
    }
    r = httpx.post(url + "/v1beta/models/fake:generateContent", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    said = err["message"]
    assert "toolConfig.functionCallingConfig.mode" in said and "ANY" in said, said
    assert "'required'" not in said and "named function" not in said, said
    fields = [v["field"] for d in err.get("details", []) for v in d.get("fieldViolations", [])]
    assert fields == ["toolConfig.functionCallingConfig.mode"], err


@pytest.mark.parametrize("empty", ["", [], None])
def test_gemini_empty_contents_is_a_400_naming_contents(url, empty):
    """``contents`` empty on every Gemini method: 400 ``contents: must not be empty`` (an empty
    field is its absence, as local chat answers it); countTokens said "give contents or
    generateContentRequest (one)". A ``null`` where ``contents`` is required is a value of the
    wrong type, told as any other is (``request_models.parse``); countTokens, where it may be
    absent beside a ``generateContentRequest``, takes it as absent."""
    for method in ("generateContent", "streamGenerateContent?alt=sse", "countTokens"):
        r = httpx.post(f"{url}/v1beta/models/fake:{method}", json={"contents": empty}, timeout=30)
        assert r.status_code == 400, (method, r.text)
        err = r.json()["error"]
        said = "must not be empty"
        if empty is None and method != "countTokens":
            said = "Input should be a valid array"
        assert err["message"].startswith(f"contents: {said}"), (method, err)
        fields = [v["field"] for d in err["details"] for v in d.get("fieldViolations", [])]
        assert fields == ["contents"], (method, err)
