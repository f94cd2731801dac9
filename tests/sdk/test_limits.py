"""Concurrency limit (server-side count), cancellation freeing slots, AIMD, client rate limit."""

from __future__ import annotations

import anyio
import httpx
import pytest
from aiohttp import web
from prefixgate.sdk import AsyncClient, ConcurrencyLimiter, RateLimit, RateLimiter
from prefixgate.sdk.limits import estimate_tokens

pytestmark = pytest.mark.anyio

OK = {"id": "c1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}}]}
MSG = [{"role": "user", "content": "hi"}]


class Counter:
    """Counts requests in flight on the server side."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.now = 0
        self.peak = 0
        self.total = 0

    async def handler(self, request: web.Request) -> web.Response:
        self.now += 1
        self.total += 1
        self.peak = max(self.peak, self.now)
        try:
            await request.read()
            await anyio.sleep(self.delay)
            return web.json_response(OK)
        finally:
            self.now -= 1


async def test_shared_limit_across_calls_counted_on_server(serve) -> None:
    counter = Counter(delay=0.02)
    base = await serve({("POST", "/v1/chat/completions"): counter.handler})
    async with AsyncClient(base, max_concurrency=5) as client:
        async with anyio.create_task_group() as tg:
            for _ in range(40):
                tg.start_soon(lambda: client.chat.completions.create(model="m", messages=MSG))
    assert counter.total == 40 and counter.peak == 5


async def test_cancelled_requests_free_their_slots_no_pool_timeout(serve) -> None:
    counter = Counter(delay=5.0)
    fast = Counter(delay=0.0)
    base = await serve(
        {
            ("POST", "/v1/chat/completions"): counter.handler,
            ("POST", "/v1/completions"): fast.handler,
        }
    )
    timeout = httpx.Timeout(10.0, pool=0.5)
    async with AsyncClient(base, max_concurrency=3, timeout=timeout) as client:
        for _ in range(3):  # several rounds of cancelling every in-flight request
            with anyio.move_on_after(0.2):
                async with anyio.create_task_group() as tg:
                    for _ in range(20):
                        tg.start_soon(
                            lambda: client.chat.completions.create(model="m", messages=MSG)
                        )
            assert client.limiter.in_flight == 0
        with anyio.fail_after(3):
            async with anyio.create_task_group() as tg:
                for _ in range(10):
                    tg.start_soon(lambda: client.completions.create(model="m", prompt="p"))
    assert fast.total == 10


def test_aimd_shrinks_once_per_window_and_grows_back() -> None:
    lim = ConcurrencyLimiter(16, adaptive=True)
    a, b = anyio.run(lambda: _two_slots(lim))
    lim.on_overload(a)
    assert lim.limit == 8
    lim.on_overload(b)  # admitted before the decrease: same window, no second cut
    assert lim.limit == 8
    for _ in range(8):
        lim.on_success()
    assert lim.limit == 9
    for _ in range(9 + 10 + 11 + 12 + 13 + 14 + 15):
        lim.on_success()
    assert lim.limit == 16
    for _ in range(100):
        lim.on_success()
    assert lim.limit == 16  # never above max_concurrency


async def _two_slots(lim: ConcurrencyLimiter):
    return await lim.acquire(), await lim.acquire()


def test_aimd_floor_and_off_by_default() -> None:
    lim = ConcurrencyLimiter(4, adaptive=True, min_concurrency=2)
    for _ in range(5):
        (slot,) = anyio.run(lambda: _one(lim))
        lim.on_overload(slot)
        lim.release(slot)
    assert lim.limit == 2
    plain = ConcurrencyLimiter(4)
    (slot,) = anyio.run(lambda: _one(plain))
    plain.on_overload(slot)
    assert plain.limit == 4
    with pytest.raises(ValueError):
        ConcurrencyLimiter(0)


async def _one(lim: ConcurrencyLimiter):
    return (await lim.acquire(),)


async def test_adaptive_limit_applies_to_new_requests(serve) -> None:
    state = {"now": 0, "peak_after": 0, "rejected": False}

    async def handler(request: web.Request) -> web.Response:
        state["now"] += 1
        try:
            if not state["rejected"]:
                state["rejected"] = True
                return web.json_response(
                    {"error": {"message": "slow down"}},
                    status=429,
                    headers={"retry-after-ms": "50"},
                )
            state["peak_after"] = max(state["peak_after"], state["now"])
            await anyio.sleep(0.02)
            return web.json_response(OK)
        finally:
            state["now"] -= 1

    base = await serve({("POST", "/v1/chat/completions"): handler})
    async with AsyncClient(base, max_concurrency=8, adaptive_concurrency=True) as client:
        await client.chat.completions.create(model="m", messages=MSG)  # 429, then OK
        assert client.limiter.limit == 4
        async with anyio.create_task_group() as tg:
            for _ in range(16):
                tg.start_soon(lambda: client.chat.completions.create(model="m", messages=MSG))
    assert state["peak_after"] <= 6  # 4 after the cut, +1 per 4 then 5 successes


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)


async def test_rate_limiter_paces_requests_per_minute() -> None:
    clock = FakeClock()
    rl = RateLimiter(RateLimit(requests_per_minute=600), clock=clock, sleep=clock.sleep)  # 10/s
    for _ in range(4):  # default: no burst, even pacing 0.1 s apart (queued callers wait longer)
        await rl.acquire()
    assert clock.waits == pytest.approx([0.1, 0.2, 0.3])
    clock.t = 5.0  # idle long enough: the next goes at once
    clock.waits.clear()
    await rl.acquire()
    assert clock.waits == []
    burst = RateLimiter(
        RateLimit(requests_per_minute=600, burst_seconds=1.0), clock=clock, sleep=clock.sleep
    )
    for _ in range(11):  # depth 1 s = 10 requests, then pacing
        await burst.acquire()
    assert clock.waits == pytest.approx([0.1])


async def test_rate_limiter_tokens_per_minute_with_correction() -> None:
    clock = FakeClock()
    rl = RateLimiter(
        RateLimit(tokens_per_minute=6000, burst_seconds=1.0), clock=clock, sleep=clock.sleep
    )  # 100 tokens/s, depth 100
    await rl.acquire(100)  # bucket depth 100: fits
    await rl.acquire(50)  # 50 in debt: waits 0.5 s
    assert clock.waits == pytest.approx([0.5])
    rl.correct(estimated=50, actual=10)  # used less than estimated: refund 40
    await rl.acquire(20)
    assert clock.waits[-1] == pytest.approx(0.3)


def test_rate_limit_validation_and_estimate() -> None:
    with pytest.raises(ValueError):
        RateLimit(requests_per_minute=0)
    body = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10, "n": 2}
    assert estimate_tokens(body) == 10 + 20
    assert estimate_tokens({"prompt": "abcd"}) == 1 + 256


async def test_adaptive_cooldown_holds_new_attempts_until_retry_after() -> None:
    """A 429 with a wait hint holds every new attempt of the client until it has passed."""
    clock = FakeClock()

    async def sleep(seconds: float) -> None:
        clock.waits.append(seconds)
        clock.t += seconds

    limiter = ConcurrencyLimiter(4, adaptive=True, clock=clock, sleep=sleep)
    slot = await limiter.acquire()
    assert clock.waits == []
    limiter.on_overload(slot, retry_after=2.5)
    limiter.release(slot)
    await limiter.acquire()
    assert clock.waits == [2.5]  # waited out the cool-down, once
    await limiter.acquire()
    assert clock.waits == [2.5]  # over: no further wait
    plain = ConcurrencyLimiter(4, clock=clock, sleep=sleep)  # not adaptive: no cool-down
    plain.on_overload(await plain.acquire(), retry_after=9.0)
    await plain.acquire()
    assert clock.waits == [2.5]


async def test_adaptive_429_keeps_its_slot_for_the_retry(serve) -> None:
    """In adaptive mode a rejected call retries in the slot it holds (no newcomer takes it)."""
    seen_in_flight: list[int] = []
    calls = {"n": 0}

    async def handler(request: web.Request) -> web.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            return web.json_response(
                {"error": {"message": "slow down"}}, status=429, headers={"retry-after-ms": "10"}
            )
        return web.json_response(OK)

    base = await serve({("POST", "/v1/chat/completions"): handler})
    async with AsyncClient(base, max_concurrency=2, adaptive_concurrency=True) as client:
        policy = client.retry_policy

        async def recording_sleep(seconds: float) -> None:
            seen_in_flight.append(client.limiter.in_flight)

        policy.sleep = recording_sleep
        await client.chat.completions.create(model="m", messages=MSG)
        assert seen_in_flight == [1]  # the slot was held through the retry wait
        assert client.limiter.in_flight == 0  # and released at the end
