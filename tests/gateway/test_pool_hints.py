"""The Gateway API Inference Extension's hint headers on an engine pod: with
``trust_pool_headers`` the fairness id is the engine request's tenant and the objective its
priority (``objective_priority``); without it both are ignored."""

from __future__ import annotations

import json
import subprocess

import pytest
from prefixgate.gateway.serve.args import add_serve_arguments
from prefixgate.gateway.serve.configure import (
    objective_policy_warning,
    objective_priorities,
    settings_from_args,
)
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.pool_hints import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER

POOL = {FAIRNESS_ID_HEADER: "flow-7", OBJECTIVE_HEADER: "batch"}


def _keys_file(tmp_path, keys: list[dict]) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": keys}))
    return str(path)


def _trusted(**kw) -> GatewaySettings:
    return GatewaySettings(
        model_name="fake",
        trust_pool_headers=True,
        objective_priority={"batch": 10, "interactive": -5},
        **kw,
    )


def test_trusted_headers_set_tenant_and_priority_on_every_route(serve_fake, gw):
    srv, engine = serve_fake(_trusted(), scheduling_policy="priority")
    chat = gw.chat_body(max_tokens=2)
    with gw.client(srv) as http:
        r = http.post("/v1/chat/completions", json=chat, headers=POOL)
        assert r.status_code == 200, r.text
        r = http.post(
            "/v1/completions",
            json={"model": "fake", "prompt": "hi", "max_tokens": 2},
            headers={FAIRNESS_ID_HEADER: "flow-8", OBJECTIVE_HEADER: "interactive"},
        )
        assert r.status_code == 200, r.text
        r = http.post(
            "/v1/messages",
            json={"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
            headers=POOL,
        )
        assert r.status_code == 200, r.text
        r = http.post(
            "/v1/responses",
            json={"model": "fake", "input": "x", "max_output_tokens": 2},
            headers=POOL,
        )
        assert r.status_code == 200, r.text
        r = http.post(
            "/v1beta/models/fake:generateContent",
            json={
                "contents": [{"role": "user", "parts": [{"text": "x"}]}],
                "generationConfig": {"maxOutputTokens": 2},
            },
            headers=POOL,
        )
        assert r.status_code == 200, r.text
    assert engine.tenants_seen == [
        ("flow-7", 10),
        ("flow-8", -5),
        ("flow-7", 10),
        ("flow-7", 10),
        ("flow-7", 10),
    ]
    gw.wait_idle(srv, engine)


def test_untrusted_headers_are_ignored(serve_fake, gw, tmp_path):
    keys = _keys_file(tmp_path, [{"key": "sk-a", "name": "team-a", "priority": 3}])
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keys_file=keys), scheduling_policy="priority"
    )
    with gw.client(srv, headers={"Authorization": "Bearer sk-a", **POOL}) as http:
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
    assert engine.tenants_seen == [("team-a", 3)]  # the key's, not the pool's
    gw.wait_idle(srv, engine)


def test_absent_or_unknown_hints_keep_the_keys_defaults(serve_fake, gw, tmp_path):
    # An objective not mapped gets the default priority (the key's), as the endpoint picker
    # gives an unknown InferenceObjective its default; no fairness id: the key's tenant.
    keys = _keys_file(tmp_path, [{"key": "sk-a", "name": "team-a", "priority": 3}])
    srv, engine = serve_fake(_trusted(keys_file=keys), scheduling_policy="priority")
    body = gw.chat_body(max_tokens=2)
    with gw.client(srv, headers={"Authorization": "Bearer sk-a"}) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        r = http.post("/v1/chat/completions", json=body, headers={OBJECTIVE_HEADER: "nightly"})
        assert r.status_code == 200
        r = http.post("/v1/chat/completions", json=body, headers={OBJECTIVE_HEADER: "batch"})
        assert r.status_code == 200
        r = http.post("/v1/chat/completions", json=body, headers={FAIRNESS_ID_HEADER: "f"})
        assert r.status_code == 200
    assert engine.tenants_seen == [("team-a", 3), ("team-a", 3), ("team-a", 10), ("f", 3)]
    gw.wait_idle(srv, engine)


def test_request_priority_comes_before_the_objective(serve_fake, gw, tmp_path):
    keys = _keys_file(tmp_path, [{"key": "sk-b", "name": "team-b", "allow_priority": True}])
    srv, engine = serve_fake(_trusted(keys_file=keys), scheduling_policy="priority")
    with gw.client(srv, headers={"Authorization": "Bearer sk-b", **POOL}) as http:
        r = http.post("/v1/chat/completions", json={**gw.chat_body(max_tokens=2), "priority": 1})
        assert r.status_code == 200
    assert engine.tenants_seen == [("flow-7", 1)]
    gw.wait_idle(srv, engine)


@pytest.mark.parametrize("value", ["", "x" * 257, "a\tb"])
def test_bad_fairness_id_is_a_400_naming_the_header(serve_fake, gw, value):
    srv, engine = serve_fake(_trusted(), scheduling_policy="priority")
    with gw.client(srv) as http:
        r = http.post(
            "/v1/chat/completions",
            json=gw.chat_body(max_tokens=2),
            headers={FAIRNESS_ID_HEADER: value},
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == FAIRNESS_ID_HEADER and err["code"] == "invalid_header"
    assert engine.tenants_seen == []


def test_flags_and_settings():
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(
        [
            "--trust-pool-headers",
            "--objective-priority",
            "batch=10",
            "--objective-priority",
            "chat = -2",
        ]
    )
    s = settings_from_args(args)
    assert s.trust_pool_headers and s.objective_priority == {"batch": 10, "chat": -2}
    assert not settings_from_args(p.parse_args([])).trust_pool_headers
    for bad in (["x"], ["=1"], ["a=b"], ["a=1", "a=2"]):
        with pytest.raises(ValueError, match="--objective-priority"):
            objective_priorities(bad)
    with pytest.raises(ValueError, match="trust_pool_headers"):
        GatewaySettings(objective_priority={"batch": 1})
    with pytest.raises(ValueError, match="32-bit"):
        GatewaySettings(trust_pool_headers=True, objective_priority={"batch": 2**31})


def test_serve_refuses_the_flags_where_they_would_do_nothing():
    # In proxy mode the gateway is not a pool's model server; --objective-priority alone
    # would be ignored. Both are a one-line refusal (exit 2), not a silent no-op.
    from support.net import free_port
    from support.serve_process import SERVE

    for flags, words in (
        (["--upstream", "http://127.0.0.1:9", "--trust-pool-headers"], ["--trust-pool-headers"]),
        (["--upstream", "http://127.0.0.1:9", "--objective-priority", "a=1"], ["trust_pool"]),
    ):
        proc = subprocess.run(
            [*SERVE, "--port", str(free_port()), "--host", "127.0.0.1", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "bad option" in proc.stderr and all(w in proc.stderr for w in words)


def test_objectives_under_a_policy_without_priorities_are_warned_of():
    assert objective_policy_warning({"batch": 10}, "priority") is None
    assert objective_policy_warning({}, "fcfs") is None
    for policy in ("fcfs", "fair"):
        warning = objective_policy_warning({"batch": 10}, policy)
        assert warning and "--objective-priority" in warning and policy in warning
