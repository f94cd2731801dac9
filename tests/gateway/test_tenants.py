"""Tenant isolation and accounting, local and proxy mode, on the fake engine.

Proxy mode runs a gateway with ``--upstream`` in front of a real prefixgate gateway (the fake
engine behind it) on loopback; the real-model versions are in
``tests/integration/test_tenants_aidreams.py``.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import split_credentials
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.keys import KeySpec, effective_salt
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
    # a key salt vLLM would refuse as a cache_salt ("/") is hashed too (keys.effective_salt)
    assert salts[0] == salts[1] != salts[2] == effective_salt("acme/prod", None) != "acme/prod"


# --- 6. upstream credentials ------------------------------------------------------------------

SEEN_AUTH = web.AppKey("seen_auth", list)
SEEN_BODY = web.AppKey("seen_body", list)


def _auth_echo_app(owned_by: str = "x") -> web.Application:
    """An upstream that records the Authorization header and body it got and answers 200;
    its /v1/models says ``owned_by``."""
    seen: list = []
    bodies: list = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        bodies.append(await request.json())
        # a valid chat.completion (the proxy checks the shape of what it relays)
        body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m"}
        return web.json_response({**body, "choices": [], "usage": None})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": owned_by}]})

    app = web.Application()
    app[SEEN_AUTH] = seen
    app[SEEN_BODY] = bodies
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


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
            shown += caplog.text + json.dumps(proxy.app[PROXY].router.describe())
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


# --- 1. salts reach the upstream ----------------------------------------------------------------


def _post(c: httpx.Client, key: str | None, body: dict, path: str = "/v1/chat/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return c.post(path, json=body, headers=headers)


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_proxy_forwards_salt_and_isolates_tenants(serve_fake, gw, tmp_path):
    """The issue's example on the fake engine: A's prompt twice, then B's — B gets 0."""
    upstream, engine = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    specs = [{"key": "ka", "salt": "a"}, {"key": "kb", "salt": "b"}]
    keys = _keys(tmp_path, [*specs, {"key": "kops", "role": "operator"}])
    settings = GatewaySettings(keys_file=keys)
    with (
        BackgroundServer(lambda: create_proxy_app([upstream.url], settings)) as proxy,
        gw.client(proxy) as c,
    ):
        # the upstreams' details need an operator's key on a keyed gateway
        ready = c.get("/ready", headers={"Authorization": "Bearer kops"}).json()
        assert ready["tenant_isolation"] is True and ready["upstreams"][0]["cache_salt"] is True
        body = gw.chat_body("p" * 80, max_tokens=1)
        assert _cached(_post(c, "ka", body)) == 0
        assert _cached(_post(c, "ka", body)) == 80  # A's own repeat hits its cache
        assert _cached(_post(c, "kb", body)) == 0  # was 80 before: the cache crossed tenants
        assert _cached(_post(c, "kb", {**body, "cache_salt": "x"})) == 0
        assert _cached(_post(c, "kb", {**body, "cache_salt": "x"})) == 80
    salts = [seen[3] for seen in engine.requests_seen]
    assert salts[0] == salts[1] and len({salts[0], salts[2], salts[3]}) == 3 and None not in salts


def test_proxy_affinity_key_includes_salt():
    from prefixgate.gateway.proxy.upstream import salted_affinity_key

    assert salted_affinity_key(b"sys", None) == b"sys"
    assert salted_affinity_key(b"sys", "a") != salted_affinity_key(b"sys", "b")
    assert salted_affinity_key(None, "a") is None
    assert salted_affinity_key(b"s", "\ud800")  # lone surrogates hash too (no 500)


@pytest.mark.parametrize(
    "owned_by, mode, isolated",
    [
        ("vllm", "auto", True),
        ("someone", "auto", False),
        ("someone", "on", True),
        ("vllm", "off", False),
    ],
)
def test_upstream_without_cache_salt_is_declared(caplog, tmp_path, owned_by, mode, isolated):
    up = BackgroundServer(lambda: _auth_echo_app(owned_by)).__enter__()
    keys = _keys(tmp_path, [{"key": "ka", "salt": "a"}, {"key": "kops", "role": "operator"}])
    settings = GatewaySettings(keys_file=keys, upstream_cache_salt=mode)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="prefixgate"),
            BackgroundServer(lambda: create_proxy_app([up.url], settings)) as proxy,
            httpx.Client(base_url=proxy.url, timeout=30) as c,
        ):
            # the upstreams' details need an operator's key on a keyed gateway
            ready = c.get("/ready", headers={"Authorization": "Bearer kops"}).json()
            assert ready["tenant_isolation"] is isolated
            assert ready["upstreams"][0]["cache_salt"] is isolated
            r = _post(c, "ka", {"model": "m", "messages": [{"role": "user", "content": "q"}]})
            assert r.status_code == 200
        sent = up.app[SEEN_BODY][-1]
        assert ("cache_salt" in sent) is isolated
        assert ("does not take cache_salt" in caplog.text) is (not isolated)
    finally:
        up.close()


# --- 5. exact accounting ------------------------------------------------------------------------


def _principal(app, key: str):
    from prefixgate.gateway.tenancy.keys import _digest

    return app[STATE].keys._by_digest[_digest(key)]  # noqa: SLF001 - the key's live counters


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_charges_prompt_plus_completion(serve_fake, gw, tmp_path, stream):
    """Proxy mode never charged completion tokens (a 300 tokens/min key streamed 714 tokens
    before its first 429, non-streaming never got one): it charges the upstream's usage."""
    upstream, engine = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    keys = _keys(tmp_path, [{"key": "ka", "tokens_per_minute": 300}])
    settings = GatewaySettings(keys_file=keys)
    with (
        BackgroundServer(lambda: create_proxy_app([upstream.url], settings)) as proxy,
        gw.client(proxy) as c,
    ):
        served = 0
        for i in range(20):
            body = gw.chat_body(f"question {i:02d}", max_tokens=40, stream=stream)
            r = _post(c, "ka", body)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
                break
            assert r.status_code == 200, r.text
            if stream:
                events = [e for e in r.text.split("\n\n") if e.startswith("data: {")]
                assert all(json.loads(e[6:])["choices"] for e in events)  # no usage chunk
            _, ids, params, _ = engine.requests_seen[-1]
            served += len(ids) + params.max_tokens
        else:
            pytest.fail("never refused")
        assert 300 <= served <= 300 + 60  # the last request admitted may overdraw once
        # One streamed request that asks for usage: its usage chunk is passed on.
        p = _principal(proxy.app, "ka")
        p._tpm.level = 300  # noqa: SLF001 - refill at once
        body = gw.chat_body("q", max_tokens=5, stream=True, stream_options={"include_usage": True})
        text = _post(c, "ka", body).text
        usage = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")][-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
        _settled(p)
        assert p._tpm.level == pytest.approx(300 - usage["usage"]["total_tokens"], abs=3)


def _settled(principal, timeout: float = 5.0) -> None:
    """Wait until the key's requests have ended on the server (a stream's last bytes reach
    the client just before its handler settles the charge)."""
    import time

    deadline = time.monotonic() + timeout
    while principal.concurrent and time.monotonic() < deadline:
        time.sleep(0.01)


def _failing_generate(engine):
    async def generate(request):
        raise ValueError("this prompt can never fit the KV cache")
        yield  # pragma: no cover - an async generator that fails on its first step

    engine.generate = generate


def test_refused_requests_spend_nothing_local(serve_fake, gw, tmp_path):
    keys = _keys(tmp_path, [{"key": "ka", "requests_per_minute": 2, "tokens_per_minute": 100}])
    srv, engine = serve_fake(GatewaySettings(model_name="fake", keys_file=keys))
    good = engine.generate
    with gw.client(srv) as c:
        _failing_generate(engine)
        for _ in range(4):  # the engine refuses before the first token: 400, nothing spent
            r = _post(c, "ka", gw.chat_body("x" * 60, max_tokens=3))
            assert r.status_code == 400, r.text
        engine.generate = good
        p = _principal(srv.app, "ka")
        assert p._rpm.level == pytest.approx(2, abs=0.01) and p.concurrent == 0
        assert p._tpm.level == pytest.approx(100, abs=0.5)
        for _ in range(2):
            assert _post(c, "ka", gw.chat_body("x", max_tokens=3)).status_code == 200
        r = _post(c, "ka", gw.chat_body("x", max_tokens=3))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        # served: prompt ("<s>" + "x" = 2 tokens) + 3 completion tokens, twice
        assert p._tpm.level == pytest.approx(100 - 2 * 5, abs=0.5)


def test_admission_refusal_spends_nothing_local(serve_fake, gw, tmp_path):
    keys = _keys(tmp_path, [{"key": "ka", "requests_per_minute": 3}, {"key": "kb"}])
    settings = GatewaySettings(model_name="fake", keys_file=keys, max_running=1)
    srv, engine = serve_fake(settings, token_delay_s=0.05)
    with gw.client(srv) as c, gw.client(srv) as c2:
        with c2.stream(
            "POST",
            "/v1/chat/completions",
            json=gw.chat_body("slow", max_tokens=20, stream=True),
            headers={"Authorization": "Bearer kb"},
        ) as held:
            chunks = held.iter_bytes()  # kept: dropping the iterator closes the stream
            next(chunks)  # kb's request holds the only running place
            for _ in range(5):
                r = _post(c, "ka", gw.chat_body("x", max_tokens=1))
                assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
        p = _principal(srv.app, "ka")
        assert p._rpm.level == pytest.approx(3, abs=0.01) and p.concurrent == 0


def test_refused_requests_spend_nothing_proxy(serve_fake, gw, tmp_path):
    upstream, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    keys = _keys(tmp_path, [{"key": "ka", "requests_per_minute": 2, "tokens_per_minute": 500}])
    settings = GatewaySettings(keys_file=keys)
    dead = f"http://127.0.0.1:{_free_port()}"
    with (
        BackgroundServer(lambda: create_proxy_app([upstream.url], settings)) as proxy,
        BackgroundServer(lambda: create_proxy_app([dead], settings)) as broken,
        gw.client(proxy) as c,
        gw.client(broken) as cb,
    ):
        for _ in range(3):  # the upstream refuses (400): nothing spent
            r = _post(c, "ka", gw.chat_body("x", max_tokens=-1))
            assert r.status_code == 400, r.text
        for _ in range(3):  # the upstream fails before any token (502/503): nothing spent
            assert _post(cb, "ka", gw.chat_body("x", max_tokens=1)).status_code in (502, 503)
        for app in (proxy.app, broken.app):
            p = _principal(app, "ka")
            assert p._rpm.level == pytest.approx(2, abs=0.01) and p.concurrent == 0
            assert p._tpm.level == pytest.approx(500, abs=0.5)
        for _ in range(2):
            assert _post(c, "ka", gw.chat_body("x", max_tokens=1)).status_code == 200
        assert _post(c, "ka", gw.chat_body("x", max_tokens=1)).status_code == 429


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 3. per-key share of the prefix API ---------------------------------------------------------


def _prefix(c: httpx.Client, key: str, text: str) -> httpx.Response:
    body = {"model": "fake", "ttl_seconds": 600, "messages": [{"role": "system", "content": text}]}
    return _post(c, key, body, "/v1/prefixes")


def test_one_key_cannot_take_the_pinned_space(serve_fake, gw, tmp_path):
    """The issue: one key pinned half the KV blocks, every other tenant got 429 for 591 s.
    Default share: 1/8 of the KV blocks (8 of the fake's 64) per key."""
    keys = _keys(
        tmp_path,
        [
            {"key": "ka"},
            {"key": "kb"},
            {"key": "kc", "max_prefixes": 1},
            {"key": "kd", "max_pinned_blocks": 2},
        ],
    )
    srv, engine = serve_fake(GatewaySettings(model_name="fake", keys_file=keys))
    with gw.client(srv) as c:
        made = 0
        for i in range(40):  # 3 blocks each (49 tokens rendered, 48 pinned)
            r = _prefix(c, "ka", f"{i:03d}" + "s" * 45)
            if r.status_code != 200:
                break
            made += 1
        assert made == 2, made  # 6 blocks held; 3 more would pass 8
        assert r.status_code == 429 and r.json()["error"]["code"] == "prefix_limit_exceeded"
        assert 500 < int(r.headers["Retry-After"]) <= 600  # its own next expiry
        assert engine.pinned_blocks == 6
        for i in range(2):  # another tenant still gets its share
            assert _prefix(c, "kb", f"{i:03d}" + "t" * 45).status_code == 200
        r = _prefix(c, "kd", "u" * 48)  # 3 blocks alone: over kd's whole share
        assert r.status_code == 400 and r.json()["error"]["code"] == "prefix_too_large"
        assert _prefix(c, "kc", "v" * 20).status_code == 200
        r = _prefix(c, "kc", "w" * 20)  # max_prefixes from the keys file
        assert r.status_code == 429 and "max_prefixes=1" in r.json()["error"]["message"]


# --- 7. client bytes never give a 5xx (examples; the fuzz is test_fuzz_http) ---------------------


@pytest.fixture
def both_modes(serve_fake, tmp_path):
    """``[(mode, url, app)]``: the fake engine served directly, and through a proxy."""
    keys = _keys(tmp_path, [{"key": "ka", "requests_per_minute": 1}, {"key": "kb"}])
    local, _ = serve_fake(
        GatewaySettings(model_name="fake", keys_file=keys, max_body_bytes=4096),
        token_delay_s=0.0,
    )
    upstream, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    proxy = BackgroundServer(
        lambda: create_proxy_app(
            [upstream.url], GatewaySettings(keys_file=keys, max_body_bytes=4096)
        )
    ).__enter__()
    yield [("local", local.url, local.app), ("proxy", proxy.url, proxy.app)]
    proxy.close()


def test_lone_surrogate_and_odd_headers_are_4xx(both_modes):
    """The issue's example: a lone surrogate in a message, proxy mode → 500
    (UnicodeEncodeError in the affinity key)."""
    body = b'{"model": "fake", "messages": [{"role": "system", "content": "\\ud800 sys"}]}'
    for mode, url, _ in both_modes:
        with httpx.Client(base_url=url, timeout=30) as c:
            auth = {"Authorization": "Bearer kb", "Content-Type": "application/json"}
            r = c.post("/v1/chat/completions", content=body, headers=auth)
            assert r.status_code == 400, (mode, r.text)
            r = c.post("/v1/chat/completions", content=b"[" * 100_000, headers=auth)
            assert r.status_code in (400, 413), (mode, r.text)
            r = c.post("/v1/chat/completions", json={}, headers={**auth, "Expect": b"\xff"})
            assert r.status_code == 417 and r.json()["error"]["code"] == "expectation_failed"
            r = c.put("/v1/chat/completions", json={}, headers={"Expect": "x"})
            assert r.status_code == 417, (mode, r.text)
            r = c.put("/v1/chat/completions", json={})
            assert r.status_code == 405 and "POST" in r.headers["Allow"], (mode, r.text)
            r = c.get("/nowhere/%ff")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = c.post("/v1/prefixes", json={}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", (mode, r.text)


# --- 8. /metrics counts refusals by status and error code ----------------------------------------


def test_metrics_count_requests_by_status_and_code(both_modes):
    for mode, url, _ in both_modes:
        with httpx.Client(base_url=url, timeout=30) as c:
            ok = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            assert c.post("/v1/chat/completions", json=ok).status_code == 401
            ka = {"Authorization": "Bearer ka"}
            assert c.post("/v1/chat/completions", json=ok, headers=ka).status_code == 200
            assert c.post("/v1/chat/completions", json=ok, headers=ka).status_code == 429
            kb = {"Authorization": "Bearer kb"}
            assert c.post("/v1/completions", content=b"{", headers=kb).status_code == 400
            big = {**ok, "messages": [{"role": "user", "content": "x" * 5000}]}
            assert c.post("/v1/chat/completions", json=big, headers=kb).status_code == 413
            text = c.get("/metrics").text

        def count(route: str, status: int, code: str, text: str = text) -> float:
            label = f'prefixgate_requests_total{{code="{code}",route="{route}",status="{status}"}}'
            lines = [ln for ln in text.splitlines() if ln.startswith(label)]
            return float(lines[0].split()[-1]) if lines else 0.0

        assert count("chat", 401, "invalid_api_key") == 1, (mode, text)
        assert count("chat", 200, "") == 1, mode
        assert count("chat", 429, "rate_limit_exceeded") == 1, mode
        assert count("completions", 400, "invalid_json") == 1, mode
        assert count("chat", 413, "request_too_large") == 1, mode
        # /v1/responses, /v1/embeddings and /detokenize were counted as "other", with unknown
        # paths: each API route has its own label
        with httpx.Client(base_url=url, timeout=30, headers=kb) as c:
            for path in ("/v1/responses", "/v1/embeddings", "/detokenize", "/nowhere"):
                c.post(path, content=b"{")
            text = c.get("/metrics").text
        for route in ("responses", "embeddings", "detokenize"):
            counted = [
                ln
                for ln in text.splitlines()
                if ln.startswith("prefixgate_requests_total") and f'route="{route}"' in ln
            ]
            assert counted and sum(float(ln.split()[-1]) for ln in counted) == 1, (mode, route)
        other = [
            ln
            for ln in text.splitlines()
            if ln.startswith("prefixgate_requests_total") and 'route="other"' in ln
        ]
        assert sum(float(ln.split()[-1]) for ln in other) == 1, (mode, other)
