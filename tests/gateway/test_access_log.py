"""The per-request access line and the periodic engine line (``prefixgate serve`` logs)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prefixgate.gateway.local.engine_log import log_engine_stats, stats_line
from support.fake_engine import IDLE_STATS

IDLE = IDLE_STATS


def test_stats_line_rates_over_the_interval():
    cur = dict(IDLE, prompt_tokens_prefilled=300, tokens_decoded=90, num_running=2)
    cur.update(num_waiting=1, prefix_cache_queries=400, prefix_cache_hits=280, kv_blocks_used=16)
    line = stats_line(IDLE, cur, 2.0)
    assert line == (
        "engine: prompt 100.0 tokens/s, generation 20.0 tokens/s, running 2, waiting 1, "
        "KV cache 25.0 % used, prefix hit rate 90.0 %"
    )


def test_stats_line_is_silent_when_idle():
    assert stats_line(IDLE, dict(IDLE), 10.0) is None
    # a request waiting with nothing computed is activity (e.g. the cache is full)
    assert stats_line(IDLE, dict(IDLE, num_waiting=1), 10.0) is not None


def test_log_engine_stats_logs_only_active_intervals(caplog):
    snapshots = [IDLE, dict(IDLE), dict(IDLE, tokens_decoded=60)]  # then idle at 60 for good
    calls = []

    def stats() -> dict:
        calls.append(1)
        return snapshots[min(len(calls), len(snapshots)) - 1]

    ticks = iter(range(10_000))

    async def run() -> None:
        task = asyncio.create_task(log_engine_stats(stats, 0.001, lambda: next(ticks)))
        while len(calls) < 6:
            await asyncio.sleep(0.001)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="prefixgate.engine.stats"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.engine.stats"]
    assert lines == [
        "engine: prompt 0.0 tokens/s, generation 10.0 tokens/s, running 0, waiting 0, "
        "KV cache 0.0 % used, prefix hit rate 50.0 %"
    ]
    with pytest.raises(ValueError):
        asyncio.run(log_engine_stats(lambda: IDLE, 0))


def test_a_client_gone_before_its_answer_gets_its_access_line(caplog):
    # aiohttp logs only answered requests: a non-streaming client that left mid-generation
    # (its handler cancelled, its engine request aborted) left no access line at all.
    import time

    import httpx
    from prefixgate.gateway.app import create_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings
    from support.fake_engine import FakeEngine

    holder: dict = {}

    def make():
        holder["engine"] = FakeEngine(token_delay_s=0.05)
        return create_app(holder["engine"], GatewaySettings(model_name="fake"))

    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    with caplog.at_level(logging.INFO, logger="prefixgate.access"):
        with BackgroundServer(make, access_log=True) as srv:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=0.5)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and holder["engine"].stats()["num_running"]:
                time.sleep(0.05)
            time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.access"]
    assert len(lines) == 1, lines
    assert '"POST /v1/chat/completions" 499 key=- prompt=' in lines[0]
    assert "prompt=-" not in lines[0]  # the usage it had is kept


STREAMS = {
    "/v1/chat/completions": {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1000,
        "stream": True,
    },
    "/v1/messages": {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1000,
        "stream": True,
    },
    "/v1beta/models/fake:streamGenerateContent?alt=sse": {
        "contents": [{"parts": [{"text": "hi"}]}],
        "generationConfig": {"maxOutputTokens": 1000},
    },
}


CUTS = 12


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_stream_its_client_cut_is_counted_and_logged_as_499(caplog, serve_fake, mode):
    """A client that closes a stream after a few events: one access line and one count of
    ``499 client_gone`` per stream in every dialect and both modes, never the ``200`` the
    stream began with (the relays returned the response as if it had ended)."""
    import re
    import time

    import httpx
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings

    with caplog.at_level(logging.INFO, logger="prefixgate.access"):
        # tokens every 5 ms: the relay writes soon after a cut
        local, engine = serve_fake(
            access_log=mode == "local", max_model_len=4096, token_delay_s=0.005
        )
        front = local
        if mode == "proxy":
            front = BackgroundServer(
                lambda: create_proxy_app([local.url], GatewaySettings()), access_log=True
            ).__enter__()
        try:
            for path, body in STREAMS.items():
                for _ in range(CUTS):
                    with httpx.stream("POST", front.url + path, json=body, timeout=10) as r:
                        assert r.status_code == 200
                        events = 0
                        for line in r.iter_lines():
                            events += line.startswith("data: ")
                            if events == 3:
                                break
            deadline = time.monotonic() + 10  # the aborts reach the engine, the lines are written
            while time.monotonic() < deadline and engine.stats()["num_running"]:
                time.sleep(0.05)
            time.sleep(0.3)
            metrics = httpx.get(front.url + "/metrics").text
        finally:
            if front is not local:
                front.__exit__(None, None, None)
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.access"]
    # a client that left is not the upstream breaking (aiohttp's ClientConnectionResetError,
    # raised by the write to the client, is a ClientConnectionError too)
    assert not [
        r for r in caplog.records if "upstream" in r.getMessage() and "broke" in r.getMessage()
    ]
    for path in STREAMS:
        route = path.split("?")[0]
        mine = [ln for ln in lines if f'"POST {route}' in ln or f'"POST {path}' in ln]
        assert len(mine) == CUTS and all('" 499 ' in ln for ln in mine), (path, mine)
    counted = re.findall(r'prefixgate_requests_total\{[^}]*status="(\d+)"[^}]*\} (\S+)', metrics)
    assert not [c for c in counted if c[0] == "200" and float(c[1]) > 0], counted
    assert sum(float(n) for s, n in counted if s == "499") == CUTS * len(STREAMS), counted


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat-on-anthropic", "messages-on-openai"])
def test_a_translated_proxy_answer_logs_its_finish_reason_and_first_token(
    caplog, tmp_path, route, stream
):
    """The relays that translate (chat on an Anthropic deployment, Messages on an
    OpenAI-compatible upstream) note the upstream's finish reason, in OpenAI's words, and a
    stream's first content chunk as its first token (``finish=`` and ``ttft=``); was: none."""
    import re
    import time

    import httpx
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings
    from support.anthropic_stub import AnthropicStub, claude_config
    from support.stub_upstream import StubServer

    ask = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with caplog.at_level(logging.INFO, logger="prefixgate.access"):
        if route == "chat-on-anthropic":
            claude = AnthropicStub()
            up = BackgroundServer(claude.app).__enter__()
            upstreams = claude_config(tmp_path / "proxy.toml", up.url)
            path, body = "/v1/chat/completions", {"model": "claude", "messages": ask}
            stop = up.close
        else:
            stub = StubServer(name="fake").start()
            upstreams, stop = [stub.base_url], stub.stop
            path = "/v1/messages"
            body = {"model": "fake", "messages": ask, "max_tokens": 8}
        try:
            make = lambda: create_proxy_app(upstreams, GatewaySettings())  # noqa: E731
            with BackgroundServer(make, access_log=True) as proxy:
                r = httpx.post(proxy.url + path, json={**body, "stream": stream}, timeout=10)
                assert r.status_code == 200, r.text
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not any(
                    r.name == "prefixgate.access" and path in r.getMessage() for r in caplog.records
                ):
                    time.sleep(0.01)
        finally:
            stop()
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if r.name == "prefixgate.access" and path in r.getMessage()
    ]
    said = "length" if route == "messages-on-openai" and stream else "stop"  # the stub's words
    assert f" finish={said} " in line, line
    assert (re.search(r" ttft=\d+\.\d{3}s ", line) is not None) == stream, line


def test_a_proxys_health_polls_are_debug_lines_on_its_prefixgate_upstream(caplog, serve_fake):
    """A proxy's health checks of a prefixgate upstream (``GET /health`` every interval, and
    ``GET /v1/models`` every few) are logged there at DEBUG, as its other probes; a client's
    own ``GET /v1/models`` stays an INFO line."""
    import time

    import httpx
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.proxy.upstream import MODELS_EVERY
    from prefixgate.gateway.settings import GatewaySettings

    with caplog.at_level(logging.DEBUG, logger="prefixgate.access"):
        upstream, _engine = serve_fake(access_log=True)
        settings = GatewaySettings(health_interval_s=0.02)
        with BackgroundServer(lambda: create_proxy_app([upstream.url], settings)):
            time.sleep(0.02 * MODELS_EVERY * 4)
        httpx.get(upstream.url + "/v1/models", timeout=10)
        time.sleep(0.2)
    polls = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "prefixgate.access" and '"GET /v1/models"' in r.getMessage()
    ]
    assert len(polls) >= 3, polls  # at start, then every MODELS_EVERY checks, then the client
    assert [level for level, _ in polls[:-1]] == [logging.DEBUG] * (len(polls) - 1), polls
    assert polls[-1][0] == logging.INFO, polls
    health = [r.levelno for r in caplog.records if '"GET /health"' in r.getMessage()]
    assert health and set(health) == {logging.DEBUG}
