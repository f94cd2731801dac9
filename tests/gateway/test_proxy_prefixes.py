"""The prefix API in upstream mode (``gateway.proxy_prefixes``): registered on prefixgate
upstreams (in-process gateways over the fake engine) through their own prefix API, kept as
text for other upstreams (the stub), per-key limits and salts, re-registration when the
holding upstream dies or loses the pin, no pin left behind after DELETE or the TTL, and the
registry shared by two replicas on one Redis. Chats go through the official ``openai``
client with ``extra_body={"prefix_id": ...}``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import FakeEngine, FakeTokenizer
from support.http import assert_openai_error
from support.stub_upstream import StubServer

SYSTEM = "You are a terse assistant who answers in one word. " * 2  # 104 chars
PREFIX = [{"role": "system", "content": SYSTEM}]


class Pool:
    """Fake-engine prefixgate upstreams and proxy gateways started by one test (on the
    ``servers`` fixture, which closes them)."""

    def __init__(self, servers: Callable[..., BackgroundServer]) -> None:
        self.servers = servers
        self.engines: dict[str, FakeEngine] = {}

    def upstream(self) -> BackgroundServer:
        holder: dict = {}

        def make():
            holder["engine"] = FakeEngine()
            return create_app(holder["engine"], GatewaySettings(model_name="fake"))

        srv = self.servers(make)
        self.engines[srv.url] = holder["engine"]
        return srv

    def proxy(self, urls: list[str], **settings) -> BackgroundServer:
        s = GatewaySettings(**settings)
        return self.servers(lambda: create_proxy_app(urls, s))

    def pinned(self, url: str) -> int:
        return self.engines[url].pinned_blocks

    def holders(self) -> list[str]:
        return [u for u, e in self.engines.items() if e.pinned_blocks]


@pytest.fixture
def pool(servers) -> Pool:
    return Pool(servers)


def _keys(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps(
            {
                "keys": [
                    {"key": "k1", "name": "a", "salt": "sa", "max_prefixes": 2},
                    {"key": "k2", "name": "b", "salt": "sb"},
                    {"key": "kops", "name": "ops", "role": "operator"},
                ]
            }
        )
    )
    return str(path)


def _create(http: httpx.Client, key: str | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    body = {"model": "fake", "messages": PREFIX, "ttl_seconds": 60, **kw}
    return http.post("/v1/prefixes", json=body, headers=headers)


def _chat(url: str, prefix_id: str, user: str = "hello", key: str = "none"):
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": user}],
        max_tokens=4,
        temperature=0,
        extra_body={"prefix_id": prefix_id},
    )


def test_prefixgate_upstream_pins_serves_and_releases(pool, tmp_path):
    ups = [pool.upstream() for _ in range(2)]
    gw = pool.proxy([u.url for u in ups], keys_file=_keys(tmp_path))
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        # the upstreams' details need an operator's key on a keyed gateway
        ready = http.get("/ready", headers={"Authorization": "Bearer kops"}).json()
        assert [u["prefix_api"] for u in ready["upstreams"]] == [True, True]
        r = _create(http, "k1")
        assert r.status_code == 200, r.text
        pfx = r.json()
        assert pfx["object"] == "prefix" and pfx["id"].startswith("pfx-")
        assert pfx["prompt_tokens"] == 1 + len(SYSTEM)
        assert pfx["expires_at"] >= int(time.time()) + 58
        assert (
            http.get(f"/v1/prefixes/{pfx['id']}", headers={"Authorization": "Bearer k1"}).json()
            == pfx
        )
        (holder,) = pool.holders()  # pinned on exactly one upstream
        assert pool.pinned(holder) == len(SYSTEM) // 16

        out = _chat(gw.url, pfx["id"], key="k1")
        assert out.choices[0].finish_reason in ("stop", "length")
        assert out.usage.prompt_tokens_details.cached_tokens >= 96  # the upstream's pin
        seen = pool.engines[holder].requests_seen[-1]
        full = [*PREFIX, {"role": "user", "content": "hello"}]
        assert seen[1] == FakeTokenizer().encode_chat(full)  # exactly the full conversation

        # Another key (salt) sees nothing of it.
        other = {"Authorization": "Bearer k2"}
        assert_openai_error(
            http.get(f"/v1/prefixes/{pfx['id']}", headers=other), 404, "prefix_not_found"
        )
        assert_openai_error(
            http.delete(f"/v1/prefixes/{pfx['id']}", headers=other), 404, "prefix_not_found"
        )
        with pytest.raises(openai.NotFoundError) as err:
            _chat(gw.url, pfx["id"], key="k2")
        assert err.value.code == "prefix_not_found"

        # k1's max_prefixes = 2.
        second = _create(http, "k1", messages=[{"role": "system", "content": "S2 " * 40}])
        assert second.status_code == 200, second.text
        r = _create(http, "k1")
        assert_openai_error(r, 429, "prefix_limit_exceeded")
        assert float(r.headers["Retry-After"]) >= 1
        assert _create(http, "k2").status_code == 200  # another key's share

        # DELETE releases the upstream's pin.
        auth = {"Authorization": "Bearer k1"}
        before = sum(pool.pinned(u.url) for u in ups)
        d = http.delete(f"/v1/prefixes/{pfx['id']}", headers=auth)
        assert d.json() == {"id": pfx["id"], "object": "prefix.deleted", "deleted": True}
        assert sum(pool.pinned(u.url) for u in ups) == before - len(SYSTEM) // 16
        assert_openai_error(http.get(f"/v1/prefixes/{pfx['id']}", headers=auth), 404)
        with pytest.raises(openai.NotFoundError):
            _chat(gw.url, pfx["id"], key="k1")
        assert _create(http, "k1").status_code == 200  # its share is free again

        # The TTL: gone from the gateway and from the upstream.
        short = _create(
            http, "k2", ttl_seconds=1, messages=[{"role": "system", "content": "T" * 70}]
        )
        assert short.status_code == 200
        pinned_with_short = sum(pool.pinned(u.url) for u in ups)
        time.sleep(1.3)
        assert_openai_error(
            http.get(f"/v1/prefixes/{short.json()['id']}", headers=other), 404, "prefix_not_found"
        )
        assert sum(pool.pinned(u.url) for u in ups) == pinned_with_short - 70 // 16
        # Bad bodies: 400 naming the field, as in local mode.
        assert_openai_error(_create(http, "k1", ttl_seconds=-1), 400, param="ttl_seconds")
        assert_openai_error(_create(http, "k1", messages=[]), 400, param="messages")
        assert_openai_error(_create(http, "k2", model="nope"), 404, "model_not_found")
    gw.close()  # shutdown releases the pins it registered (no shared state); idempotent
    assert sum(pool.pinned(u.url) for u in ups) == 0


def test_dead_upstream_or_lost_pin_registers_again(pool):
    ups = [pool.upstream() for _ in range(2)]
    gw = pool.proxy([u.url for u in ups], health_interval_s=60)
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        pfx = _create(http).json()
        (holder,) = pool.holders()
        dead = next(u for u in ups if u.url == holder)
        dead.close()
        out = _chat(gw.url, pfx["id"])  # registered again on the other from the kept text
        (survivor,) = [u for u in ups if u is not dead]
        assert pool.pinned(survivor.url) == len(SYSTEM) // 16
        assert out.usage.prompt_tokens_details.cached_tokens >= 96

        # The upstream loses the pin (revoked, or restarted): registered there again.
        engine = pool.engines[survivor.url]

        async def unpin_all():
            for pin_id in list(engine._pins):
                engine.unpin_prefix(pin_id)

        survivor.call(unpin_all)
        assert pool.pinned(survivor.url) == 0
        out = _chat(gw.url, pfx["id"], user="again")
        assert pool.pinned(survivor.url) == len(SYSTEM) // 16
        assert out.usage.prompt_tokens_details.cached_tokens >= 96

        # No upstream left: an explicit error, never a silent answer.
        survivor.close()
        with pytest.raises(openai.APIStatusError) as err:
            _chat(gw.url, pfx["id"])
        assert err.value.status_code in (502, 503)
        assert err.value.code == "upstream_unavailable"


def test_other_upstreams_get_the_text_in_full_with_affinity(pool):
    # each serves the prefix's model (s1) and the chats' (fake)
    stubs = [StubServer(name=f"s{i}", models=("s1", "fake", "m")).start() for i in range(3)]
    try:
        gw = pool.proxy([s.base_url for s in stubs])
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert [u["prefix_api"] for u in http.get("/ready").json()["upstreams"]] == [False] * 3
            long_system = "You answer questions about the sea, briefly and kindly. " * 6
            r = _create(http, model="s1", messages=[{"role": "system", "content": long_system}])
            pfx = r.json()
            assert pfx["prompt_tokens"] == len(long_system)  # the stub's /tokenize count
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
            names = set()
            for i in range(6):
                raw = client.chat.completions.with_raw_response.create(
                    model="fake",
                    messages=[{"role": "user", "content": f"q{i}"}],
                    extra_body={"prefix_id": pfx["id"]},
                )
                names.add(json.loads(raw.text)["upstream"])
            assert len(names) == 1  # affinity: one upstream holds that text
            (stub,) = [s for s in stubs if s.name in names]
            for body in stub.seen:
                assert "prefix_id" not in body
                assert body["messages"][0] == {"role": "system", "content": long_system}
                assert body["messages"][1]["role"] == "user"
            assert http.delete(f"/v1/prefixes/{pfx['id']}").status_code == 200
            with pytest.raises(openai.NotFoundError):
                _chat(gw.url, pfx["id"])
            # prefix_id is a chat field; not a completions one.
            r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "prefix_id": "p"})
            assert_openai_error(r, 400, param="prefix_id")
    finally:
        for s in stubs:
            s.stop()


def test_replicas_share_the_proxy_prefix_registry(pool, redis_server):
    up = pool.upstream()
    a = pool.proxy([up.url], redis_url=redis_server.url)
    b = pool.proxy([up.url], redis_url=redis_server.url)
    with httpx.Client(timeout=30) as http:
        pfx = _create(httpx.Client(base_url=a.url, timeout=30)).json()
        assert pool.pinned(up.url) == len(SYSTEM) // 16
        assert http.get(f"{b.url}/v1/prefixes/{pfx['id']}").json() == pfx
        out = _chat(b.url, pfx["id"])  # created on A, served through B on the same pin
        assert out.usage.prompt_tokens_details.cached_tokens >= 96
        assert pool.pinned(up.url) == len(SYSTEM) // 16  # no second pin
        assert http.delete(f"{b.url}/v1/prefixes/{pfx['id']}").status_code == 200
        assert_openai_error(http.get(f"{a.url}/v1/prefixes/{pfx['id']}"), 404, "prefix_not_found")
        assert pool.pinned(up.url) == 0


def test_replicas_share_one_max_prefixes_per_key(pool, redis_server, tmp_path):
    """k1's max_prefixes (2) holds across both replicas; a prefix deleted on one replica
    frees its place on the other at once."""
    up = pool.upstream()
    a = pool.proxy([up.url], redis_url=redis_server.url, keys_file=_keys(tmp_path))
    b = pool.proxy([up.url], redis_url=redis_server.url, keys_file=_keys(tmp_path))
    with (
        httpx.Client(base_url=a.url, timeout=30) as ha,
        httpx.Client(base_url=b.url, timeout=30) as hb,
    ):
        first = _create(ha, "k1").json()["id"]
        assert _create(hb, "k1").status_code == 200
        for http in (ha, hb):
            r = _create(http, "k1")
            assert_openai_error(r, 429, "prefix_limit_exceeded")
            assert float(r.headers["Retry-After"]) >= 1
        assert _create(hb, "k2").status_code == 200  # another key's count is its own
        auth = {"Authorization": "Bearer k1"}
        assert hb.delete(f"/v1/prefixes/{first}", headers=auth).status_code == 200
        assert _create(ha, "k1").status_code == 200  # replica A sees the freed place
        assert_openai_error(_create(hb, "k1"), 429, "prefix_limit_exceeded")
