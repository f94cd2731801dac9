"""A request cut by the shutdown is logged once, by its explicit ending — never also as a 499
"client gone" (``lifecycle.shutdown_ending``, ``app.count_requests``)."""

from __future__ import annotations

import logging
import threading
import time

import httpx
from prefixgate.gateway.app import create_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import FakeEngine


def test_a_request_cut_by_shutdown_is_logged_once(caplog):
    engine = FakeEngine(token_delay_s=0.05)
    srv = BackgroundServer(
        lambda: create_app(engine, GatewaySettings(model_name="fake")), access_log=True
    ).__enter__()
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100}

    def call(stream: bool) -> None:
        try:
            with httpx.stream(
                "POST", srv.url + "/v1/chat/completions", json={**body, "stream": stream}
            ) as r:
                r.read()
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=call, args=(s,)) for s in (True, False)]
    with caplog.at_level(logging.INFO, logger="prefixgate.access"):
        for t in threads:
            t.start()

        async def running() -> int:
            return engine.stats()["num_running"]

        while srv.call(running) < 2:
            time.sleep(0.02)
        srv.call(lambda: srv.server.drain(0.2), timeout=10)
        srv.server = None
        for t in threads:
            t.join(10)
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.access"]
    chat = [line for line in lines if "/v1/chat/completions" in line]
    assert len(chat) == 2, lines  # one line per request
    assert not any('" 499 ' in line for line in chat), lines
    assert sorted(line.split('" ')[1].split()[0] for line in chat) == ["200", "503"], lines
    # the started stream's 200 was sent before the cut: its line says how it ended, with the
    # usage it had (both the token counts of its handler's cleanup, never "-")
    (streamed,) = [line for line in chat if '" 200 ' in line]
    assert '" 200 error=server_shutting_down ' in streamed, streamed
    assert "prompt=-" not in streamed and "completion=-" not in streamed, streamed
    (refused,) = [line for line in chat if '" 503 ' in line]
    assert "error=" not in refused, refused  # an error answer says so by its status
    from prefixgate.gateway.state import STATE

    text = srv.app[STATE].metrics.render().decode()
    assert 'code="client_gone"' not in text, text
    assert 'code="server_shutting_down"' in text, text
    srv.close()
