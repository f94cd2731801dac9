"""Local embeddings refuse before working: an input too long for the context is refused from
its UTF-8 length before it is tokenized (the bound ``/tokenize`` and the generation routes
use, ``wire.prompts.refuse_oversized``), and a body over the admission bound is told in
embeddings' words (inputs), not completions' (prompts x n)."""

from __future__ import annotations

import time

import httpx
from prefixgate.gateway.app import create_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import FakeEngine, FakeTokenizer


class _Embedder(FakeEngine):
    """A fake engine serving embeddings (one 2-float vector per input)."""

    async def embed_async(self, inputs: list[list[int]]) -> list[list[float]]:
        return [[1.0, 0.0] for _ in inputs]


def _serve(settings: GatewaySettings) -> BackgroundServer:
    return BackgroundServer(lambda: create_app(_Embedder(), settings)).__enter__()


def test_huge_input_refused_before_tokenizing():
    srv = _serve(GatewaySettings(model_name="fake", max_body_bytes=8 << 20))
    try:
        huge = "x" * 4_000_000
        before = FakeTokenizer.encoded_bytes
        t0 = time.monotonic()
        r = httpx.post(
            srv.url + "/v1/embeddings", json={"model": "fake", "input": ["ok", huge]}, timeout=30
        )
        took = time.monotonic() - t0
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "input"
        assert "input 1" in err["message"] and "not tokenized" in err["message"]
        assert FakeTokenizer.encoded_bytes - before < 1000  # the 4 MB were never tokenized
        assert took < 5.0
        # an input of max_model_len tokens (BOS + 127 bytes) fits and is embedded
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "fake", "input": "y" * 127})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 128
    finally:
        srv.close()


def test_too_many_inputs_refused_in_embeddings_words():
    srv = _serve(GatewaySettings(model_name="fake", max_queued_requests=4))
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "fake", "input": ["a"] * 5})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "too_many_requests_in_body" and err["param"] == "input"
        assert err["message"] == (
            "this request asks for 5 embeddings (one per input); the server admits at most 4 "
            "at once: send fewer inputs per request"
        )
        assert "prompts" not in err["message"]
    finally:
        srv.close()
