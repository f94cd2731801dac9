"""The access log's ``walk=`` part: where a request's first token went."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from prefixgate.gateway.http.access_log import access_line
from prefixgate.gateway.http.request_account import ACCOUNT, RequestAccount
from prefixgate.gateway.local.token_walk import first_token_walk, parse_walk


def test_walk_adds_up_each_part_in_milliseconds():
    engine = {
        "arrival": 10.002,
        "first_scheduled": 10.010,
        "first_token": 10.030,
        "steps_waited": 2,
        "first_step_tokens": 96,
        "first_chunk_tokens": 24,
        "first_step_s": 0.0185,
    }
    value = first_token_walk(10.0, 10.001, engine, 10.0325, 10.0335)
    assert value == (
        "admit:1.0,to_engine:1.0,wait:8.0,steps:2,step:96tok/18.5,chunk:24,"
        "to_token:20.0,deliver:2.5,write:1.0"
    )
    parsed = parse_walk(value)
    assert parsed["step_tokens"] == 96 and parsed["step_ms"] == 18.5
    assert parsed["wait"] == 8.0 and parsed["steps"] == 2 and parsed["write"] == 1.0
    # parts not known are left out; nothing known is None
    assert first_token_walk(10.0, 10.001, None, None, None) == "admit:1.0"
    assert first_token_walk(10.0, None, None, None, None) is None
    with pytest.raises(ValueError, match="name:value"):
        parse_walk("admit")


def test_access_line_shows_the_walk():
    class Req(dict):
        remote, method, path = "127.0.0.1", "POST", "/v1/chat/completions"

    r = Req()
    r[ACCOUNT] = RequestAccount(key_name="light", walk="admit:0.1,wait:2.0")
    line = access_line(r, 200, 0.5)  # type: ignore[arg-type]
    assert line.endswith("key=light prompt=- completion=- cached=- walk=admit:0.1,wait:2.0 0.500s")


def test_a_streamed_generation_logs_its_walk(caplog):
    from prefixgate.gateway.app import create_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings
    from support.fake_engine import FakeEngine

    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
    }
    with caplog.at_level(logging.INFO, logger="prefixgate.access"):
        with BackgroundServer(
            lambda: create_app(FakeEngine(), GatewaySettings(model_name="fake")), access_log=True
        ) as srv:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                r.read()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                rec.name == "prefixgate.access" for rec in caplog.records
            ):
                time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.access"]
    assert len(lines) == 1, lines
    walk = lines[0].split("walk=")[1].split()[0]
    parts = parse_walk(walk)
    assert {"admit", "to_engine", "write"} <= set(parts), walk  # the fake engine's arrival
    assert all(v >= 0 for v in parts.values()), walk
