"""A 429 on Gemini's routes carries the wait in its body too, as Google's API sends it: a
``google.rpc.RetryInfo`` detail whose ``retryDelay`` (a JSON Duration, ``"<seconds>s"``) is the
``retry-after-ms`` header's wait; google-genai raises the body as ``APIError.details``, where
a caller's own retry reads it (the client reads no header). Other errors carry no such detail
(fake engine, fast)."""

from __future__ import annotations

import json

import httpx
from prefixgate.gateway.settings import GatewaySettings

GEN = "/v1beta/models/fake:generateContent"
HELLO = {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 1}}
RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


def test_a_rate_limit_429_states_its_wait_as_retry_info(serve_fake, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "k1", "requests_per_minute": 1}]}))
    srv, _ = serve_fake(GatewaySettings(model_name="fake", keys_file=str(keys)))
    h = {"x-goog-api-key": "k1"}
    assert httpx.post(srv.url + GEN, json=HELLO, headers=h).status_code == 200
    r = httpx.post(srv.url + GEN, json=HELLO, headers=h)
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["status"] == "RESOURCE_EXHAUSTED"
    infos = [d for d in error.get("details", []) if d["@type"] == RETRY_INFO]
    assert len(infos) == 1, error
    delay = infos[0]["retryDelay"]
    assert delay.endswith("s")
    assert float(delay[:-1]) == int(r.headers["retry-after-ms"]) / 1000.0
    assert 0 < float(delay[:-1]) <= 60.0


def test_an_error_without_a_wait_has_no_retry_info(serve_fake):
    srv, _ = serve_fake()
    r = httpx.post(srv.url + GEN, json={**HELLO, "generationConfig": {"temperature": 9}})
    assert r.status_code == 400
    assert all(d["@type"] != RETRY_INFO for d in r.json()["error"].get("details", []))
