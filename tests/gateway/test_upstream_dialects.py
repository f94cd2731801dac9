"""Each OpenAI-compatible upstream kind's own fields (``proxy/upstream_fields.py``), read the
same way through the Messages dialect: the matched stop (vLLM's ``stop_reason``, SGLang's
``matched_stop``, none from llama.cpp) and cached tokens (a count, or unknown: ``null``, never
0, and no cache miss learned). Stub upstreams (``support.chat_stub.ChatStub(kind=...)``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream_fields import (
    UPSTREAM_FIELDS,
    cached_tokens,
    matched_stop,
)
from prefixgate.gateway.settings import GatewaySettings
from support.chat_stub import ChatStub

SYSTEM = "You are the harbour master's assistant, who answers in short sentences. " * 2


@pytest.fixture
def serve() -> Iterator:
    opened: list[BackgroundServer] = []

    def start(stub: ChatStub, replicas: int = 1, **settings) -> BackgroundServer:
        urls = []
        for _ in range(replicas):
            opened.append(BackgroundServer(stub.app).__enter__())
            urls.append(opened[-1].url)
        gw = BackgroundServer(lambda: create_proxy_app(urls, GatewaySettings(**settings)))
        gw.__enter__()
        opened.append(gw)
        return gw

    yield start
    for srv in reversed(opened):
        srv.close()


def _ask(gw: BackgroundServer, **extra) -> anthropic.types.Message:
    client = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)
    return client.messages.create(
        model="llama",
        max_tokens=8,
        system=SYSTEM,
        messages=[{"role": "user", "content": "hi"}],
        **extra,
    )


def _ask_stream(gw: BackgroundServer, **extra) -> tuple[anthropic.types.Message, list[dict]]:
    """The final message (as the anthropic package builds it) and the raw events."""
    client = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)
    ask = {
        "model": "llama",
        "max_tokens": 8,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    raw = httpx.post(gw.url + "/v1/messages", json={**ask, "stream": True}).text
    events = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: ")]
    return final, events


@pytest.mark.parametrize(
    "kind, expected",
    [("vllm", ("stop_sequence", "END")), ("sglang", ("stop_sequence", "END")),
     ("llamacpp", ("end_turn", None))],
)  # fmt: skip
def test_the_matched_stop_of_each_upstream_kind(serve, kind, expected):
    gw = serve(ChatStub(kind=kind, stop_reason="END"))
    msg = _ask(gw, stop_sequences=["END"])
    assert (msg.stop_reason, msg.stop_sequence) == expected
    final, _ = _ask_stream(gw, stop_sequences=["END"])
    assert (final.stop_reason, final.stop_sequence) == expected


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_stop_token_id_is_no_stop_sequence(serve, kind):
    stub = ChatStub(kind=kind)
    stub.stop_reason = 2  # type: ignore[assignment]  # an EOS token id
    msg = _ask(serve(stub), stop_sequences=["END"])
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp"])
def test_cached_tokens_reported_are_relayed(serve, kind):
    gw = serve(ChatStub(kind=kind, cached=8))
    msg = _ask(gw)
    assert msg.usage.cache_read_input_tokens == 8
    assert msg.usage.input_tokens == len(SYSTEM) + len("hi") - 8
    final, _ = _ask_stream(gw)
    assert final.usage.cache_read_input_tokens == 8


def test_cached_tokens_not_reported_are_null_not_zero(serve):
    """vLLM without --enable-prompt-tokens-details: ``prompt_tokens_details: null``."""
    gw = serve(ChatStub(cached=None))
    msg = _ask(gw)
    assert msg.usage.cache_read_input_tokens is None
    assert msg.usage.input_tokens == len(SYSTEM) + len("hi")
    final, events = _ask_stream(gw)
    assert final.usage.cache_read_input_tokens is None
    start = next(e for e in events if e["type"] == "message_start")
    delta = next(e for e in events if e["type"] == "message_delta")
    assert start["message"]["usage"]["cache_read_input_tokens"] is None
    assert delta["usage"]["cache_read_input_tokens"] is None


@pytest.mark.parametrize("cached, misses", [(None, 0), (0, 1)])
def test_unknown_cached_tokens_are_no_cache_miss(serve, cached, misses):
    """cache_aware routing learns a miss from a reported 0 on a prompt it predicted cached,
    never from an unreported count."""
    gw = serve(ChatStub(cached=cached), replicas=2, routing="cache_aware")
    for _ in range(2):
        _ask(gw)
    assert sum(u.cache_misses for u in gw.app[PROXY].router.upstreams) == misses


def test_the_readers():
    assert matched_stop({"stop_reason": "x"}) == "x"
    assert matched_stop({"stop_reason": None, "matched_stop": 7}) == 7
    assert matched_stop({"matched_stop": True}) is None and matched_stop({}) is None
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 3}}) == 3
    assert cached_tokens({"prompt_tokens_details": None}) is None
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": -1}}) is None
    assert cached_tokens(None) is None
    assert {f.kind for f in UPSTREAM_FIELDS} == {"vllm", "sglang", "llama.cpp", "prefixgate"}


@pytest.mark.parametrize("cached, reported", [(None, False), (8, True)])
def test_ready_says_whether_an_upstream_reports_cached_tokens(serve, cached, reported):
    gw = serve(ChatStub(cached=cached))
    before = httpx.get(gw.url + "/ready").json()["upstreams"][0]
    assert before["reports_cached_tokens"] is None  # no answer yet
    _ask(gw)
    (up,) = httpx.get(gw.url + "/ready").json()["upstreams"]
    assert up["reports_cached_tokens"] is reported and up["kv_events"] is None
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
    httpx.post(gw.url + "/v1/chat/completions", json=body)
    (up,) = httpx.get(gw.url + "/ready").json()["upstreams"]
    assert up["reports_cached_tokens"] is reported
