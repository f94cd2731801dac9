"""Every header the gateway decodes is decoded safely (``gateway/http/headers.py``): bytes that
are not UTF-8 in ``Authorization``, ``Expect`` or ``x-request-id`` are a 4xx OpenAI error naming
the header (or, for the id, a fresh id), never a 500 — local and proxy mode, open or keyed."""

from __future__ import annotations

import json

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error
from support.stub_upstream import StubServer

BAD = [b"Bearer \xff\xfe", b"\xc3(", b"Bearer k\x80", b"\xed\xa0\x80"]  # the last: a surrogate


def _keys(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "k"}]}))
    return str(path)


def _check(url: str, keyed: bool, reads_auth: bool = True, model: str = "fake") -> None:
    """``reads_auth``: the gateway reads ``Authorization`` (it has keys, or forwards the
    client's own upstream); an open local gateway ignores it."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    good = {"Authorization": b"Bearer k"} if keyed else {}
    with httpx.Client(base_url=url, timeout=10) as http:
        for value in BAD:
            for path, req in (
                ("/v1/chat/completions", body),
                ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}),
            ):
                r = http.post(path, headers={"Authorization": value}, json=req)
                if not reads_auth:
                    assert r.status_code == 200, r.text
                    continue
                assert_openai_error(r, 400, "invalid_header", "Authorization")
                assert "Authorization" in r.json()["error"]["message"]
            r = http.post("/v1/chat/completions", headers={**good, "Expect": value}, json=body)
            assert_openai_error(r, 417, "expectation_failed")  # test_tenants holds it too
            r = http.get("/v1/models", headers={**good, "x-request-id": value})
            assert r.status_code == 200, r.text
            assert len(r.headers["x-request-id"]) == 32  # a fresh id, never the bytes echoed
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("keyed", [True, False])
def test_local_mode_refuses_undecodable_headers_by_name(serve_fake, tmp_path, keyed):
    keys = _keys(tmp_path) if keyed else None
    srv, _ = serve_fake(GatewaySettings(model_name="fake", keys_file=keys))
    _check(srv.url, keyed, reads_auth=keyed)


@pytest.mark.parametrize("keyed", [True, False])
def test_proxy_mode_refuses_undecodable_headers_by_name(tmp_path, keyed):
    stub = StubServer().start()
    try:
        keys = _keys(tmp_path) if keyed else None
        settings = GatewaySettings(keys_file=keys)
        with BackgroundServer(lambda: create_proxy_app([stub.base_url], settings)) as gw:
            _check(gw.url, keyed, model="stub-model")  # the model its /v1/models lists
        # nothing undecodable was forwarded (gateway-side keys are not forwarded either)
        assert {r["auth"] for r in stub.records} <= {None}
    finally:
        stub.stop()


def test_x_api_key_bytes_that_are_not_utf8_are_refused_by_name(serve_fake, tmp_path):
    srv, _ = serve_fake(GatewaySettings(model_name="fake", keys_file=_keys(tmp_path)))
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(
        srv.url + "/v1/chat/completions", headers={"x-api-key": b"k\xff"}, json=body, timeout=10
    )
    assert_openai_error(r, 400, "invalid_header", "x-api-key")
