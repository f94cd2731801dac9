"""The gateway-wide token counters (``prefixgate_prompt_tokens_total``,
``prefixgate_generation_tokens_total``, ``prefixgate_cached_prompt_tokens_total``) count what
the upstreams reported in proxy mode, as they count the engine's tokens in local mode: they
stayed 0 behind a proxy while its access lines showed every request's usage."""

from __future__ import annotations

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

PROMPT = "Tell me about prefix caches, and why they matter so. " * 2
TOTALS = (
    "prefixgate_prompt_tokens_total",
    "prefixgate_generation_tokens_total",
    "prefixgate_cached_prompt_tokens_total",
)


def _totals(url: str) -> tuple[float, ...]:
    values = dict.fromkeys(TOTALS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return tuple(values[name] for name in TOTALS)


def _usage(dialect: str, resp: httpx.Response) -> tuple[int, int, int]:
    if dialect == "messages":
        u = resp.json()["usage"]
        cached = u["cache_read_input_tokens"]
        prompt = u["input_tokens"] + u["cache_creation_input_tokens"] + cached
        return prompt, u["output_tokens"], cached
    if dialect == "gemini":
        m = resp.json()["usageMetadata"]
        return m["promptTokenCount"], m["candidatesTokenCount"], m.get("cachedContentTokenCount", 0)
    if dialect == "stream":
        import json

        chunks = [json.loads(x[6:]) for x in resp.text.splitlines() if x.startswith("data: {")]
        u = chunks[-1]["usage"]
    else:
        u = resp.json()["usage"]
    return u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def _call(url: str, dialect: str) -> httpx.Response:
    msgs = [{"role": "user", "content": PROMPT}]
    if dialect == "messages":
        return httpx.post(
            url + "/v1/messages",
            json={"model": "fake", "max_tokens": 4, "messages": msgs},
            timeout=30,
        )
    if dialect == "gemini":
        body = {
            "contents": [{"parts": [{"text": PROMPT}]}],
            "generationConfig": {"maxOutputTokens": 4},
        }
        return httpx.post(url + "/v1beta/models/fake:generateContent", json=body, timeout=30)
    body = {"model": "fake", "max_tokens": 4, "messages": msgs}
    if dialect == "stream":
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


@pytest.fixture
def proxy_in_front(serve_fake):
    upstream, _ = serve_fake()
    proxy = BackgroundServer(
        lambda: create_proxy_app([upstream.url], GatewaySettings())
    ).__enter__()
    yield upstream, proxy
    proxy.close()


@pytest.mark.parametrize("dialect", ["chat", "stream", "messages", "gemini"])
def test_proxy_counts_the_tokens_its_upstreams_reported(proxy_in_front, dialect):
    upstream, proxy = proxy_in_front
    for _ in range(2):  # the second one hits the upstream's prefix cache
        before, up_before = _totals(proxy.url), _totals(upstream.url)
        resp = _call(proxy.url, dialect)
        assert resp.status_code == 200, resp.text
        prompt, completion, cached = _usage(dialect, resp)
        after, up_after = _totals(proxy.url), _totals(upstream.url)
        got = tuple(a - b for a, b in zip(after, before, strict=True))
        assert got == (prompt, completion, cached), dialect
        # the same numbers the upstream (a local gateway) counted for that request
        assert got == tuple(a - b for a, b in zip(up_after, up_before, strict=True))
    assert cached > 0
