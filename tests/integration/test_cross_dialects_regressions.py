"""Every failure the cross-dialect property test (``test_cross_dialects.py``) found, as a
named test holding the right value, each on the request hypothesis drew (shrunk by hand)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from support.gateway import serve_aidreams, wait_idle  # noqa: E402

MODEL = "aidreams-260k"
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "OBJECT",
        "properties": {"tz": {"type": "STRING", "enum": ["UTC", "CET"]}},
        "required": ["tz"],
    },
}


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(aidreams_path, model_name=MODEL, tool_call_parser="hermes")


def test_gemini_json_beside_tools_names_what_was_sent(server, pool_whole):
    """Drawn: ``responseMimeType`` application/json (no schema) + tools. Was: 400 whose
    message named ``generationConfig.responseSchema``, a field the request did not send (the
    field violation named ``responseMimeType``). Both name the field sent."""
    body = {
        "contents": [{"role": "user", "parts": [{"text": "Tell me"}]}],
        "generationConfig": {"maxOutputTokens": 4, "responseMimeType": "application/json"},
        "tools": [{"functionDeclarations": [TIME]}],
    }
    r = httpx.post(f"{server.url}/v1beta/models/{MODEL}:generateContent", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    field = err["details"][0]["fieldViolations"][0]["field"]
    assert field == "generationConfig.responseMimeType", err
    assert err["message"].startswith(field + ":"), err
    assert "responseSchema" not in err["message"], err
    wait_idle(server, pool_whole)
