"""Upstream health like a load balancer's (``gateway/proxy/health.py``, after Envoy's outlier
detection and active health checks), against real upstreams on loopback: one answer cut
mid-body fails only its request; a frozen upstream is found by its health checks within a
few seconds, traffic (affinity included) moves off it, and it comes back after it thaws;
consecutive failures eject within ``max_ejection_percent``; no routing policy ever picks an
upstream out of rotation."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.health import HealthPolicy, UpstreamHealth
from prefixgate.gateway.proxy.policies import POLICIES, Route
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import UpstreamRouter
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error

from examples.benchmarks.fault_upstream import FaultUpstream

BODY = {"model": "fault", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
def pool() -> Iterator:
    """``pool(n, **settings) -> (gateway, [FaultUpstream])``, all closed after the test."""
    opened: list = []

    def start(n: int, **settings) -> tuple[BackgroundServer, list[FaultUpstream]]:
        ups = [FaultUpstream("ok", 2, 0.001).__enter__() for _ in range(n)]
        opened.extend(ups)
        s = GatewaySettings(**settings)
        gw = BackgroundServer(lambda: create_proxy_app([u.url for u in ups], s)).__enter__()
        opened.append(gw)
        return gw, ups

    yield start
    for item in reversed(opened):
        item.close()


def _chat(url: str, content: str = "hi", timeout: float = 30.0, **kw) -> httpx.Response:
    body = {**BODY, "messages": [{"role": "user", "content": content}], **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


@pytest.mark.parametrize("mode", ["kill", "eof"])
@pytest.mark.parametrize("stream", [False, True])
def test_one_answer_cut_mid_body_fails_only_that_request(pool, mode, stream):
    gw, (up,) = pool(1)
    up.mode = mode
    r = _chat(gw.url, stream=stream)
    if stream:  # started: the cut ends it with an error event, never [DONE]
        assert r.status_code == 200 and "upstream_error" in r.text
        assert "data: [DONE]" not in r.text
    else:
        assert_openai_error(r, 502, "upstream_unavailable")
    up.mode = "ok"
    statuses = [_chat(gw.url, f"q{i}").status_code for i in range(39)]
    assert statuses == [200] * 39  # the only upstream stayed in rotation
    only = gw.app[PROXY].router.upstreams[0]
    assert only.healthy and only.strikes == 0 and only.health.ejections == 0


def test_failures_in_a_row_eject_at_most_max_ejection_percent(pool):
    gw, ups = pool(2, upstream_base_ejection_s=30.0)
    router = gw.app[PROXY].router
    for up in ups:
        up.mode = "kill"
    for i in range(8):  # every attempt fails on both upstreams
        assert_openai_error(_chat(gw.url, f"q{i}"), 502, "upstream_unavailable")
    states = sorted(u.health.state() for u in router.upstreams)
    assert states == ["ejected", "healthy"]  # 50 %: one of two, never both
    for up in ups:
        up.mode = "ok"
    assert [_chat(gw.url, f"r{i}").status_code for i in range(5)] == [200] * 5
    ejected = next(u for u in router.upstreams if not u.healthy)
    assert 20 < ejected.health.ejected_until - time.monotonic() <= 30


def test_a_frozen_upstream_is_found_within_seconds_and_traffic_moves(pool):
    gw, ups = pool(
        2,
        routing="cache_aware",
        health_interval_s=0.5,
        health_check_timeout_s=0.5,
        unhealthy_threshold=2,
        healthy_threshold=2,
        upstream_timeout_s=60.0,
    )
    router = gw.app[PROXY].router
    prompt = "the same long system prompt " * 8
    assert _chat(gw.url, prompt).status_code == 200
    home_url = next(u.url for u in router.upstreams if u.served)
    home = next(u for u in ups if u.url == home_url)
    home_up = router.find(home_url)
    assert home_up is not None
    before = home.requests
    home.freeze()
    frozen_at = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool_:
        stuck = pool_.submit(_chat, gw.url, prompt)  # affinity: sent to the frozen one
        deadline = frozen_at + 15
        while home_up.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        found_s = time.monotonic() - frozen_at
        assert not home_up.healthy and home_up.health.state() == "down", found_s
        # 2 checks of 0.5 s timeout, 0.5 s apart: about 2 s (a loaded machine: more)
        print(f"frozen upstream found down after {found_s:.2f} s")
        ready = httpx.get(gw.url + "/ready", timeout=5).json()
        assert ready["upstreams_healthy"] == 1
        # the same prompt now goes to the other upstream, at once
        answers = [_chat(gw.url, prompt, timeout=10) for _ in range(5)]
        assert [r.status_code for r in answers] == [200] * 5
        assert home.requests == before  # none reached the frozen one's answer path
        assert not stuck.done()
        home.thaw()
        assert stuck.result(30).status_code == 200  # it was only waiting
        deadline = time.monotonic() + 15
        while not home_up.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert home_up.healthy and home_up.health.state() == "healthy"
        assert home_up.strikes == HealthPolicy().consecutive_failures - 1  # half-open
    assert _chat(gw.url, prompt).status_code == 200
    assert home_up.strikes == 0  # a good answer closed it


@pytest.mark.slow
def test_a_sigstopped_upstream_process_is_found_and_brought_back(tmp_path):
    """The real thing: an upstream in its own process, ``SIGSTOP``-ped then ``SIGCONT``-ed."""
    import os
    import signal
    import subprocess
    import sys

    from support.net import free_port

    port = free_port()
    script = (
        "import time\n"
        "from examples.benchmarks.fault_upstream import FaultUpstream\n"
        "import asyncio\n"
        f"u = FaultUpstream('ok', 2, 0.001)\n"
        "async def start():\n"
        f"    u._server = await asyncio.start_server(u._serve, '127.0.0.1', {port})\n"
        "u._thread.start()\n"
        "asyncio.run_coroutine_threadsafe(start(), u._loop).result(10)\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[2]  # examples.benchmarks from the checkout
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=root
    )
    other = FaultUpstream("ok", 2, 0.001).__enter__()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        url = f"http://127.0.0.1:{port}"
        s = GatewaySettings(health_interval_s=0.5, health_check_timeout_s=0.5)
        with BackgroundServer(lambda: create_proxy_app([url, other.url], s)) as gw:
            router = gw.app[PROXY].router
            target = router.find(url)
            assert target is not None and target.healthy
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            while target.healthy and time.monotonic() - t0 < 15:
                time.sleep(0.05)
            assert not target.healthy
            print(f"SIGSTOP-ped upstream down after {time.monotonic() - t0:.2f} s")
            assert all(_chat(gw.url, f"q{i}", timeout=10).status_code == 200 for i in range(6))
            os.kill(proc.pid, signal.SIGCONT)
            t0 = time.monotonic()
            while not target.healthy and time.monotonic() - t0 < 15:
                time.sleep(0.05)
            assert target.healthy
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        other.close()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_routing_policy_picks_an_upstream_out_of_rotation(policy):
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    router = UpstreamRouter(urls, policy=policy, health=HealthPolicy(max_ejection_percent=100))
    ups = router.upstreams
    for u in ups:
        u.models = frozenset(("m",))
    ups[0].healthy = False  # down by its checks
    for _ in range(HealthPolicy().consecutive_failures):
        router.mark_failed(ups[1], "HTTP 502")  # ejected by its answers
    assert ups[1].health.state() == "ejected"
    ups[2].health.ejected, ups[2].health.ejected_until = True, 0.0  # half-open: not yet back
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for i in range(40):
        body["messages"][0]["content"] = f"prompt {i % 3} " * 20
        route = router.route(body, None, "m")
        if i % 2:
            router.learn(ups[i % 4], route, 100, 120)  # teach affinity every upstream
        assert router.pick(route) is ups[3]
    assert router.pick(Route(b"k", [], "m"), exclude=[ups[3]]) is None


def test_health_state_machine_units():
    policy = HealthPolicy(consecutive_failures=2, base_ejection_s=1.0, max_ejection_s=2.5)
    h = UpstreamHealth()
    assert not h.failure(policy) and h.failure(policy)
    assert h.eject(policy) == 1.0 and h.state() == "ejected" and not h.due_check()
    h.ejected_until = 0.0
    assert h.due_check() and h.state() == "half_open"
    assert h.checked(True, policy) == "back" and h.in_rotation and h.failures == 1
    assert h.eject(policy) == 2.0 and h.eject(policy) == 2.5  # growing, capped
    h = UpstreamHealth()
    assert h.checked(False, policy) is None and h.checked(False, policy) == "down"
    assert h.checked(True, policy) is None and h.checked(True, policy) == "back"
    assert policy.ejectable(1, 2) and not policy.ejectable(2, 2) and not policy.ejectable(1, 1)
    for bad in (
        {"consecutive_failures": 0},
        {"max_ejection_percent": 101},
        {"timeout_s": 0},
        {"base_ejection_s": 5, "max_ejection_s": 1},
    ):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_s")[0]):
            HealthPolicy(**bad)
    with pytest.raises(ValueError, match="healthy_threshold"):
        GatewaySettings(healthy_threshold=0)


def test_ready_lists_each_upstreams_health_state(pool):
    gw, ups = pool(2)
    pool_ = httpx.get(gw.url + "/ready", timeout=5).json()["upstreams"]
    assert {u["state"] for u in pool_} == {"healthy"}
    assert all(u["ejections"] == 0 and u["ejected_s"] == 0.0 for u in pool_)
