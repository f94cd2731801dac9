"""Explicit prefix API against the fake engine: create/get/delete, 404s, pin cap, prefix_id."""

from __future__ import annotations

import time

from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error

SYSTEM = "You are a terse assistant who answers in one word. " * 2  # 104 chars


def test_prefix_lifecycle_and_prefix_id_equals_full_messages(serve_fake, gw):
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        r = http.post(
            "/v1/prefixes",
            json={
                "model": "fake",
                "ttl_seconds": 60,
                "messages": [{"role": "system", "content": SYSTEM}],
            },
        )
        assert r.status_code == 200, r.text
        pfx = r.json()
        assert pfx["object"] == "prefix" and pfx["id"].startswith("pfx-")
        assert pfx["prompt_tokens"] == 1 + len(SYSTEM)
        assert pfx["expires_at"] >= int(time.time()) + 59
        assert engine.pinned_blocks == (len(SYSTEM)) // 16  # rendered minus its last token
        assert http.get(f"/v1/prefixes/{pfx['id']}").json() == pfx

        user = [{"role": "user", "content": "hello"}]
        full = http.post(
            "/v1/chat/completions",
            json={
                "model": "fake",
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, *user],
            },
        ).json()
        ids_full = engine.requests_seen[-1][1]
        via = http.post(
            "/v1/chat/completions",
            json={
                "model": "fake",
                "max_tokens": 4,
                "temperature": 0,
                "prefix_id": pfx["id"],
                "messages": user,
            },
        ).json()
        assert engine.requests_seen[-1][1] == ids_full
        assert via["choices"][0]["message"] == full["choices"][0]["message"]
        assert via["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96

        d = http.delete(f"/v1/prefixes/{pfx['id']}")
        assert d.status_code == 200 and d.json()["deleted"] is True
        assert engine.pinned_blocks == 0
        assert http.get(f"/v1/prefixes/{pfx['id']}").status_code == 404
        assert http.delete(f"/v1/prefixes/{pfx['id']}").status_code == 404
        r = http.post(
            "/v1/chat/completions", json={"model": "fake", "prefix_id": pfx["id"], "messages": user}
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "prefix_not_found"


def test_prefix_expiry_and_pin_cap(serve_fake, gw):
    srv, engine = serve_fake(num_blocks=16, max_pinned_fraction=0.5)  # cap: 8 blocks
    body = {"model": "fake", "messages": [{"role": "system", "content": "z" * 100}]}
    with gw.client(srv) as http:
        short = http.post("/v1/prefixes", json={**body, "ttl_seconds": 0.2}).json()
        time.sleep(0.3)
        assert http.get(f"/v1/prefixes/{short['id']}").status_code == 404
        assert engine.pinned_blocks == 0  # expired → unpinned
        assert http.post("/v1/prefixes", json=body).status_code == 200  # 6 blocks
        r = http.post("/v1/prefixes", json=body)
        assert r.status_code == 429
        err = r.json()["error"]
        assert (
            err["code"] == "prefix_limit_exceeded"
            and "pinned prefix space is full" in err["message"]
        )
        assert "Retry-After" in r.headers
        # bad bodies
        assert http.post("/v1/prefixes", json={"model": "fake", "messages": []}).status_code == 400
        assert http.post("/v1/prefixes", json={**body, "ttl_seconds": -1}).status_code == 400
        assert http.post("/v1/prefixes", json={**body, "model": "x"}).status_code == 404
        assert (
            http.post(
                "/v1/prefixes",
                json={"model": "fake", "messages": [{"role": "system", "content": "q" * 300}]},
            ).status_code
            == 400
        )  # over max_model_len


def test_prefix_belongs_to_its_salt(serve_fake, gw):
    srv, _ = serve_fake(GatewaySettings(model_name="fake", api_keys=["a", "b"]))
    body = {"model": "fake", "messages": [{"role": "system", "content": SYSTEM}]}
    with (
        gw.client(srv, headers={"Authorization": "Bearer a"}) as a,
        gw.client(srv, headers={"Authorization": "Bearer b"}) as b,
    ):
        pfx = a.post("/v1/prefixes", json=body).json()
        assert a.get(f"/v1/prefixes/{pfx['id']}").status_code == 200
        assert b.get(f"/v1/prefixes/{pfx['id']}").status_code == 404
        assert b.delete(f"/v1/prefixes/{pfx['id']}").status_code == 404


def test_prefix_lives_as_long_as_its_engine_pin(serve_fake, gw):
    # The engine owns a pin's TTL: the registry keeps no clock of its own and forgets a prefix
    # as soon as the engine no longer holds its pin (expired, or revoked for a request).
    srv, engine = serve_fake()
    body = {"model": "fake", "ttl_seconds": 60, "messages": [{"role": "system", "content": SYSTEM}]}
    with gw.client(srv) as http:
        pfx = http.post("/v1/prefixes", json=body).json()
        (pin_id,) = list(engine._pins)
        assert abs(pfx["expires_at"] - (time.time() + 60)) <= 2
        engine.unpin_prefix(pin_id)  # the engine let go of it (as a revoke does)
        assert http.get(f"/v1/prefixes/{pfx['id']}").status_code == 404
        assert engine.pinned_blocks == 0


def test_a_revoked_prefix_says_it_was_revoked_to_its_owner_only(serve_fake, gw):
    # A pin the engine revoked for room was answered "not found (unknown or expired)" before
    # its TTL (a new user's probe): its owner is told it was revoked and to register it again.
    srv, engine = serve_fake(GatewaySettings(model_name="fake", api_keys=["a", "b"]))
    body = {"model": "fake", "ttl_seconds": 60, "messages": [{"role": "system", "content": SYSTEM}]}
    with (
        gw.client(srv, headers={"Authorization": "Bearer a"}) as a,
        gw.client(srv, headers={"Authorization": "Bearer b"}) as b,
    ):
        pfx = a.post("/v1/prefixes", json=body).json()
        (pin_id,) = list(engine._pins)
        engine.unpin_prefix(pin_id)  # the engine let go of it before its TTL (a revoke)
        chat = {"model": "fake", "prefix_id": pfx["id"], "max_tokens": 2}
        chat["messages"] = [{"role": "user", "content": "hi"}]
        for r in (
            a.get(f"/v1/prefixes/{pfx['id']}"),
            a.post("/v1/chat/completions", json=chat),
            a.delete(f"/v1/prefixes/{pfx['id']}"),
        ):
            err = assert_openai_error(r, 404, "prefix_revoked")
            assert "revoked" in err["message"] and "register it again" in err["message"]
        assert_openai_error(b.get(f"/v1/prefixes/{pfx['id']}"), 404, "prefix_not_found")
        assert_openai_error(a.get("/v1/prefixes/pfx-unknown"), 404, "prefix_not_found")
    assert engine.pinned_blocks == 0
