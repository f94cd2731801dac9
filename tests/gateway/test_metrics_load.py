"""Upstreams' load from their ``/metrics`` (``proxy/metrics_load.py``): vLLM's names parsed,
and routing policies reading an upstream's published requests (every client's) when they are
more than this gateway's own. Stub upstreams (``support.chat_stub``) with a ``/metrics``."""

from __future__ import annotations

import time

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.metrics_load import parse_pool_metrics, published_requests
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.settings import GatewaySettings
from support.chat_stub import ChatStub

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


def test_parse_pool_metrics():
    got = parse_pool_metrics(VLLM_TEXT)
    assert got is not None and (got.running, got.waiting, got.kv_usage) == (3, 5, 0.25)
    assert parse_pool_metrics("# nothing\nother_metric 1\n") is None
    assert parse_pool_metrics("not {{ prometheus") is None


class Busy(ChatStub):
    """A chat stub whose /metrics says ``waiting`` requests wait (other clients' load)."""

    waiting: int = 0

    def app(self) -> web.Application:
        app = super().app()

        async def metrics(request: web.Request) -> web.Response:
            body = (
                f'vllm:num_requests_running{{engine="0"}} 0\n'
                f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
            )
            return web.Response(text=body)

        app.router.add_get("/metrics", metrics)
        return app


@pytest.mark.parametrize("routing", ["least_loaded"])
def test_policies_read_the_published_load(routing):
    busy, idle = Busy(), Busy()
    busy.waiting = 9
    ups = [BackgroundServer(s.app).__enter__() for s in (busy, idle)]
    settings = GatewaySettings(routing=routing, upstream_metrics_interval_s=0.25)
    try:
        with BackgroundServer(lambda: create_proxy_app([u.url for u in ups], settings)) as gw:
            router = gw.app[PROXY].router
            deadline = time.monotonic() + 10
            while any(published_requests(u) is None for u in router.upstreams):
                assert time.monotonic() < deadline, "the upstreams' /metrics were not read"
                time.sleep(0.05)
            assert sorted(published_requests(u) for u in router.upstreams) == [0, 9]
            body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(4):
                assert httpx.post(gw.url + "/v1/chat/completions", json=body).status_code == 200
            assert (len(busy.seen), len(idle.seen)) == (0, 4)
    finally:
        for u in ups:
            u.close()


def test_the_interval_is_bounded():
    with pytest.raises(ValueError, match="upstream_metrics_interval_s"):
        GatewaySettings(upstream_metrics_interval_s=0.01)
    GatewaySettings(upstream_metrics_interval_s=0)  # off
