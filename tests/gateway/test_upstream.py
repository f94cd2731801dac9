"""Upstream mode against stub OpenAI servers on loopback: affinity, fallback, health, streams."""

from __future__ import annotations

import time

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import UpstreamRouter, affinity_key, normalize_url
from prefixgate.gateway.settings import GatewaySettings
from support.net import free_port
from support.stub_upstream import STUB, StubServer


def stub_app(name: str, chunk_delay_s: float = 0.0, status: int = 200) -> web.Application:
    """The stub upstream (``support.stub_upstream``) named ``name`` serving the model ``m``
    (and ``name``: its ``/v1/models`` lists both); a stream of it sends its
    role chunk at once, then 4 content chunks, the first ``2 * chunk_delay_s`` later and each
    next one ``chunk_delay_s`` apart, and ``[DONE]``."""
    stub = StubServer(
        name=name,
        models=(name, "m"),
        status=status,
        ttft_s=2 * chunk_delay_s,
        token_delay_s=chunk_delay_s,
    )
    return stub.app()


def _chat(system: str, user: str, **kw) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **kw,
    }


def test_prefix_affinity_same_system_prompt_same_upstream(servers):
    ups = [servers(lambda n=n: stub_app(f"u{n}")) for n in range(3)]
    gw = servers(lambda: create_proxy_app([u.url for u in ups], GatewaySettings()))
    owner: dict[int, set[str]] = {}
    with httpx.Client(base_url=gw.url) as http:
        for s in range(24):
            system = f"You are assistant number {s}. " * 4
            for u in range(3):
                r = http.post("/v1/chat/completions", json=_chat(system, f"question {u}"))
                assert r.status_code == 200
                owner.setdefault(s, set()).add(r.json()["upstream"])
    assert all(len(v) == 1 for v in owner.values()), owner
    assert len({next(iter(v)) for v in owner.values()}) == 3  # keys spread over the pool


def test_affinity_key_leading_blocks():
    body = _chat("S" * 200, "hello")
    assert affinity_key(body, 64, 4096) == b"S" * 192  # whole 64-char blocks
    assert affinity_key(body, 64, 128) == b"S" * 128
    assert affinity_key(_chat("short", "x"), 64, 4096) == b"short"
    assert (
        affinity_key({"messages": [{"role": "user", "content": "U" * 70}]}, 64, 4096) == b"U" * 64
    )
    assert affinity_key({"prompt": "P" * 10}) == b"P" * 10
    assert affinity_key({"prompt": [1, 2, 3]}) == b"1,2,3"
    assert affinity_key({"model": "m"}) is None
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(ValueError):
        normalize_url("h:1")


def test_imbalance_falls_back_to_least_loaded():
    router = UpstreamRouter(["http://a:1", "http://b:1"])  # SGLang's 64 / 1.5
    key = b"system prompt"
    target = router.pick(key)
    other = next(u for u in router.upstreams if u is not target)
    target.in_flight = 60
    assert router.pick(key) is target  # 60 - 0 <= 64: keep affinity
    target.in_flight, other.in_flight = 100, 30
    assert router.pick(key) is other  # 70 > 64 and 100 > 1.5 * 30
    target.in_flight, other.in_flight = 100, 70
    assert router.pick(key) is target  # 100 <= 1.5 * 70
    assert router.pick(None) is other  # no key: least loaded
    target.healthy = False
    other.in_flight = 0
    assert router.pick(key) is other
    other.healthy = False
    assert router.pick(key) is None
    with pytest.raises(ValueError):
        UpstreamRouter([])


def test_unhealthy_upstream_skipped_then_probed_back(servers):
    live = servers(lambda: stub_app("live"))
    dead_port = free_port()
    dead_url = f"http://127.0.0.1:{dead_port}"
    # rendezvous: keys hash back onto the returned upstream (cache_aware keeps them where
    # their prompts are cached)
    settings = GatewaySettings(health_interval_s=0.1, routing="rendezvous")
    gw = servers(lambda: create_proxy_app([live.url, dead_url], settings))
    router = gw.app[PROXY].router
    dead = next(u for u in router.upstreams if u.url == dead_url)
    assert not dead.healthy and dead.failures == 1  # the probe at start found it down
    with httpx.Client(base_url=gw.url) as http:
        for s in range(12):  # keys that hash to the dead one go to the live one
            r = http.post("/v1/chat/completions", json=_chat(f"sys {s} " * 20, "q"))
            assert r.status_code == 200 and r.json()["upstream"] == "live"
        assert dead.failures == 1  # no request was sent to it
        assert http.get("/ready").status_code == 200
        servers(lambda: stub_app("back"), port=dead_port)
        deadline = time.monotonic() + 5
        while not dead.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dead.healthy
        metrics = http.get("/metrics").text
        assert f'prefixgate_upstream_healthy{{upstream="{dead_url}"}} 1.0' in metrics
        assert f'status="failed",upstream="{dead_url}"' not in metrics
        names = {
            http.post("/v1/chat/completions", json=_chat(f"sys {s} " * 20, "q")).json()["upstream"]
            for s in range(12)
        }
        assert names == {"live", "back"}


def test_all_upstreams_down_and_errors_passed_through(servers):
    gw = servers(lambda: create_proxy_app([f"http://127.0.0.1:{free_port()}"], GatewaySettings()))
    with httpx.Client(base_url=gw.url) as http:
        # probed at start: no healthy upstream from the first request on (was a 502 first)
        r = http.post("/v1/chat/completions", json=_chat("s", "q"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
        assert "Retry-After" in r.headers
        assert http.get("/ready").status_code == 503
    bad = servers(lambda: stub_app("bad", status=400))
    gw2 = servers(lambda: create_proxy_app([bad.url], GatewaySettings()))
    with httpx.Client(base_url=gw2.url) as http:
        r = http.post("/v1/chat/completions", json=_chat("s", "q"))
        assert r.status_code == 400 and r.json()["error"]["message"] == "nope"  # not retried
        assert http.post("/v1/chat/completions", content=b"{x").status_code == 400
        r = http.post("/v1/chat/completions", json={**_chat("s", "q"), "prefix_id": "p"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "prefix_not_found"
        r = http.post("/v1/prefixes", json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_streams_pass_through_chunk_by_chunk(servers):
    up = servers(lambda: stub_app("s", chunk_delay_s=0.15))
    gw = servers(
        lambda: create_proxy_app([up.url], GatewaySettings(api_keys=["gk"], upstream_api_key="uk"))
    )
    t0 = time.monotonic()
    arrivals = []
    data = b""
    with (
        httpx.Client(base_url=gw.url, headers={"Authorization": "Bearer gk"}) as http,
        http.stream("POST", "/v1/chat/completions", json=_chat("s", "q", stream=True)) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            arrivals.append(time.monotonic() - t0)
            data += chunk
    events = [e for e in data.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 6
    assert arrivals[0] < 0.5 and arrivals[-1] > 0.6  # the first chunk long before the end
    assert up.app[STUB].records[-1]["auth"] == "Bearer uk"  # the upstream key, not the client's
    with httpx.Client(base_url=gw.url) as http:
        assert http.post("/v1/chat/completions", json=_chat("s", "q")).status_code == 401
        models = http.get("/v1/models", headers={"Authorization": "Bearer gk"}).json()
        assert models["data"][0]["id"] == "s"


def test_client_disconnect_closes_upstream_stream(servers):
    up = servers(lambda: stub_app("s", chunk_delay_s=0.2))
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings()))
    with (
        httpx.Client(base_url=gw.url) as http,
        http.stream("POST", "/v1/chat/completions", json=_chat("s", "q", stream=True)) as r,
    ):
        next(r.iter_raw())  # first chunk, then leave
    deadline = time.monotonic() + 3
    while up.app[STUB].records[-1].get("outcome") != "cut" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.2)  # longer than the rest of the stream would take
    assert up.app[STUB].records[-1]["outcome"] == "cut"
    assert gw.app[PROXY].router.upstreams[0].in_flight == 0
    assert gw.app[PROXY].router.upstreams[0].healthy  # a client leaving is not an upstream fault


def test_a_non_bearer_authorization_scheme_is_named(servers):
    up = servers(lambda: stub_app("a"))
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings(api_keys=["gk"])))
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json=_chat("s", "q"),
        headers={"Authorization": "Basic Z2s="},
    )
    assert r.status_code == 401 and "'Basic' is not supported" in r.json()["error"]["message"]
    r = httpx.post(gw.url + "/v1/chat/completions", json=_chat("s", "q"))
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("missing API key")


@pytest.mark.parametrize(
    "header", ["Bearer\tsk-one-secret-value", "sk-one-secret-value", "Token:sk-one-secret-value"]
)
def test_a_refused_authorization_header_never_echoes_the_key(servers, header):
    """The scheme was the text before the first space, echoed up to 20 characters: a key sent
    without a scheme, or glued to one by a tab, came back in the 401 ('Bearer\\tsk-one-secret')."""
    up = servers(lambda: stub_app("a"))
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings(api_keys=["gk"])))
    r = httpx.post(
        gw.url + "/v1/chat/completions", json=_chat("s", "q"), headers={"Authorization": header}
    )
    assert r.status_code == 401, r.text
    assert "sk-one" not in r.text and "secret" not in r.text, r.text
