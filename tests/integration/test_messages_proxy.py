"""Anthropic's Messages API through a proxy-mode gateway to a real prefixgate upstream on
aidreams-260k, driven by the official ``anthropic`` package: the upstream pins the cached
system block under the key's salt (written, then read by the next question; another key's
salt reads nothing), stream == non-stream at temperature 0, ``count_tokens`` == usage."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.gateway.app import create_proxy_app  # noqa: E402
from prefixgate.gateway.http.server import BackgroundServer  # noqa: E402
from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from prefixgate.gateway.settings import GatewaySettings  # noqa: E402
from support.gateway import module_server, wait_idle  # noqa: E402

MODEL = "aidreams"
upstream = module_server(MODEL, name="upstream", max_queued_requests=32)


@pytest.fixture(scope="module")
def proxy(upstream, tmp_path_factory) -> Iterator[BackgroundServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    specs = [{"key": "ka", "name": "a", "salt": "sa"}, {"key": "kb", "name": "b", "salt": "sb"}]
    keys.write_text(json.dumps({"keys": specs}))
    settings = GatewaySettings(keys_file=str(keys))
    with BackgroundServer(lambda: create_proxy_app([upstream.url], settings)) as gw:
        yield gw


def _client(proxy: BackgroundServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)


def _system(tag: str) -> list[dict]:
    text = f"[{tag}] " + "You are a friendly storyteller who tells short tales about animals. " * 2
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


def _total(u) -> int:
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


def test_a_cached_system_block_is_pinned_upstream_under_the_key_salt(upstream, proxy, pool_whole):
    system = _system(uuid.uuid4().hex[:8])
    a, b = _client(proxy, "ka"), _client(proxy, "kb")
    ask = [{"role": "user", "content": "Tell me a story."}]
    first = a.messages.create(
        model=MODEL, max_tokens=4, system=system, messages=ask, extra_body={"temperature": 0}
    )
    assert first.model == MODEL and first.usage.cache_creation_input_tokens >= 64
    counted = a.messages.count_tokens(model=MODEL, system=system, messages=ask)
    assert counted.input_tokens == _total(first.usage)
    upstream.call(upstream.app[LOCAL].cache_pins.settle)
    again = [{"role": "user", "content": "Now a different one, please."}]
    second = a.messages.create(
        model=MODEL, max_tokens=4, system=system, messages=again, extra_body={"temperature": 0}
    )
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    other = b.messages.create(
        model=MODEL, max_tokens=4, system=system, messages=again, extra_body={"temperature": 0}
    )
    assert other.usage.cache_read_input_tokens == 0  # another tenant's partition
    wait_idle(upstream, pool_whole, pinned_ok=True)


def test_stream_equals_whole_message_through_the_proxy(upstream, proxy, pool_whole):
    client = _client(proxy, "ka")
    kw = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "extra_body": {"temperature": 0},
    }
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert _total(streamed.usage) == _total(whole.usage)
    wait_idle(upstream, pool_whole, pinned_ok=True)
