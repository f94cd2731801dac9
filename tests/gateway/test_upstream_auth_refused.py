"""An upstream that refuses the gateway's credentials (a wrong ``--upstream-api-key``, or none
sent to a keyed upstream) is told at start and in ``/ready``, never reported healthy; and
``tenant_isolation`` is never true while an upstream's ``cache_salt`` support is unknown."""

from __future__ import annotations

import logging

import httpx
import pytest
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import FakeEngine, assert_idle_and_whole

OPS = {"Authorization": "Bearer kops"}


@pytest.fixture(scope="module")
def _upstreams():
    engines = [FakeEngine(), FakeEngine()]
    keyed_settings = GatewaySettings(model_name="fake", api_keys=["sk-good"])
    with (
        BackgroundServer(lambda: create_app(engines[0], keyed_settings)) as keyed,
        BackgroundServer(
            lambda: create_app(engines[1], GatewaySettings(model_name="fake"))
        ) as open_,
    ):
        yield [(keyed, engines[0]), (open_, engines[1])]


@pytest.fixture
def upstreams(_upstreams):
    """A local-mode gateway keyed ``sk-good`` and an open one, both serving model ``fake``:
    their URLs; each test ends with both engines idle and their pools whole."""
    yield tuple(srv.url for srv, _ in _upstreams)
    for srv, engine in _upstreams:
        assert_idle_and_whole(srv, engine)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        (
            GatewaySettings(upstream_api_key="sk-WRONG", api_keys=["kops"]),
            "refused the gateway's credentials",
        ),
        (GatewaySettings(api_keys=["kops"]), "needs a key, and the gateway sends none"),
    ],
    ids=["wrong-key", "no-key"],
)
def test_an_upstream_refusing_the_gateways_key_is_not_ready(upstreams, caplog, settings, said):
    """Was: ``/ready`` 200, the upstream ``"healthy": true`` and ``"tenant_isolation": true``
    (its cache_salt unknown) while every request was 502 ``upstream_auth_failed``; the start
    log said "no answer from GET /v1/models" of an upstream that answered 401."""
    keyed, open_ = upstreams
    with caplog.at_level(logging.INFO, logger="prefixgate"):
        with BackgroundServer(lambda: create_proxy_app([keyed, open_], settings)) as gw:
            ready = httpx.get(gw.url + "/ready", headers=OPS, timeout=10)
        assert ready.status_code == 200, ready.text  # the open upstream serves
        body = ready.json()
        entry = next(u for u in body["upstreams"] if u["url"] == keyed)
        assert entry["healthy"] is False and entry["state"] == "auth_failed", entry
        assert entry["last_error"] == f"HTTP 401: {said}" or entry["last_error"].startswith(
            f"HTTP 401: {said}"
        ), entry
        assert entry["cache_salt"] is None
        assert body["tenant_isolation"] is None  # not known: never a yes
        assert body["upstreams_healthy"] == 1
    assert f"upstream {keyed}: HTTP 401: {said}" in caplog.text
    assert "no answer from GET /v1/models" not in caplog.text

    # the only upstream refusing the gateway's key: not ready, and why
    with BackgroundServer(lambda: create_proxy_app([keyed], settings)) as gw:
        ready = httpx.get(gw.url + "/ready", timeout=10)
    assert ready.status_code == 503, ready.text
    assert "1 refused the gateway's credentials" in ready.text


def test_an_open_proxy_without_a_key_stays_ready_for_the_clients_keys(upstreams, caplog):
    """An open proxy forwards each client's key, so a keyed upstream serves those clients:
    ready, but its entry says the gateway's own request was refused, and isolation is
    unknown."""
    keyed, _ = upstreams
    with caplog.at_level(logging.INFO, logger="prefixgate"):
        with BackgroundServer(lambda: create_proxy_app([keyed], GatewaySettings())) as gw:
            ready = httpx.get(gw.url + "/ready", timeout=10)
            body = ready.json()
            assert ready.status_code == 200 and body["tenant_isolation"] is None, body
            entry = body["upstreams"][0]
            assert entry["healthy"] is True, entry
            assert "clients' own keys are forwarded" in entry["last_error"], entry
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": "Bearer sk-good"},
                timeout=10,
            )
            assert r.status_code == 200, r.text
    assert "needs a key, and the gateway sends none" in caplog.text
