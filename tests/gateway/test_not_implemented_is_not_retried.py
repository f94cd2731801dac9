"""A 501 (a route the model's upstream does not serve: ``/v1/embeddings`` behind a proxy in front
of an OpenAI-compatible server without it) carries
``x-should-retry: false``, which the OpenAI and Anthropic SDKs obey: with their default
``max_retries`` (2) they sent the same refused request three times, with backoff, before
raising."""

from __future__ import annotations

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.settings import GatewaySettings
from support.chat_stub import ChatStub

openai = pytest.importorskip("openai")


@pytest.fixture
def proxy(servers):
    upstream = servers(ChatStub(name="fake").app)  # chat completions, no /v1/embeddings
    return servers(lambda: create_proxy_app([upstream.url], GatewaySettings()))


def test_a_501_is_sent_once_by_the_openai_client(proxy):
    sent: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.url.path)]})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", http_client=http)
    with pytest.raises(openai.APIStatusError) as err:
        client.embeddings.create(model="fake", input="hi")
    assert err.value.status_code == 501
    assert err.value.response.headers["x-should-retry"] == "false"
    assert sent == ["/v1/embeddings"]  # once: no retries
    # a retryable refusal keeps no such header
    r = httpx.post(proxy.url + "/v1/chat/completions", content=b"{", timeout=10)
    assert r.status_code == 400 and "x-should-retry" not in r.headers
