"""No tenant data to anonymous callers: when the gateway has API keys, ``/metrics``' per-key,
per-tenant and per-upstream families and ``/ready``'s upstream URLs and errors need a key —
a tenant's key sees its own samples, an operator's key everything (``test_tenant_views``);
``/health`` stays open, and an open gateway shows everything."""

from __future__ import annotations

import json

import httpx
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.metrics import PRIVATE_FAMILIES, public_exposition
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

AUTH = {"Authorization": "Bearer sk-team"}
OPS = {"Authorization": "Bearer sk-ops"}


def _keys(tmp_path) -> str:
    path = tmp_path / "keys.json"
    keys = [
        {"key": "sk-team", "name": "team-secret-name"},
        {"key": "sk-ops", "name": "ops", "role": "operator"},
    ]
    path.write_text(json.dumps({"keys": keys}))
    return str(path)


def _chat(url: str) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


def test_local_metrics_hide_tenants_from_callers_without_a_key(serve_fake, tmp_path):
    srv, _ = serve_fake(GatewaySettings(model_name="fake", keys_file=_keys(tmp_path)))
    _chat(srv.url)
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            public = http.get("/metrics", headers=headers)
            assert public.status_code == 200
            assert "team-secret-name" not in public.text
            assert not any(f in public.text for f in PRIVATE_FAMILIES), public.text
            assert "prefixgate_requests_total" in public.text  # aggregates stay public
        full = http.get("/metrics", headers=AUTH).text
        assert 'prefixgate_key_requests_total{key="team-secret-name"} 1.0' in full
        assert http.get("/health").status_code == 200


def test_open_gateway_metrics_show_everything(serve_fake):
    srv, _ = serve_fake(GatewaySettings(model_name="fake"))
    _chat(srv.url)
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    assert "prefixgate_tenant_" in text or "prefixgate_key_" in text


def test_proxy_ready_and_metrics_hide_upstreams_from_callers_without_a_key(serve_fake, tmp_path):
    upstream, _ = serve_fake(GatewaySettings(model_name="fake"))
    settings = GatewaySettings(keys_file=_keys(tmp_path))
    with BackgroundServer(lambda: create_proxy_app([upstream.url], settings)) as gw:
        _chat(gw.url)
        with httpx.Client(base_url=gw.url, timeout=10) as http:
            ready = http.get("/ready")
            assert ready.status_code == 200
            assert upstream.url not in ready.text and "upstreams" not in ready.json()
            assert ready.json()["upstreams_healthy"] == 1
            metrics = http.get("/metrics").text
            assert upstream.url not in metrics and "team-secret-name" not in metrics
            assert upstream.url not in http.get("/ready", headers=AUTH).text  # a tenant's key
            assert upstream.url not in http.get("/metrics", headers=AUTH).text
            assert upstream.url in http.get("/ready", headers=OPS).text
            assert upstream.url in http.get("/metrics", headers=OPS).text


def test_public_exposition_drops_whole_families():
    text = (
        b"# HELP prefixgate_key_requests_total x\n# TYPE prefixgate_key_requests_total counter\n"
        b'prefixgate_key_requests_total{key="a"} 1.0\n# HELP prefixgate_requests_total y\n'
        b'prefixgate_requests_total{route="chat"} 2.0\n'
    )
    assert public_exposition(text) == (
        b'# HELP prefixgate_requests_total y\nprefixgate_requests_total{route="chat"} 2.0\n'
    )
