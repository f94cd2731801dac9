"""The real gateway on loopback serving aidreams-260k refuses what the engine would mishandle,
with the documented OpenAI error, and the pool stays whole."""

from __future__ import annotations

import time

import httpx
import pytest
from prefixgate.gateway.http.server import BackgroundServer

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.engine import AsyncEngine, EngineConfig  # noqa: E402
from prefixgate.gateway.app import create_app  # noqa: E402
from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error  # noqa: E402

MODEL = "aidreams-260k"


def _error(r, status, param=None):
    return assert_openai_error(r, status, param=param)


@pytest.fixture(scope="module")
def server(aidreams_path):
    def make():
        engine = AsyncEngine(EngineConfig(model=aidreams_path, num_kv_blocks=256))
        return create_app(
            engine, GatewaySettings(model_name=MODEL, poll_s=0.02, max_queued_requests=32)
        )

    srv = BackgroundServer(make).__enter__()
    yield srv
    srv.call(srv.app[LOCAL].engine.shutdown)
    srv.close()


def _raw(body: str) -> dict:
    return {"content": body.encode(), "headers": {"content-type": "application/json"}}


def test_gateway_refuses_what_the_engine_would_mishandle(server, pool_whole):
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    base = (
        '{"model": "'
        + MODEL
        + '", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4'
    )
    with httpx.Client(base_url=server.url, timeout=60) as http:
        ref = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        for field in ("repetition_penalty", "temperature"):
            for literal in ("Infinity", "NaN"):
                _error(
                    http.post("/v1/chat/completions", **_raw(f'{base}, "{field}": {literal}}}')),
                    400,
                    field,
                )
        for seed in (2**64, -(2**63) - 1):
            err = _error(http.post("/v1/chat/completions", json=dict(chat, seed=seed)), 400, "seed")
            assert "long long" not in err["message"]
        r = http.post("/v1/chat/completions", json=dict(chat, seed=2**63 - 1, n=2))
        assert r.status_code == 200, r.text
        # a batch of 3 prompts x n=16 is 48 engine requests > the queue's 32
        _error(
            http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": ["a"] * 3, "n": 16, "max_tokens": 2},
            ),
            400,
            "prompt",
        )
        assert http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"] == ref
    engine = server.app[LOCAL].engine
    for _ in range(200):
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        time.sleep(0.02)
    pool_whole(engine, pinned_ok=False)
