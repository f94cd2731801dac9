"""Bad input and overload: the documented status and OpenAI error object, nothing disturbed."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from prefixgate.gateway.app import attach_engine, create_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error as _error


def test_bad_input_gives_400_404_413(serve_fake, gw):
    srv, engine = serve_fake(GatewaySettings(model_name="fake", max_body_bytes=4096))
    with gw.client(srv) as http:

        def post(body, **kw):
            data = {"content": body} if isinstance(body, bytes) else {"json": body}
            return http.post("/v1/chat/completions", **kw, **data)

        _error(post(b"{not json"), 400, "invalid_json")
        _error(post(b"[1, 2]"), 400, "invalid_json")
        _error(post(gw.chat_body(max_tokens="5")), 400, param="max_tokens")
        _error(post(gw.chat_body(temperature=True)), 400, param="temperature")
        _error(post(gw.chat_body(n=0)), 400, param="n")
        _error(post({"model": "fake"}), 400, param="messages")
        _error(
            post({"model": "fake", "messages": [{"role": "user"}], "stop": 3}), 400, param="stop"
        )
        _error(post({"messages": [{"role": "user", "content": "x"}]}), 400, param="model")
        _error(post(gw.chat_body(model="gpt-4")), 404, "model_not_found", "model")
        _error(post(gw.chat_body("x" * 200)), 400, "context_length_exceeded", "messages")
        _error(post(gw.chat_body(max_tokens=500)), 400, "context_length_exceeded", "max_tokens")
        _error(  # the field the request used is the one named
            post(gw.chat_body(max_completion_tokens=500)),
            400,
            "context_length_exceeded",
            "max_completion_tokens",
        )
        _error(post(gw.chat_body("x" * 5000)), 413, "request_too_large")
        _error(post(gw.chat_body(prefix_id="pfx-nope")), 404, "prefix_not_found", "prefix_id")
        _error(
            post({"model": "fake", "messages": [{"role": "tool", "content": "x"}]}),
            400,
            param="messages",
        )  # the chat template refuses it
        _error(
            http.post("/v1/completions", json={"model": "fake", "prompt": [999]}),
            400,
            param="prompt",
        )
        _error(http.post("/v1/completions", json={"model": "fake", "prompt": ""}), 400)
        _error(http.get("/v1/nothing"), 404)
        _error(http.get("/v1/chat/completions"), 405)
        # still serving, nothing leaked
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
    stats = gw.wait_idle(srv, engine)
    assert stats["kv_blocks_used"] == 0 and len(engine.requests_seen) == 1


def test_api_keys_401(serve_fake, gw):
    srv, _ = serve_fake(GatewaySettings(model_name="fake", api_keys=["sk-good"]))
    with gw.client(srv) as http:
        _error(http.post("/v1/chat/completions", json=gw.chat_body()), 401, "invalid_api_key")
        _error(
            http.post(
                "/v1/chat/completions",
                json=gw.chat_body(),
                headers={"Authorization": "Bearer sk-bad"},
            ),
            401,
            "invalid_api_key",
        )
        _error(http.get("/v1/models", headers={"Authorization": "Basic x"}), 401)
        ok = http.post(
            "/v1/chat/completions",
            json=gw.chat_body(max_tokens=2),
            headers={"Authorization": "Bearer sk-good"},
        )
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200  # health needs no key


def test_rate_limits_429_with_retry_after(serve_fake, gw, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"key": "k", "requests_per_minute": 2},
                    {"key": "t", "tokens_per_minute": 60},
                ]
            }
        )
    )
    srv, _ = serve_fake(GatewaySettings(model_name="fake", keys_file=str(keys)))
    with gw.client(srv, headers={"Authorization": "Bearer k"}) as http:
        for _ in range(2):
            assert (
                http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=1)).status_code
                == 200
            )
        r = http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=1))
        _error(r, 429, "rate_limit_exceeded")
        assert int(r.headers["Retry-After"]) >= 1
    with gw.client(srv, headers={"Authorization": "Bearer t"}) as http:
        assert (
            http.post(
                "/v1/chat/completions", json=gw.chat_body("y" * 50, max_tokens=30)
            ).status_code
            == 200
        )
        r = http.post("/v1/chat/completions", json=gw.chat_body("y" * 50, max_tokens=1))
        _error(r, 429, "rate_limit_exceeded")


def test_max_concurrent_per_key(serve_fake, gw, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "c"\nmax_concurrent = 1\n')
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keys_file=str(keys)), token_delay_s=0.05
    )

    async def run():
        hdr = {"Authorization": "Bearer c"}
        async with aiohttp.ClientSession(headers=hdr) as s:

            async def one():
                async with s.post(
                    srv.url + "/v1/chat/completions", json=gw.chat_body(max_tokens=5)
                ) as r:
                    return r.status

            return await asyncio.gather(*(one() for _ in range(3)))

    statuses = asyncio.run(run())
    assert sorted(statuses) == [200, 429, 429]
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_503_until_ready(gw):
    holder = {}

    def make():
        holder["app"] = create_app(None, GatewaySettings(model_name="fake"))
        return holder["app"]

    with BackgroundServer(make) as srv, gw.client(srv) as http:
        assert http.get("/health").status_code == 200
        _error(http.get("/ready"), 503, "model_not_ready")
        r = http.post("/v1/chat/completions", json=gw.chat_body())
        _error(r, 503, "model_not_ready")
        assert "Retry-After" in r.headers

        async def attach():
            attach_engine(holder["app"], gw.FakeEngine())

        srv.call(attach)
        assert http.get("/ready").status_code == 200
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200


def test_500_concurrent_over_capacity(serve_fake, gw):
    """500 connections at once against a queue of 32: the rest get 429 + Retry-After, the
    admitted ones finish, the server keeps serving and nothing leaks."""
    settings = GatewaySettings(model_name="fake", max_queued_requests=32)
    srv, engine = serve_fake(settings, max_num_seqs=8, token_delay_s=0.01)

    async def run():
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:

            async def one(i):
                async with s.post(
                    srv.url + "/v1/chat/completions", json=gw.chat_body(f"q{i}", max_tokens=4)
                ) as r:
                    body = await r.json()
                    return r.status, body, r.headers.get("Retry-After")

            return await asyncio.gather(*(one(i) for i in range(500)))

    results = asyncio.run(run())
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 429]
    assert len(ok) + len(busy) == 500, {r[0] for r in results}
    assert len(ok) >= 32 and busy
    for _, body, retry in busy:
        assert body["error"]["code"] == "server_overloaded" and int(retry) >= 1
    stats = gw.wait_idle(srv, engine)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    with gw.client(srv) as http:
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
        assert "prefixgate_queue_depth 0.0" in http.get("/metrics").text


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_and_frees_blocks(serve_fake, gw, stream):
    """A client that goes away mid-generation (streaming or not) and one that goes away while
    still waiting in the queue: their engine requests are aborted, blocks freed."""
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", poll_s=0.02), max_num_seqs=1, token_delay_s=0.05
    )

    async def run():
        async with aiohttp.ClientSession() as s:

            async def go(content):
                body = gw.chat_body(content, max_tokens=100, stream=stream)
                async with s.post(srv.url + "/v1/chat/completions", json=body) as r:
                    if stream:
                        await r.content.readline()
                    await asyncio.sleep(10)

            running = asyncio.create_task(go("first"))
            await asyncio.sleep(0.3)
            waiting = asyncio.create_task(go("second"))  # queued behind max_num_seqs=1
            await asyncio.sleep(0.3)
            mid = srv.call(_stats(engine))
            running.cancel()
            waiting.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
            return mid

    mid = asyncio.run(run())
    assert mid["num_running"] == 1 and mid["num_waiting"] == 1 and mid["kv_blocks_used"] > 0
    stats = gw.wait_idle(srv, engine)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert engine.generated < 30  # stopped long before max_tokens=100 x 2


def _stats(engine):
    async def get():
        return engine.stats()

    return get


def test_engine_shut_down_gives_503(serve_fake, gw):
    """The fake engine raises the engine's own ``EngineDeadError`` once shut down; the gateway
    knows it by its class (not its name): 503 ``engine_unavailable``, streaming or not."""
    srv, engine = serve_fake()

    async def stop():
        await engine.shutdown()

    srv.call(stop)
    with gw.client(srv) as http:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2, stream=stream))
            _error(r, 503, "engine_unavailable")
            assert "Retry-After" in r.headers
