"""Tenant isolation and accounting (issue 12), local and proxy mode, on the fake engine.

Proxy mode runs a gateway with ``--upstream`` in front of a real prefixgate gateway (the fake
engine behind it) on loopback; the real-model versions are in
``tests/integration/test_tenants_aidreams.py``.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.auth import KeySpec, effective_salt
from prefixgate.gateway.server import BackgroundServer
from prefixgate.gateway.state import STATE, GatewaySettings
from prefixgate.gateway.upstream import split_credentials
from support.stub_upstream import STUB, StubServer


def _keys(tmp_path, entries: list[dict]) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": entries}))
    return str(path)


# --- 2. salt composition is injective ---------------------------------------------------------


def test_effective_salt_is_injective():
    pairs = [
        ("acme", None),
        ("acme/prod", None),
        ("acme", "prod"),
        ("acme/", "prod"),
        ("acme", "/prod"),
        (None, "acme/prod"),
        (None, "prod"),
        ("prod", None),
        ('a", "b', None),
        ("a", '", "b'),
        ("a", "\ud800"),
    ]
    salts = [effective_salt(k, r) for k, r in pairs]
    assert len(set(salts)) == len(salts), salts
    assert effective_salt(None, None) is None
    assert all(s is None or len(s) <= 256 for s in salts)
    for bad in ("a\x00b", "x" * 257, "\ud800"):
        with pytest.raises(ValueError, match="salt"):
            KeySpec(key="k", salt=bad)


def test_key_salt_plus_request_salt_never_meets_another_key(serve_fake, gw, tmp_path):
    """Key salt ``acme`` + ``cache_salt: "prod"`` was key salt ``acme/prod``: cross-key hits."""
    keys = _keys(tmp_path, [{"key": "ka", "salt": "acme"}, {"key": "kb", "salt": "acme/prod"}])
    srv, engine = serve_fake(GatewaySettings(model_name="fake", keys_file=keys))
    prompt = "s" * 80  # 5 full blocks of the fake engine's 16
    with gw.client(srv) as c:
        for key, extra in (("ka", {"cache_salt": "prod"}), ("ka", {"cache_salt": "prod"})):
            r = c.post(
                "/v1/chat/completions",
                json=gw.chat_body(prompt, max_tokens=1, **extra),
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same tenant
        r = c.post(
            "/v1/chat/completions",
            json=gw.chat_body(prompt, max_tokens=1),
            headers={"Authorization": "Bearer kb"},
        )
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    salts = [seen[3] for seen in engine.requests_seen]
    assert salts[0] == salts[1] != salts[2] == "acme/prod"


# --- 6. upstream credentials ------------------------------------------------------------------


def test_split_credentials():
    assert split_credentials("http://h:1/v1/") == ("http://h:1", None)
    url, auth = split_credentials("http://us%40er:p%3Ass@127.0.0.1:8000/v1")
    assert url == "http://127.0.0.1:8000"
    assert auth == "Basic " + __import__("base64").b64encode(b"us@er:p:ss").decode()
    with pytest.raises(ValueError) as info:
        split_credentials("http://u:hunter2@h:1/path")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("client_auth", [None, "Bearer client-key"])
def test_upstream_userinfo_redacted_and_sent_once(tmp_path, caplog, client_auth):
    up = BackgroundServer(StubServer(name="m").app).__enter__()
    port = up.url.rsplit(":", 1)[1]
    url = f"http://alice:hunter2@127.0.0.1:{port}"
    dead = "http://bob:s3cret@127.0.0.1:1"  # refused: logged as unhealthy
    try:
        with (
            caplog.at_level(logging.INFO, logger="prefixgate"),
            BackgroundServer(lambda: create_proxy_app([url, dead], GatewaySettings())) as proxy,
            httpx.Client(base_url=proxy.url, timeout=30) as c,
        ):
            headers = {"Authorization": client_auth} if client_auth else {}
            for i in range(6):
                body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}" * 40}]}
                r = c.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
            shown = c.get("/ready").text + c.get("/metrics").text
            assert "127.0.0.1:" + port in shown
            shown += caplog.text + json.dumps(proxy.app[STATE].router.describe())
        for secret in ("hunter2", "s3cret", "alice", "bob"):
            assert secret not in shown
        basic = split_credentials(url)[1]
        auths = [r["auth"] for r in up.app[STUB].records]
        assert auths and set(auths) == {basic}
    finally:
        up.close()


def test_upstream_userinfo_and_api_key_conflict():
    with pytest.raises(ValueError, match="one credential"):
        create_proxy_app(["http://u:p@127.0.0.1:1"], GatewaySettings(upstream_api_key="k"))
