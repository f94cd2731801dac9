"""Prefix API limits: a client gone while pinning leaks no pin; the prefix count holds under
concurrency and a 429's Retry-After is the time to the next expiry."""

from __future__ import annotations

from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error as _error


def _slow_pins(engine, delay_s: float = 0.3) -> None:
    """Make ``engine.pin_prefix`` behave like the AsyncEngine's: the pin job runs on its own
    (the engine thread) and the caller only awaits its result, so a cancelled caller does not
    stop the pin from landing."""
    import asyncio

    plain = engine.pin_prefix
    jobs = set()

    async def pin_prefix(pin):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        async def job():
            await asyncio.sleep(delay_s)
            try:
                held = await plain(pin)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                if not fut.done():
                    fut.set_exception(exc)
                return
            if not fut.done():
                fut.set_result(held)
            else:  # the caller was cancelled: released on landing, as AsyncEngine.pin_prefix does
                engine.unpin_prefix(held.id)

        task = loop.create_task(job())
        jobs.add(task)
        task.add_done_callback(jobs.discard)
        return await fut

    engine.pin_prefix = pin_prefix


def _prefix_body(i: int = 0, ttl: float = 600) -> dict:
    return {
        "model": "fake",
        "ttl_seconds": ttl,
        "messages": [{"role": "system", "content": f"system prompt number {i} " * 4}],
    }


def test_client_gone_while_pinning_leaks_no_pin(serve_fake, gw):
    # A client that gave up during POST /v1/prefixes left its pin in the engine, known to no
    # one, holding KV blocks for the whole TTL (an hour here; up to a day).
    import time

    import httpx

    srv, engine = serve_fake()
    _slow_pins(engine)
    with gw.client(srv) as http:
        for i in range(3):
            try:
                http.post("/v1/prefixes", json=_prefix_body(i, 3600), timeout=0.05)
            except httpx.TimeoutException:
                pass
        time.sleep(0.8)
        assert engine.pinned_blocks == 0, engine.stats()
        r = http.post("/v1/prefixes", json=_prefix_body(9))
        assert r.status_code == 200 and engine.pinned_blocks > 0
        assert http.delete(f"/v1/prefixes/{r.json()['id']}").status_code == 200
    assert engine.pinned_blocks == 0


def test_prefix_limits_hold_under_concurrency_and_retry_after_is_the_next_expiry(serve_fake, gw):
    # max_prefixes was checked before the pin was awaited: 6 concurrent creates all passed a
    # bound of 2. Retry-After was a fixed 60 s (pinned space full) or the *new* prefix's TTL
    # (too many prefixes), not the time until a live prefix expires.
    import threading

    srv, engine = serve_fake(GatewaySettings(model_name="fake", max_prefixes=2))
    _slow_pins(engine, 0.2)
    codes = []

    def create(i):
        with gw.client(srv) as http:
            codes.append(http.post("/v1/prefixes", json=_prefix_body(i, 5)).status_code)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200, 200, 429, 429, 429, 429], codes
    with gw.client(srv) as http:
        r = http.post("/v1/prefixes", json=_prefix_body(7, 600))
        _error(r, 429, code="prefix_limit_exceeded")
        assert 1 <= int(r.headers["Retry-After"]) <= 5, r.headers
    srv2, engine2 = serve_fake(num_blocks=16, max_pinned_fraction=0.5)  # 8 pinnable blocks
    with gw.client(srv2) as http:
        body = {
            "model": "fake",
            "ttl_seconds": 4,
            "messages": [{"role": "system", "content": "y" * 90}],
        }  # 5 full blocks
        assert http.post("/v1/prefixes", json=body).status_code == 200
        r = http.post(
            "/v1/prefixes",
            json=dict(body, ttl_seconds=600, messages=[{"role": "system", "content": "z" * 90}]),
        )
        _error(r, 429, code="prefix_limit_exceeded")
        assert 1 <= int(r.headers["Retry-After"]) <= 4, r.headers
