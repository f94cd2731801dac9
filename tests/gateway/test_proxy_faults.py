"""The proxy verifies what it relays (gateway/proxy/relay.py, routes_upstream.py, upstream.py): a
broken upstream answer never reaches the client as a success, timeouts are idle timeouts,
one slow request does not empty the pool, /ready probes the upstreams at start."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.relay import EventChecker, StreamBroken
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.sdk import Client
from prefixgate.sdk import errors as sdk_errors
from support.fault_proxy import FaultProxies

from examples.benchmarks.fault_upstream import FaultUpstream

BODY = {"model": "fault", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
def proxy() -> Iterator:
    """``proxy(mode, **settings) -> (gateway, upstream)``; both stopped after the test."""
    with FaultProxies() as proxies:

        def start(mode: str = "ok", chunks: int = 4, delay_s: float = 0.01, **settings):
            defaults = {"keepalive_s": 0.2, "upstream_timeout_s": 1.0}
            return proxies.start(mode, chunks, delay_s, {**defaults, **settings})

        yield start


def _access_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "prefixgate.access" and "/v1/chat/completions" in r.getMessage()
    ]


def _sse(gw: BackgroundServer, body: dict) -> tuple[int, list[str], list[str]]:
    """(status, data payloads, comment lines) of a streamed request."""
    data, comments = [], []
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
            elif line.startswith(":"):
                comments.append(line)
        return r.status_code, data, comments


@pytest.mark.parametrize("mode", ["html200", "garbage", "eof", "kill"])
def test_a_200_that_is_not_a_whole_json_object_is_a_502_error_object(proxy, mode):
    gw, up = proxy(mode)
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_unavailable", err
    if mode in ("html200", "garbage"):
        assert "not JSON" in err["message"], err


@pytest.mark.parametrize(
    "mode,code",
    [
        ("eof", "upstream_error"),
        ("kill", "upstream_error"),
        ("garbage", "upstream_error"),
        ("stall", "upstream_timeout"),
    ],
)
def test_a_broken_stream_ends_with_an_error_event(proxy, mode, code, caplog):
    gw, up = proxy(mode)
    with caplog.at_level(logging.INFO, logger="prefixgate.access"):
        status, data, comments = _sse(gw, BODY)
        # its 200 went out before the break: the access line says how the stream ended
        deadline = time.monotonic() + 5
        while not _access_lines(caplog) and time.monotonic() < deadline:
            time.sleep(0.02)
    (line,) = _access_lines(caplog)
    assert f'" 200 error={code} ' in line, line
    assert status == 200
    assert "[DONE]" not in data
    last = json.loads(data[-1])
    assert last["error"]["code"] == code, last
    if mode == "stall":
        assert comments, "keep-alive comments while the upstream is silent"
    # the official client and the project's SDK raise instead of returning truncated text
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in oa.chat.completions.create(**BODY, stream=True):
            pass
    with Client(base_url=gw.url + "/v1", api_key="x", max_retries=0) as sdk:
        with pytest.raises(sdk_errors.APIError):
            for _ in sdk.chat.completions.create(**BODY, stream=True):
                pass


def test_a_healthy_stream_longer_than_the_timeout_is_not_cut(proxy):
    # 12 chunks 0.25 s apart: 3 s in all, against a 1 s upstream timeout (idle, not total).
    gw, up = proxy("ok", chunks=12, delay_s=0.25)
    status, data, _ = _sse(gw, BODY)
    assert status == 200 and data[-1] == "[DONE]"
    assert sum('"content"' in d for d in data) == 12


def test_an_idle_timeout_is_504_and_does_not_mark_the_only_upstream_unhealthy(proxy):
    gw, up = proxy("stall")
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    time.sleep(0.5)  # the probe it triggered answers 200
    ready = httpx.get(gw.url + "/ready", timeout=5)
    assert ready.status_code == 200, ready.text
    up.mode = "ok"
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"


def test_ready_probes_every_upstream_at_start():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        settings = GatewaySettings(health_interval_s=30)
        with BackgroundServer(lambda: create_proxy_app([dead], settings)) as gw:
            r = httpx.get(gw.url + "/ready", timeout=5)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "upstream_unavailable"
        with FaultUpstream("ok") as up:
            with BackgroundServer(lambda: create_proxy_app([up.url, dead], settings)) as gw:
                r = httpx.get(gw.url + "/ready", timeout=5)
                assert r.status_code == 200
                pool = {u["url"]: u["healthy"] for u in r.json()["upstreams"]}
                assert pool == {up.url: True, dead: False}


def test_event_checker_units():
    c = EventChecker()
    assert c.feed(b'data: {"a": 1}\n\ndata: [DO') == b'data: {"a": 1}\n\n'
    assert c.feed(b"NE]\n\n") == b"data: [DONE]\n\n" and c.done
    c = EventChecker()
    assert c.feed(b": ping\r\n\r\nevent: x\r\ndata: {}\r\n\r\n").count(b"\n\n") == 2
    with pytest.raises(StreamBroken):
        EventChecker().feed(b"<html>\n\n")
    with pytest.raises(StreamBroken):
        EventChecker().feed(b"data: not json\n\n")
    c = EventChecker()
    c.feed(b'data: {"error": {"message": "x"}}\n\n')
    assert c.done and c.errored  # the upstream's own explicit ending passes


@pytest.mark.parametrize("mode", ["html200", "garbage"])
def test_an_invalid_200_answer_costs_the_key_nothing(proxy, mode, tmp_path):
    # The invalid answer is a failed upstream (502): the request is refunded, as every
    # request that fails before its first token, not charged as if served.
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-a", "requests_per_minute": 1}]}))
    gw, up = proxy(mode, keys_file=str(keys))
    auth = {"Authorization": "Bearer sk-a"}
    for _ in range(3):  # 502, then 503 (the only upstream is out of rotation): never 429
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, headers=auth, timeout=10)
        assert r.status_code in (502, 503), r.text
