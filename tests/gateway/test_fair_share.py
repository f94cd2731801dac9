"""Fair share in the gateway: the key's name is the tenant the engine's fair scheduler charges,
keys-file ``weight`` / ``priority`` / ``allow_priority``, the request field ``priority``,
the admission queue bound shared per tenant, and per-tenant stats in /metrics."""

from __future__ import annotations

import json

import pytest
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.serve.runner import key_policy_warnings, key_weights
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.admission import AdmissionConfig, AdmissionController
from prefixgate.gateway.tenancy.keys import KeySpec, load_keys_file


def _keys_file(tmp_path, keys: list[dict]) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": keys}))
    return str(path)


def test_key_name_is_the_tenant_and_priority_is_the_keys_to_allow(serve_fake, gw, tmp_path):
    keys = _keys_file(
        tmp_path,
        [
            {"key": "sk-a", "name": "team-a", "priority": 3},
            {"key": "sk-b", "name": "team-b", "allow_priority": True, "weight": 2},
        ],
    )
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keys_file=keys), scheduling_policy="priority"
    )
    body = gw.chat_body(max_tokens=2)
    with gw.client(srv, headers={"Authorization": "Bearer sk-a"}) as a:
        assert a.post("/v1/chat/completions", json=body).status_code == 200
        r = a.post("/v1/chat/completions", json={**body, "priority": 0})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "priority" and err["code"] == "priority_not_allowed"
        r = a.post("/v1/completions", json={"model": "fake", "prompt": "hi", "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    with gw.client(srv, headers={"Authorization": "Bearer sk-b"}) as b:
        assert b.post("/v1/chat/completions", json={**body, "priority": -5}).status_code == 200
        assert b.post("/v1/chat/completions", json=body).status_code == 200
        bad = b.post("/v1/chat/completions", json={**body, "priority": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    # the refused requests never reached the engine
    assert engine.tenants_seen == [("team-a", 3), ("team-b", -5), ("team-b", 0)]
    gw.wait_idle(srv, engine)


def test_open_gateway_has_no_tenant_and_refuses_no_priority(serve_fake, gw):
    srv, engine = serve_fake(scheduling_policy="priority")
    with gw.client(srv) as http:
        r = http.post("/v1/chat/completions", json={**gw.chat_body(max_tokens=2), "priority": 2})
        assert r.status_code == 200
    assert engine.tenants_seen == [(None, 2)]


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_request_priority_is_refused_where_the_policy_ignores_it(serve_fake, gw, policy):
    # Under fcfs (the default) or fair, a request's priority was answered 200 and changed
    # nothing: it is a 400 naming the field (vLLM's rule); 0, the no-op value, is served.
    srv, engine = serve_fake(scheduling_policy=policy)
    body = gw.chat_body(max_tokens=2)
    with gw.client(srv) as http:
        for route, b in (
            ("/v1/chat/completions", body),
            ("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2}),
        ):
            for value in (2, -1):
                r = http.post(route, json={**b, "priority": value})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == "priority" and err["code"] == "priority_not_supported"
                assert policy in err["message"]
            assert http.post(route, json={**b, "priority": 0}).status_code == 200
    assert engine.tenants_seen == [(None, 0), (None, 0)]


def test_keys_file_weight_priority_fields_are_checked(tmp_path):
    assert KeySpec(key="k", weight=0.5, priority=-1, allow_priority=True).weight == 0.5
    for bad in ({"weight": 0}, {"weight": "2"}, {"priority": 1.5}, {"allow_priority": "yes"}):
        with pytest.raises(ValueError):
            KeySpec(key="k", **bad)
    path = _keys_file(
        tmp_path,
        [
            {"key": "a", "name": "x", "weight": 3},
            {"key": "b", "name": "x", "weight": 3},
            {"key": "c"},
        ],
    )
    weights = key_weights(load_keys_file(path), path)
    assert weights["x"] == 3 and len(weights) == 2
    clash = _keys_file(
        tmp_path, [{"key": "a", "name": "x", "weight": 3}, {"key": "b", "name": "x"}]
    )
    with pytest.raises(ValueError, match="two weights"):
        key_weights(load_keys_file(clash), clash)


def test_keys_file_fields_the_policy_ignores_are_warned_at_start(tmp_path):
    """A key's priority acts only under the 'priority' policy and its weight in the engine
    only under 'fair': ``prefixgate serve`` says so at start-up instead of a silent no-op."""
    path = _keys_file(
        tmp_path,
        [
            {"key": "a", "name": "batch", "priority": 5},
            {"key": "b", "name": "big", "weight": 2},
            {"key": "c", "name": "plain"},
        ],
    )
    fcfs = key_policy_warnings(load_keys_file(path), path, "fcfs")
    assert len(fcfs) == 2 and "batch" in fcfs[0] and "big" in fcfs[1]
    assert "plain" not in " ".join(fcfs)
    assert len(key_policy_warnings(load_keys_file(path), path, "priority")) == 1  # the weight only
    assert len(key_policy_warnings(load_keys_file(path), path, "fair")) == 1  # the priority only
    quiet = _keys_file(tmp_path, [{"key": "c", "name": "plain"}])
    assert key_policy_warnings(load_keys_file(quiet), quiet, "fcfs") == []


def test_admission_bound_is_shared_per_tenant():
    ctl = AdmissionController(AdmissionConfig(max_queued_requests=4))
    flood = [ctl.admit(10, tenant="a") for _ in range(4)]  # alone, a may fill the queue
    with pytest.raises(APIError) as exc:
        ctl.admit(10, tenant="a")
    assert exc.value.status == 429
    # b is within its share (half of 4, equal weights): admitted though the queue is full
    b1 = ctl.admit(10, tenant="b")
    b2 = ctl.admit(10, tenant="b")
    with pytest.raises(APIError):
        ctl.admit(10, tenant="b")  # b over its share of 2 now
    assert ctl.queued_by_tenant == {"a": 4, "b": 2}
    for t in flood[:3]:
        t.started()
    assert ctl.queued_by_tenant == {"a": 1, "b": 2}
    b3 = ctl.admit(10, tenant="b")  # the queue has room again: anyone may enter
    a2 = ctl.admit(10, tenant="a")  # full again, but a (1 queued) is within its share of 2
    # weights: c (weight 3) gets 3/4 of the queue next to a (1) and b (1): share 4*3/5
    c = [ctl.admit(10, tenant="c", weight=3.0) for _ in range(2)]
    with pytest.raises(APIError):
        ctl.admit(10, tenant="c", weight=3.0)
    for t in [*flood, b1, b2, b3, a2, *c]:
        t.done()
    assert ctl.queued_by_tenant == {} and ctl.queued_requests == 0 and ctl.in_flight == 0


def test_metrics_show_per_tenant_service_and_queue(serve_fake, gw, tmp_path):
    keys = _keys_file(tmp_path, [{"key": "sk-a", "name": "team-a"}])
    srv, engine = serve_fake(GatewaySettings(model_name="fake", keys_file=keys))
    engine.tenant_rows = {
        "team-a": {
            "served_input_tokens": 12,
            "served_output_tokens": 4,
            "virtual_counter": 20.0,
            "num_waiting": 0,
            "num_running": 0,
        }
    }
    with gw.client(srv, headers={"Authorization": "Bearer sk-a"}) as http:
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
        text = http.get("/metrics").text
    assert 'prefixgate_tenant_served_input_tokens{tenant="team-a"} 12.0' in text
    assert 'prefixgate_tenant_served_output_tokens{tenant="team-a"} 4.0' in text
    assert 'prefixgate_tenant_virtual_counter{tenant="team-a"} 20.0' in text
    assert "prefixgate_tenant_queue_requests" in text


def test_a_prefix_pin_is_charged_to_the_keys_tenant(serve_fake, gw, tmp_path):
    # under fair, pinned prefix blocks count against the tenant's share: the gateway hands
    # the key's name to pin_prefix (None on an open gateway)
    keys = _keys_file(tmp_path, [{"key": "sk-a", "name": "team-a"}])
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keys_file=keys), scheduling_policy="fair"
    )
    body = {
        "model": "fake",
        "ttl_seconds": 60,
        "messages": [{"role": "system", "content": "a shared system prompt " * 2}],
    }
    with gw.client(srv, headers={"Authorization": "Bearer sk-a"}) as a:
        r = a.post("/v1/prefixes", json=body)
        assert r.status_code == 200, r.text
        assert a.delete(f"/v1/prefixes/{r.json()['id']}").status_code == 200
    assert engine.pin_tenants_seen == ["team-a"]
    gw.wait_idle(srv, engine)
    open_srv, open_engine = serve_fake(scheduling_policy="fair")
    with gw.client(open_srv) as http:
        assert http.post("/v1/prefixes", json=body).status_code == 200
    assert open_engine.pin_tenants_seen == [None]


def test_metrics_carry_displacements_queued_prefill_and_measured_rates(serve_fake, gw):
    srv, engine = serve_fake(scheduling_policy="fair")
    with gw.client(srv) as http:
        text = http.get("/metrics").text
        assert "prefixgate_engine_displacements 0.0" in text
        assert "prefixgate_engine_queued_prefill_tokens 0.0" in text
        assert "prefixgate_engine_prefill_tokens_per_second" not in text  # not measured yet
        engine.rates = {"prefill_tokens_per_s": 1500.0, "decode_tokens_per_s": 80.0}
        text = http.get("/metrics").text
        assert "prefixgate_engine_prefill_tokens_per_second 1500.0" in text
        assert "prefixgate_engine_decode_tokens_per_second 80.0" in text
    gw.wait_idle(srv, engine)


def test_every_generating_route_charges_the_keys_tenant_and_priority(serve_fake, gw, tmp_path):
    # The responses and messages routes built their engine requests without the tenant (the
    # fair policy charged them to "default") and, on responses, without the key's priority:
    # every route now builds its engine request in one function (``engine_request``).
    keys = _keys_file(tmp_path, [{"key": "sk-a", "name": "team-a", "priority": 3}])
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keys_file=keys), scheduling_policy="priority"
    )
    with gw.client(srv, headers={"Authorization": "Bearer sk-a"}) as a:
        routes = (
            ("/v1/chat/completions", gw.chat_body(max_tokens=2)),
            ("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2}),
            ("/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 2}),
            (
                "/v1/messages",
                {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            ),
        )
        for route, body in routes:
            r = a.post(route, json=body)
            assert r.status_code == 200, (route, r.text)
    assert engine.tenants_seen == [("team-a", 3)] * 4
    gw.wait_idle(srv, engine)
