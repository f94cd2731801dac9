"""Aborts never lost: clients that disconnect at random moments — before the answer, during
the stream, while a non-stream answer's tokens keep coming faster than the gateway's poll —
leave no request running and the pool whole, local and proxy mode, stream and non-stream
(the fake engine slowed to ``TOKEN_DELAY_S`` per token; a bounded loop of ``ROUNDS``)."""

from __future__ import annotations

import json
import random
import socket
import time

import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

ROUNDS = 24
TOKEN_DELAY_S = 0.01  # a token every 10 ms: faster than the gateway's poll (poll_s)
MAX_TOKENS = 2000


def _disconnect_after(url: str, body: dict, seconds: float) -> None:
    """Send ``body`` as a chat request on a raw socket, read for ``seconds``, then close."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        s.settimeout(0.01)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if not s.recv(65536):
                    break
            except TimeoutError:
                pass


def _stats(srv, engine) -> dict:
    async def get():
        return engine.stats()

    return srv.call(get)


def _idle(srv, engine, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(srv, engine)
        if (s["num_running"] == 0 and s["num_waiting"] == 0) or time.monotonic() > deadline:
            return s


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_random_disconnects_leave_nothing_running(serve_fake, mode):
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", poll_s=0.25),
        token_delay_s=TOKEN_DELAY_S,
        max_model_len=4096,
    )
    proxy = None
    url = srv.url
    if mode == "proxy":
        proxy = BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())).__enter__()
        url = proxy.url
    rng = random.Random(23)
    try:
        for i in range(ROUNDS):
            body = {
                "model": "fake",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": MAX_TOKENS,  # 20 s of tokens: every client leaves long before
                "stream": i % 2 == 0,
            }
            _disconnect_after(url, body, rng.uniform(0.0, 0.4))
        stats = _idle(srv, engine, timeout=60)
        print(mode, "after", ROUNDS, "disconnects:", stats, "tokens generated:", engine.generated)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
        assert stats["kv_blocks_used"] == stats["pinned_blocks"], stats
        # every request was aborted soon after its client left (at most 0.4 s in): none ran
        # on towards its MAX_TOKENS (a lost abort alone would add ~2,000 tokens)
        assert engine.generated < ROUNDS * 200, engine.generated
    finally:
        if proxy is not None:
            proxy.close()


def test_an_abort_interrupted_by_a_second_cancel_still_completes():
    """The client's disconnect cancels the handler; the shutdown's ending cancels it again
    while ``ChoiceRun`` is aborting: the abort (shielded) still ends every engine request."""
    import asyncio

    from prefixgate.engine.protocol import EngineRequest
    from prefixgate.engine.sampling_params import SamplingParams
    from prefixgate.gateway.local.generation import ChoiceRun
    from support.fake_engine import FakeEngine

    class SlowAbort(FakeEngine):
        async def abort(self, request_id: str) -> None:
            await asyncio.sleep(0.2)  # a step in progress holds the engine's lock
            await super().abort(request_id)

    async def scenario() -> dict:
        engine = SlowAbort(token_delay_s=0.01, max_model_len=4096)
        requests = [
            EngineRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2000)) for i in range(2)
        ]

        async def handler() -> None:
            async with ChoiceRun(engine, requests) as run:
                while True:
                    await run.next(0.05)

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0.1)
        task.cancel()  # the client left: __aexit__ starts aborting
        await asyncio.sleep(0.05)
        task.cancel()  # the shutdown ends it again, mid-abort
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(200):  # the shielded abort finishes in the background
            if engine.stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.01)
        generated = engine.generated
        await asyncio.sleep(0.1)
        return {**engine.stats(), "grew": engine.generated - generated}

    stats = asyncio.run(scenario())
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0, stats
    assert stats["grew"] == 0, stats  # nothing generates on for a client that is gone
