"""A client that leaves an embeddings request does not free its admission place while the
engine's worker thread still computes its vectors (that work cannot be aborted): requests
sent and abandoned would otherwise queue unbounded work behind an empty admission count."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from prefixgate.gateway.app import create_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.state import STATE
from support.fake_engine import FakeEngine


class _SlowEmbedder(FakeEngine):
    """``embed_async`` in a worker thread that runs until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = threading.Event()

    def _embed(self, inputs: list[list[int]]) -> list[list[float]]:
        self.started.set()
        self.release.wait(30)
        return [[1.0, 0.0] for _ in inputs]

    async def embed_async(self, inputs: list[list[int]]) -> list[list[float]]:
        return await asyncio.to_thread(self._embed, inputs)


def _wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_abandoned_embeddings_hold_admission_until_the_worker_ends():
    engine = _SlowEmbedder()
    srv = BackgroundServer(
        lambda: create_app(engine, GatewaySettings(model_name="fake"))
    ).__enter__()
    try:
        admission = srv.app[STATE].admission
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                srv.url + "/v1/embeddings",
                json={"model": "fake", "input": "hello"},
                timeout=httpx.Timeout(10, read=0.3),
            )
        assert engine.started.wait(10)
        time.sleep(0.3)  # the handler has been cancelled by now
        assert admission.in_flight == 1  # the vectors are still being computed
        engine.release.set()
        _wait(lambda: admission.in_flight == 0)
    finally:
        engine.release.set()
        srv.close()
