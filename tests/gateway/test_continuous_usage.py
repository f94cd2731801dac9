"""vLLM's ``stream_options.continuous_usage_stats`` in local mode: every chunk of a chat or
completions stream carries the usage so far, the stream still ends with the usage chunk
(``include_usage`` defaults to true beside it, as in vLLM); beside ``include_usage: false``,
or not a boolean, it is a 400 naming it."""

from __future__ import annotations

import json

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

from tests.support.gateway import module_server

MODEL = "aidreams-260k"
server = module_server(MODEL)
CHAT = {"messages": [{"role": "user", "content": "Once upon a time"}]}
COMP = {"prompt": "Once upon a time"}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _chunks(http: httpx.Client, path: str, body: dict) -> list[dict]:
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body}
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


@pytest.mark.parametrize(
    ("path", "extra"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMP)]
)
@pytest.mark.parametrize("include", [True, None])
def test_every_chunk_carries_the_usage_so_far(http, path, extra, include):
    options = {"continuous_usage_stats": True}
    if include is not None:
        options["include_usage"] = include
    chunks = _chunks(http, path, {**extra, "stream_options": options})
    *answer, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    prompt = last["usage"]["prompt_tokens"]
    seen = [c["usage"]["completion_tokens"] for c in answer]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in answer)
    assert all(
        c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in answer
    )
    assert seen == sorted(seen) and seen[-1] == 6 and seen[0] < 6


def test_without_it_only_the_last_chunk_has_usage(http):
    chunks = _chunks(http, "/v1/completions", {**COMP, "stream_options": {"include_usage": True}})
    assert all(c.get("usage") is None for c in chunks[:-1]) and chunks[-1]["usage"]


@pytest.mark.parametrize(
    "options",
    [{"continuous_usage_stats": True, "include_usage": False}, {"continuous_usage_stats": 1}],
)
def test_bad_continuous_usage_stats_is_a_400_naming_it(http, options):
    for path, extra in (("/v1/chat/completions", CHAT), ("/v1/completions", COMP)):
        body = {"model": MODEL, "stream": True, "stream_options": options, **extra}
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text


def test_a_proxy_passes_every_chunk_s_usage_and_the_last_chunk(server):
    """The proxy asks its upstream for usage unless the client did: beside
    ``continuous_usage_stats`` (which asks for it) it passes the usage chunk on, as local mode
    sends it, instead of dropping it as one it asked for itself."""
    settings = GatewaySettings(health_check_timeout_s=60.0)
    with BackgroundServer(lambda: create_proxy_app([server.url], settings)) as proxy:
        with httpx.Client(base_url=proxy.url, timeout=60) as http:
            body = {**COMP, "stream_options": {"continuous_usage_stats": True}}
            *answer, last = _chunks(http, "/v1/completions", body)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert all(c["usage"] for c in answer)
