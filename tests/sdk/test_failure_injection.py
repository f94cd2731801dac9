"""Failure injection on loopback: 429s with Retry-After and connections dropped mid-body.

1,000 requests must all succeed, and the server (counting on its side) must never see more
than ``max_concurrency`` of them at once.
"""

from __future__ import annotations

import json
import random

import anyio
import pytest
from aiohttp import web
from prefixgate.sdk import AsyncClient, RetryPolicy

pytestmark = pytest.mark.anyio

N = 1000
MAX_CONCURRENCY = 16
DROPS = 0.05  # share of requests dropped mid-body (each costs a new TCP connection)


class FlakyServer:
    """Answers 20 % of requests 429 (retry-after-ms 1-10), drops ``DROPS`` mid-body, else 200."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.in_flight = 0
        self.peak = 0
        self.counts = {"ok": 0, "429": 0, "drop": 0}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        done = False
        try:
            body = await request.json()
            await anyio.sleep(self.rng.uniform(0, 0.003))
            roll = self.rng.random()
            text = body["messages"][-1]["content"]
            payload = json.dumps(
                {"id": text, "choices": [{"index": 0, "message": {"content": text[::-1]}}]}
            ).encode()
            if roll < 0.2:
                self.counts["429"] += 1
                return web.json_response(
                    {"error": {"message": "busy", "type": "rate_limit_error", "code": None}},
                    status=429,
                    headers={"retry-after-ms": str(self.rng.randint(1, 10))},
                )
            if roll < 0.2 + DROPS:
                self.counts["drop"] += 1
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                resp.content_length = len(payload)
                await resp.prepare(request)
                await resp.write(payload[: len(payload) // 2])
                self.in_flight -= 1  # counted out before the client can learn of the drop
                done = True
                request.transport.close()
                return resp
            self.counts["ok"] += 1
            return web.Response(body=payload, content_type="application/json")
        finally:
            if not done:
                self.in_flight -= 1


async def test_thousand_requests_zero_failures_bounded_concurrency(serve) -> None:
    server = FlakyServer()
    base = await serve({("POST", "/v1/chat/completions"): server.handle})
    policy = RetryPolicy(max_retries=12, initial_delay=0.005, max_delay=0.05)
    reqs = [{"model": "m", "messages": [{"role": "user", "content": f"req-{i}"}]} for i in range(N)]
    async with AsyncClient(base, max_concurrency=MAX_CONCURRENCY, retry_policy=policy) as client:
        with anyio.fail_after(60):
            results = await client.chat.completions.batch(reqs)
        assert client.limiter.in_flight == 0
    failures = [r for r in results if isinstance(r, Exception)]
    assert failures == []
    assert [r.id for r in results] == [f"req-{i}" for i in range(N)]
    assert results[5].choices[0].message.content == "5-qer"
    assert server.counts["ok"] == N
    assert server.counts["429"] > 100 and server.counts["drop"] > 20
    assert server.peak <= MAX_CONCURRENCY
    assert server.peak >= MAX_CONCURRENCY // 2  # the limit is actually used
