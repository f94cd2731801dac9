"""``prefix_id`` and ``cache_salt`` (the gateway's own body fields) are answered alike by local
mode and proxy mode: one check (``wire.request_models.gateway_fields`` / the request models),
an empty value is its absence, a bad one the same 400 in the same words."""

from __future__ import annotations

import httpx
import pytest
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import FakeEngine, assert_idle_and_whole

BODIES = {
    "/v1/chat/completions": {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
    "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 2},
}
FIELDS = [
    {"cache_salt": ""},
    {"cache_salt": None},
    {"cache_salt": 5},
    {"cache_salt": "x" * 300},
    {"cache_salt": ["a"]},
    {"prefix_id": ""},
    {"prefix_id": None},
    {"prefix_id": 5},
    {"prefix_id": {"id": "p"}},
]


@pytest.fixture(scope="module")
def _both_modes():
    engine = FakeEngine()
    with BackgroundServer(lambda: create_app(engine, GatewaySettings(model_name="fake"))) as a:
        with BackgroundServer(lambda: create_proxy_app([a.url], GatewaySettings())) as p:
            yield a, engine, p


@pytest.fixture
def both_modes(_both_modes):
    """A local-mode gateway (model ``fake``) and a proxy in front of it: their URLs; each test
    ends with the engine idle and its pool whole."""
    a, engine, p = _both_modes
    yield a.url, p.url
    assert_idle_and_whole(a, engine)


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("extra", FIELDS, ids=repr)
def test_both_modes_answer_the_gateways_fields_alike(both_modes, path, extra):
    """Was: ``"cache_salt": ""`` 200 in local mode, 400 in proxy mode; a wrong type worded
    "cache_salt must be a string of 1 to 256 characters" / "prefix_id must be a string" by
    the proxy, "cache_salt: Input should be a valid string" by local mode."""
    answers = []
    for url in both_modes:
        r = httpx.post(url + path, json={**BODIES[path], **extra}, timeout=10)
        answers.append((r.status_code, r.json().get("error") if r.status_code != 200 else None))
    local, proxy = answers
    assert proxy == local, (local, proxy)
    if next(iter(extra.values())) in ("", None):
        assert local[0] == 200  # empty is absent
    else:
        assert local[0] == 400 and local[1]["param"] == next(iter(extra)), local
