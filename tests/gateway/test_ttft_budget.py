"""TTFT budgets (``x-prefixgate-ttft-budget-ms``): a request whose predicted first-token wait
exceeds its budget is refused at once with 429 ``ttft_budget_exceeded`` and a Retry-After of
the wait beyond the budget; within the budget, without one, or before the engine can predict,
it is served; a malformed budget is a 400 naming the header. Nothing is charged or queued by a
refusal (the key's requests-per-minute bucket and the admission queue stay untouched)."""

from __future__ import annotations

import json

import pytest
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.ttft_budget import BUDGET_HEADER


def _post(gw, srv, headers=None, **body):
    with gw.client(srv) as c:
        return c.post(
            "/v1/chat/completions", json=gw.chat_body(max_tokens=4, **body), headers=headers
        )


def test_over_budget_is_refused_at_once_with_the_wait_beyond_it(serve_fake, gw):
    srv, engine = serve_fake()
    engine.predicted_ttft = 7.5  # seconds
    r = _post(gw, srv, {BUDGET_HEADER: "2000"})
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "ttft_budget_exceeded" and "7500 ms" in err["message"]
    assert r.headers["Retry-After"] == "6"  # ceil(7.5 - 2.0)
    assert engine.requests_seen == []  # never reached the engine


@pytest.mark.parametrize(
    ("predicted", "headers"),
    [(0.5, {BUDGET_HEADER: "2000"}), (7.5, None), (None, {BUDGET_HEADER: "1"})],
    ids=["within", "no-budget", "not-yet-measured"],
)
def test_served_within_budget_without_one_or_before_a_prediction(
    serve_fake, gw, predicted, headers
):
    srv, engine = serve_fake()
    engine.predicted_ttft = predicted
    r = _post(gw, srv, headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("value", ["0", "-5", "abc", "nan", "inf", "3600001"])
def test_a_malformed_budget_is_a_400_naming_the_header(serve_fake, gw, value):
    srv, engine = serve_fake()
    r = _post(gw, srv, {BUDGET_HEADER: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == BUDGET_HEADER


def test_a_refusal_spends_nothing_of_the_key(serve_fake, gw, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "k1", "name": "a", "requests_per_minute": 1}]}))
    srv, engine = serve_fake(GatewaySettings(model_name="fake", keys_file=str(keys)))
    auth = {"Authorization": "Bearer k1"}
    engine.predicted_ttft = 30.0
    for _ in range(3):  # refused by the budget: the one request a minute is still there
        assert _post(gw, srv, {**auth, BUDGET_HEADER: "100"}).status_code == 429
    engine.predicted_ttft = 0.01
    assert _post(gw, srv, {**auth, BUDGET_HEADER: "100"}).status_code == 200
    r = _post(gw, srv, auth)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"


def test_the_anthropic_messages_route_honours_the_budget(serve_fake, gw):
    srv, engine = serve_fake()
    engine.predicted_ttft = 9.0
    body = {"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with gw.client(srv) as c:
        r = c.post("/v1/messages", json=body, headers={BUDGET_HEADER: "1000"})
    assert r.status_code == 429, r.text
    assert r.json()["type"] == "error" and r.headers["Retry-After"] == "8"


def test_proxy_mode_forwards_the_budget_to_a_prefixgate_upstream(serve_fake, gw):
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer

    upstream, engine = serve_fake()
    engine.predicted_ttft = 5.0
    settings = GatewaySettings(health_interval_s=60)
    with BackgroundServer(lambda: create_proxy_app([upstream.url], settings)) as proxy:
        refused = _post(gw, proxy, {BUDGET_HEADER: "1000"})
        served = _post(gw, proxy, {BUDGET_HEADER: "9000"})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "ttft_budget_exceeded"
    assert served.status_code == 200, served.text
