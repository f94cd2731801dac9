"""Concurrency limit (server-side count), cancellation freeing slots, AIMD, client rate limit."""

from __future__ import annotations

import anyio
import httpx
import pytest
import respx
from aiohttp import web
from prefixgate.sdk import (
    AsyncClient,
    ConcurrencyLimiter,
    RateLimit,
    RateLimiter,
    RateLimitError,
    RetryPolicy,
)
from prefixgate.sdk.flow_control import estimate_tokens

from .conftest import MSG, OK

pytestmark = pytest.mark.anyio


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


async def test_retries_queue_ahead_of_first_attempts_within_the_limit() -> None:
    """A retry waits for a slot like every attempt (in flight never exceeds the limit, even
    right after a decrease) but is served before calls making their first attempt."""
    lim = ConcurrencyLimiter(4, adaptive=True)
    held = [await lim.acquire() for _ in range(4)]
    lim.on_overload(held[0])  # limit 4 -> 2 while 4 are in flight
    assert lim.limit == 2
    order: list[str] = []

    async def take(name: str, retry: bool) -> None:
        slot = await lim.acquire(retry=retry)
        order.append(name)
        assert lim.in_flight <= lim.limit
        lim.release(slot)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "first-a", False)
        tg.start_soon(take, "first-b", False)
        await anyio.sleep(0.01)
        tg.start_soon(take, "retry", True)
        await anyio.sleep(0.01)
        assert order == [] and lim.waiting == 3
        lim.release(held.pop())
        lim.release(held.pop())  # 2 in flight: still at the limit, nobody admitted
        await anyio.sleep(0.01)
        assert order == []
        lim.release(held.pop())  # a slot under the limit: the retry goes first
        await anyio.sleep(0.01)
        assert order[0] == "retry"
        lim.release(held.pop())
    assert order == ["retry", "first-a", "first-b"]
    assert lim.in_flight == 0 and lim.waiting == 0


async def test_cancelled_waiter_holds_nothing() -> None:
    lim = ConcurrencyLimiter(1)
    slot = await lim.acquire()
    with anyio.move_on_after(0.05):
        await lim.acquire()
    assert lim.waiting == 0 and lim.in_flight == 1
    lim.release(slot)
    lim.release(slot)  # idempotent
    assert lim.in_flight == 0
    assert (await lim.acquire()) is not None and lim.in_flight == 1


async def test_rate_charge_refunded_when_cancelled_while_pacing() -> None:
    """A call cancelled while the rate limiter makes it wait never reached the server: it
    costs nothing, and the next caller waits as if it had never come."""
    clock = FakeClock()
    waiting = anyio.Event()

    async def sleep(seconds: float) -> None:
        clock.waits.append(seconds)
        waiting.set()
        await anyio.sleep_forever()

    rl = RateLimiter(RateLimit(requests_per_minute=60), clock=clock, sleep=sleep)  # 1/s
    await rl.acquire()  # the bucket's one request: no wait
    async with anyio.create_task_group() as tg:
        tg.start_soon(rl.acquire)  # must wait 1 s
        await waiting.wait()
        tg.cancel_scope.cancel()
    assert clock.waits == [pytest.approx(1.0)]
    paced = RateLimiter(RateLimit(requests_per_minute=60), clock=clock, sleep=clock.sleep)
    await paced.acquire()
    clock.waits.clear()
    await paced.acquire()
    reference = clock.waits[-1]
    clock.waits.clear()
    rl._sleep = clock.sleep  # type: ignore[method-assign]
    await rl.acquire()  # the cancelled call's charge was refunded: same wait as one-behind
    assert clock.waits == [pytest.approx(reference)]


async def test_call_cancelled_in_the_concurrency_queue_costs_no_rate_budget(serve) -> None:
    """Cancelled while waiting for a concurrency slot (after the rate limiter let it through),
    a call gives its request and token charge back and holds no slot."""
    release = anyio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response(OK)

    base = await serve({("POST", "/v1/chat/completions"): slow})
    limit = RateLimit(requests_per_minute=60, tokens_per_minute=60_000, burst_seconds=60)
    async with AsyncClient(base, max_concurrency=1, rate_limit=limit) as client:
        rl = client.rate_limiter
        assert rl is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: client.chat.completions.create(model="m", messages=MSG))
            await anyio.sleep(0.2)  # the first call holds the only slot
            levels = (rl._requests.level, rl._tokens.level)  # type: ignore[union-attr]
            with anyio.move_on_after(0.2):
                await client.chat.completions.create(model="m", messages=MSG, max_tokens=999)
            assert client.limiter.in_flight == 1 and client.limiter.waiting == 0
            after = (rl._requests.level, rl._tokens.level)  # type: ignore[union-attr]
            # refunded: only the refill of the 0.2 s that passed separates the levels
            assert after[0] >= levels[0] and after[1] >= levels[1]
            release.set()
        assert client.limiter.in_flight == 0


async def test_adaptive_crowd_of_rejected_calls_does_not_exhaust_retries(serve) -> None:
    """A server that serves one request at a time and answers every other one 429 with
    ``retry-after-ms``: 200 calls of an adaptive client with only 6 retries each all succeed.

    The kind of fault (a run of the SDK benchmark lost 1 request of 500): 429s that an
    adaptive client causes itself spent the calls' retries. (1) Rejected calls kept their slots
    through the retry wait, so the attempts in flight stayed above the shrunken limit and the
    crowd came back together after the same server hint: one won, every other spent a retry
    (7 failures of 200 here, every run). Retries now wait for a slot under the limit, ahead of
    first attempts. (2) Even so, each additive increase probes with one attempt too many and
    the loser, first in the retry queue, is likely in the next probe too (1 failure in about 6
    runs). A 429 is now flow control for an adaptive client: retried without spending
    retries while the call is younger than ``max_retry_after``."""
    state = {"now": 0, "rejected": 0}

    async def one_at_a_time(request: web.Request) -> web.Response:
        await request.read()
        if state["now"] >= 1:
            state["rejected"] += 1
            return web.json_response(
                {"error": {"message": "busy"}}, status=429, headers={"retry-after-ms": "4"}
            )
        state["now"] += 1
        try:
            await anyio.sleep(0.004)
        finally:
            state["now"] -= 1
        return web.json_response(OK)

    base = await serve({("POST", "/v1/chat/completions"): one_at_a_time})
    policy = RetryPolicy(max_retries=6, initial_delay=0.01, max_delay=0.1)
    async with AsyncClient(
        base, max_concurrency=32, adaptive_concurrency=True, retry_policy=policy
    ) as client:
        results = await client.chat.completions.batch([{"model": "m", "messages": MSG}] * 200)
        assert [r for r in results if isinstance(r, Exception)] == []
        assert state["rejected"] > 0  # the server did push back
        assert client.limiter.in_flight == 0 and client.limiter.waiting == 0


async def test_adaptive_429s_spend_no_retries_until_the_call_is_old(serve) -> None:
    """With adaptive concurrency a 429 is flow control: retried without spending
    ``max_retries`` while the call is younger than ``max_retry_after``; after that they count,
    so a server that never recovers still ends the call. Without it every 429 counts."""
    calls = {"n": 0}

    async def always_busy(request: web.Request) -> web.Response:
        calls["n"] += 1
        return web.json_response(
            {"error": {"message": "busy"}}, status=429, headers={"retry-after-ms": "5"}
        )

    base = await serve({("POST", "/v1/chat/completions"): always_busy})
    policy = RetryPolicy(max_retries=2, max_retry_after=0.3)
    async with AsyncClient(base, adaptive_concurrency=True, retry_policy=policy) as client:
        started = anyio.current_time()
        with pytest.raises(RateLimitError):
            await client.chat.completions.create(model="m", messages=MSG)
        assert anyio.current_time() - started >= 0.3  # absorbed for max_retry_after seconds
        assert calls["n"] > 3  # more attempts than 1 + max_retries
    calls["n"] = 0
    async with AsyncClient(base, retry_policy=policy) as plain:
        with pytest.raises(RateLimitError):
            await plain.chat.completions.create(model="m", messages=MSG)
    assert calls["n"] == 3  # 1 + max_retries: every 429 counted


async def test_adaptive_probes_up_only_after_the_stated_wait() -> None:
    """Successes during the server's stated wait, or of requests admitted before the cut,
    do not grow the limit; after the wait, every ``limit`` successes add one."""
    clock = FakeClock()

    async def sleep(seconds: float) -> None:
        clock.t += seconds

    lim = ConcurrencyLimiter(8, adaptive=True, clock=clock, sleep=sleep)
    old = [await lim.acquire() for _ in range(5)]
    lim.on_overload(old[0], retry_after=2.0)
    assert lim.limit == 4
    for s in old[1:]:
        lim.on_success(s)  # admitted before the cut
        lim.release(s)
    lim.release(old[0])
    assert lim.limit == 4
    fresh = await lim.acquire()  # waits out the 2 s
    assert clock.t == 2.0
    clock.t = 1.0  # (a success seen while the wait still ran would not count either)
    lim.on_success(fresh)
    assert lim.limit == 4
    clock.t = 2.0
    for _ in range(4):
        lim.on_success(fresh)
    assert lim.limit == 5


@respx.mock
async def test_adaptive_client_shrinks_on_429_and_waits_the_stated_time(make_client) -> None:
    """Through the client (respx): a 429 with ``retry-after-ms`` halves the limit, the call
    is retried and no request is sent before the stated time; then the limit grows back."""
    clock = FakeClock()
    sent: list[float] = []

    async def sleep(seconds: float) -> None:
        clock.t += seconds

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(clock.t)
        if len(sent) == 1:
            err = {"error": {"message": "busy", "type": "rate_limit_error", "code": None}}
            return httpx.Response(429, json=err, headers={"retry-after-ms": "1500"})
        return httpx.Response(200, json=OK)

    respx.post("http://test.local/v1/chat/completions").mock(side_effect=answer)
    async with make_client(max_concurrency=8, adaptive_concurrency=True) as client:
        client.limiter = ConcurrencyLimiter(8, adaptive=True, clock=clock, sleep=sleep)
        await client.chat.completions.create(model="m", messages=MSG)  # 429, then served
        assert sent == [0.0, 1.5]  # the retry waited the stated time
        assert client.limiter.limit == 4
        for _ in range(3):
            await client.chat.completions.create(model="m", messages=MSG)
        assert client.limiter.limit == 5  # 4 successes after the wait: one more slot


async def test_adaptive_pause_after_a_429_is_capped_at_max_retry_after(serve) -> None:
    """A prefixgate gateway states a budget refusal's admission slot up to 600 s, promised to
    that one request (``x-prefixgate-promise-ms``). An adaptive client held every new attempt
    for the server's raw hint: one such 429 would stall the client's unrelated calls for ten
    minutes. The hold is the hint capped at ``max_retry_after``, as the retry's own wait is."""
    calls = {"n": 0}

    async def slot_far_away_then_ok(request: web.Request) -> web.Response:
        await request.read()
        calls["n"] += 1
        if calls["n"] == 1:
            return web.json_response(
                {"error": {"message": "over budget", "code": "ttft_budget_exceeded"}},
                status=429,
                headers={"retry-after": "600", "x-prefixgate-promise-ms": "751500"},
            )
        return web.json_response(OK)

    base = await serve({("POST", "/v1/chat/completions"): slot_far_away_then_ok})
    policy = RetryPolicy(max_retries=2, max_retry_after=0.2)
    async with AsyncClient(base, adaptive_concurrency=True, retry_policy=policy) as client:
        with pytest.raises(RateLimitError) as info:  # promised past the cap: raised at once
            await client.chat.completions.create(model="m", messages=MSG)
        assert info.value.retry_after == 600.0
        with anyio.fail_after(5):  # not held for the 600 s told to the first request
            await client.chat.completions.create(model="m", messages=MSG)
    assert calls["n"] == 2


async def test_a_promised_429_raised_at_once_does_not_hold_the_client_s_other_calls(serve) -> None:
    """A promised 429 whose hint exceeds ``max_retry_after`` is that one request's place (a
    budget slot up to 600 s away) and is raised at once; the adaptive client still held every
    new attempt for ``max_retry_after`` (60 s by default): an unrelated call on the same client
    waited 60.2 s against a `prefixgate serve --runner sim` that would have admitted it at
    once. The limit still shrinks (AIMD); no hold is taken from a hint nobody waits for."""
    calls = {"n": 0}

    async def slot_far_away_then_ok(request: web.Request) -> web.Response:
        await request.read()
        calls["n"] += 1
        if calls["n"] == 1:
            return web.json_response(
                {"error": {"message": "over budget", "code": "ttft_budget_exceeded"}},
                status=429,
                headers={"retry-after": "300", "x-prefixgate-promise-ms": "376500"},
            )
        return web.json_response(OK)

    base = await serve({("POST", "/v1/chat/completions"): slot_far_away_then_ok})
    async with AsyncClient(base, adaptive_concurrency=True) as client:  # max_retry_after 60
        with pytest.raises(RateLimitError):
            await client.chat.completions.create(model="m", messages=MSG)
        with anyio.fail_after(5):
            await client.chat.completions.create(model="m", messages=MSG)
    assert calls["n"] == 2
