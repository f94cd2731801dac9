"""Tenants see their own (``gateway/http/metrics.visible_exposition``, ``app._viewer``,
``dashboard.DashboardSampler.snapshot``): a tenant's key reads its own usage only, an
operator's key (``role: "operator"`` in the keys file, or ``--api-key``) reads everything,
and no caller but an operator ever sees an upstream address — in every metrics family, under
every routing policy (``precise``'s KV-index and prediction families included)."""

from __future__ import annotations

import json

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.metrics import MetricsView, visible_exposition
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.policies import POLICIES
from prefixgate.gateway.settings import SETTINGS, GatewaySettings
from prefixgate.gateway.tenancy.keys import KeySpec
from prometheus_client.parser import text_string_to_metric_families
from support.net import free_port
from support.stub_upstream import StubServer

KEYS = [
    {"key": "sk-alpha", "name": "alpha"},
    {"key": "sk-beta", "name": "beta"},
    {"key": "sk-ops", "name": "ops", "role": "operator"},
]


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.fixture
def stubs():
    started = [StubServer(name="m").start() for _ in range(2)]
    yield started
    for s in started:
        s.stop()


def _gateway(stubs, tmp_path, policy: str, aidreams_path: str) -> BackgroundServer:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    extra: dict = {}
    if policy == "precise":  # KV-event feeds: the index's families label replicas by URL
        extra = {
            "tokenizer": aidreams_path,
            "upstream_kv_events": {
                s.base_url: (f"tcp://127.0.0.1:{free_port()}", None) for s in stubs
            },
        }
    settings = GatewaySettings(keys_file=str(keys), routing=policy, **extra)
    return BackgroundServer(lambda: create_proxy_app([s.base_url for s in stubs], settings))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_upstream_address_but_to_an_operator_under_every_policy(
    stubs, tmp_path, policy, aidreams_path
):
    with _gateway(stubs, tmp_path, policy, aidreams_path) as gw:
        http = httpx.Client(base_url=gw.url, timeout=10)
        for i, key in enumerate(("sk-alpha", "sk-beta") * 3):
            body = {"model": "m", "messages": [{"role": "user", "content": f"hello {i % 2}"}]}
            r = http.post("/v1/chat/completions", json=body, headers=_auth(key))
            assert r.status_code == 200, r.text
        addresses = [s.base_url for s in stubs] + [s.base_url.split("//")[1] for s in stubs]
        full = http.get("/metrics", headers=_auth("sk-ops")).text
        assert all(a in full for a in addresses)  # the operator sees the upstreams
        if policy == "precise":  # the KV-event endpoints are addresses too
            addresses += [pub for pub, _ in gw.app[SETTINGS].upstream_kv_events.values()]
            assert 'replica="' in full  # the KV index's families, labelled by upstream
        assert 'key="alpha"' in full and 'key="beta"' in full
        for key, own in ((None, None), ("sk-wrong", None), ("sk-alpha", "alpha")):
            text = http.get("/metrics", headers=_auth(key)).text
            assert not any(a in text for a in addresses), (key, policy)
            families = _families(text)
            assert families, text
            for name, samples in families.items():  # every family, every sample
                assert not name.startswith("prefixgate_upstream"), name
                for sample in samples:
                    for label, value in sample.labels.items():
                        assert not any(a in value for a in addresses), (name, label)
                        if label in ("key", "tenant"):
                            assert own is not None and value == own, (key, name, sample)
            if own is not None:
                assert f'prefixgate_key_requests_total{{key="{own}"}} 3.0' in text
            ready = http.get("/ready", headers=_auth(key)).json()
            assert "upstreams" not in ready and "state" not in ready
        assert "upstreams" in http.get("/ready", headers=_auth("sk-ops")).json()
        http.close()


def test_the_dashboard_shows_a_tenant_its_own_usage_and_an_operator_everyones(stubs, tmp_path):
    with _gateway(stubs, tmp_path, "round_robin", "") as gw:
        http = httpx.Client(base_url=gw.url, timeout=10)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for key in ("sk-alpha", "sk-beta", "sk-beta"):
            assert http.post("/v1/chat/completions", json=body, headers=_auth(key)).is_success
        for _ in range(2):
            gw.call(lambda: _sample(gw))
        alpha = http.get("/dashboard/data", headers=_auth("sk-alpha")).json()
        assert set(alpha["keys"]) == {"alpha"} and alpha["keys"]["alpha"]["requests"] == 1
        assert all(set(s["keys"]) <= {"alpha"} for s in alpha["samples"])
        ops = http.get("/dashboard/data", headers=_auth("sk-ops")).json()
        assert set(ops["keys"]) == {"alpha", "beta"} and ops["keys"]["beta"]["requests"] == 2
        assert any(set(s["keys"]) == {"alpha", "beta"} for s in ops["samples"])
        assert http.get("/dashboard/data").status_code == 401
        http.close()


async def _sample(gw: BackgroundServer) -> None:
    from prefixgate.gateway.dashboard import SAMPLER

    gw.app[SAMPLER].sample()


def test_visible_exposition_keeps_a_tenants_own_samples_only():
    text = (
        b"# HELP prefixgate_key_requests_total x\n# TYPE prefixgate_key_requests_total counter\n"
        b'prefixgate_key_requests_total{key="a"} 1.0\n'
        b'prefixgate_key_requests_total{key="a \\"b\\""} 2.0\n'
        b'prefixgate_tenant_queue_requests{tenant="a"} 0.0\n'
        b'prefixgate_route_predictions_total{upstream="http://u:1",result="hit"} 3.0\n'
        b'prefixgate_kv_index_synced{replica="e0"} 1.0\n'
        b'prefixgate_requests_total{route="chat",note="see http://u:1"} 2.0\n'
        b'prefixgate_requests_total{route="chat"} 2.0\n'
    )
    mine = visible_exposition(text, MetricsView(own='a "b"', hidden=("http://u:1",)))
    assert mine.split(b"\n") == [
        b"# HELP prefixgate_key_requests_total x",
        b"# TYPE prefixgate_key_requests_total counter",
        b'prefixgate_key_requests_total{key="a \\"b\\""} 2.0',
        b'prefixgate_requests_total{route="chat"} 2.0',
        b"",
    ]
    anonymous = visible_exposition(text, MetricsView())
    assert b"prefixgate_key" not in anonymous and b"prefixgate_tenant" not in anonymous
    assert b"upstream=" not in anonymous and b"replica=" not in anonymous


def test_keys_file_roles():
    assert KeySpec(key="k").role == "tenant"
    assert KeySpec(key="k", role="operator").role == "operator"
    with pytest.raises(ValueError, match="role of key"):
        KeySpec(key="k", role="admin")
