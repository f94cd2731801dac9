"""Retry paths (respx-mocked): statuses, Retry-After forms, backoff with full jitter, typed errors.

Waits are asserted through the fake sleep (no real time passes).
"""

from __future__ import annotations

import email.utils
import random

import httpx
import pytest
import respx
from prefixgate.sdk import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AsyncClient,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    RetryPolicy,
    parse_retry_after,
)

from .conftest import BASE, MSG, OK

pytestmark = pytest.mark.anyio

URL = f"{BASE}/chat/completions"


def err(status: int, headers: dict | None = None, code: str | None = None) -> httpx.Response:
    body = {"error": {"message": f"status {status}", "type": "x", "param": None, "code": code}}
    return httpx.Response(status, json=body, headers=headers or {})


def jitter_windows(seed: int, windows: list[float]) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0.0, w) for w in windows]


@respx.mock
async def test_429_honours_retry_after_ms_then_seconds(make_client, fake_sleep) -> None:
    route = respx.post(URL).mock(
        side_effect=[
            err(429, {"retry-after-ms": "250", "retry-after": "9"}),
            err(429, {"retry-after": "1.5"}),
            httpx.Response(200, json=OK),
        ]
    )
    async with make_client() as client:
        r = await client.chat.completions.create(model="m", messages=MSG)
    assert r.choices[0].message.content == "yo"
    assert route.call_count == 3
    assert fake_sleep.waits == [0.25, 1.5]


@respx.mock
async def test_retry_after_http_date(make_client, fake_sleep) -> None:
    now = 1_000_000.0  # the client's fixed clock
    date = email.utils.formatdate(now + 7, usegmt=True)
    respx.post(URL).mock(
        side_effect=[err(503, {"retry-after": date}), httpx.Response(200, json=OK)]
    )
    async with make_client() as client:
        await client.chat.completions.create(model="m", messages=MSG)
    assert fake_sleep.waits == [7.0]


@respx.mock
async def test_retry_after_is_capped(make_client, fake_sleep) -> None:
    respx.post(URL).mock(
        side_effect=[err(429, {"retry-after": "3600"}), httpx.Response(200, json=OK)]
    )
    async with make_client() as client:
        await client.chat.completions.create(model="m", messages=MSG)
    assert fake_sleep.waits == [60.0]


@pytest.mark.parametrize("status", [408, 409, 500, 502, 503])
@respx.mock
async def test_retryable_statuses_use_full_jitter_backoff(make_client, fake_sleep, status) -> None:
    route = respx.post(URL).mock(
        side_effect=[err(status), err(status), httpx.Response(200, json=OK)]
    )
    async with make_client() as client:
        await client.chat.completions.create(model="m", messages=MSG)
    assert route.call_count == 3
    # seeded rng(0), initial 0.5 s: windows [0, 0.5] then [0, 1.0]
    assert fake_sleep.waits == pytest.approx(jitter_windows(0, [0.5, 1.0]))


def test_backoff_window_is_exponential_and_capped() -> None:
    class Top(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return b  # the window's upper edge

    policy = RetryPolicy(initial_delay=0.5, max_delay=8.0, rng=Top())
    assert [policy.compute_wait(k, None) for k in range(1, 8)] == [0.5, 1, 2, 4, 8, 8, 8]
    low = RetryPolicy(rng=type("Low", (random.Random,), {"uniform": lambda s, a, b: a})())
    assert low.compute_wait(3, None) == 0.0  # full jitter: the window starts at 0


@pytest.mark.parametrize(
    "status,exc", [(400, BadRequestError), (404, NotFoundError), (422, APIStatusError)]
)
@respx.mock
async def test_other_4xx_never_retried(make_client, fake_sleep, status, exc) -> None:
    route = respx.post(URL).mock(return_value=err(status))
    async with make_client() as client:
        with pytest.raises(exc) as info:
            await client.chat.completions.create(model="m", messages=MSG)
    assert route.call_count == 1 and fake_sleep.waits == []
    assert info.value.status_code == status and info.value.message.startswith(
        f"Error code: {status}"
    )


@respx.mock
async def test_exhausted_retries_raise_last_typed_error(make_client, fake_sleep) -> None:
    route = respx.post(URL).mock(
        side_effect=[err(500), err(503), err(429, {"retry-after": "2"}, code="rate_limit_exceeded")]
    )
    async with make_client(max_retries=2) as client:
        with pytest.raises(RateLimitError) as info:
            await client.chat.completions.create(model="m", messages=MSG)
    assert route.call_count == 3 and len(fake_sleep.waits) == 2
    assert info.value.code == "rate_limit_exceeded" and info.value.status_code == 429


@respx.mock
async def test_5xx_after_retries_is_internal_server_error(make_client) -> None:
    respx.post(URL).mock(return_value=err(502))
    async with make_client(max_retries=1) as client:
        with pytest.raises(InternalServerError):
            await client.chat.completions.create(model="m", messages=MSG)


@respx.mock
async def test_connection_errors_retried_then_typed(make_client, fake_sleep) -> None:
    route = respx.post(URL).mock(side_effect=httpx.ConnectError("refused"))
    async with make_client(max_retries=3) as client:
        with pytest.raises(APIConnectionError) as info:
            await client.chat.completions.create(model="m", messages=MSG)
    assert not isinstance(info.value, APITimeoutError)
    assert route.call_count == 4
    assert fake_sleep.waits == pytest.approx(jitter_windows(0, [0.5, 1.0, 2.0]))


@respx.mock
async def test_timeouts_retried_then_typed(make_client, fake_sleep) -> None:
    route = respx.post(URL).mock(
        side_effect=[
            httpx.ReadTimeout("slow"),
            httpx.ConnectTimeout("slow"),
            httpx.Response(200, json=OK),
        ]
    )
    async with make_client() as client:
        await client.chat.completions.create(model="m", messages=MSG)
    assert route.call_count == 3
    respx.post(URL).mock(side_effect=httpx.ReadTimeout("slow"))
    async with make_client(max_retries=0) as client:
        with pytest.raises(APITimeoutError):
            await client.chat.completions.create(model="m", messages=MSG)


@respx.mock
async def test_body_dropped_mid_read_is_retried(make_client) -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'{"id": "c1", "choi'
            raise httpx.RemoteProtocolError("peer closed connection")

    route = respx.post(URL).mock(
        side_effect=[httpx.Response(200, stream=Broken()), httpx.Response(200, json=OK)]
    )
    async with make_client() as client:
        r = await client.chat.completions.create(model="m", messages=MSG)
    assert r.id == "c1" and route.call_count == 2


@pytest.mark.parametrize(
    "response,calls,exc",
    [
        (err(400, {"x-should-retry": "true"}), 3, BadRequestError),
        (err(503, {"x-should-retry": "false"}), 1, InternalServerError),
        (err(429, {"retry-after": "300"}, code="prefix_limit_exceeded"), 1, RateLimitError),
        (err(429, code="insufficient_quota"), 1, RateLimitError),
    ],
)
@respx.mock
async def test_x_should_retry_header_and_final_codes(make_client, response, calls, exc) -> None:
    route = respx.post(URL).mock(return_value=response)
    async with make_client() as client:
        with pytest.raises(exc):
            await client.chat.completions.create(model="m", messages=MSG)
    assert route.call_count == calls


@respx.mock
async def test_per_call_max_retries(make_client) -> None:
    route = respx.post(URL).mock(return_value=err(500))
    async with make_client(max_retries=5) as client:
        with pytest.raises(InternalServerError):
            await client.chat.completions.create(model="m", messages=MSG, max_retries=1)
    assert route.call_count == 2


def test_parse_retry_after_forms() -> None:
    h = httpx.Headers
    assert parse_retry_after(h({"retry-after": "3"}), 0) == 3.0
    assert parse_retry_after(h({"retry-after-ms": "20"}), 0) == 0.02
    assert parse_retry_after(h({"retry-after-ms": "bad", "retry-after": "1"}), 0) == 1.0
    assert parse_retry_after(h({"retry-after": "-1"}), 0) is None
    assert parse_retry_after(h({"retry-after": "soon"}), 0) is None
    assert parse_retry_after(h({}), 0) is None
    past = email.utils.formatdate(100, usegmt=True)
    assert parse_retry_after(h({"retry-after": past}), 200) == 0.0


def test_policy_validates() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError):
        RetryPolicy(initial_delay=-0.1)


@respx.mock
async def test_a_promised_hint_over_the_cap_is_raised_at_once(make_client, fake_sleep) -> None:
    # prefixgate holds a place for this request 300 s on (x-prefixgate-promise-ms): a retry
    # after the capped 60 s came back before it and was refused again for sure, a retry spent.
    route = respx.post(URL).mock(
        side_effect=[
            err(429, {"retry-after-ms": "300000", "x-prefixgate-promise-ms": "376500"}),
            httpx.Response(200, json=OK),
        ]
    )
    async with make_client() as client:
        with pytest.raises(RateLimitError) as exc:
            await client.chat.completions.create(model="m", messages=MSG)
    assert route.call_count == 1 and fake_sleep.waits == []
    assert exc.value.retry_after == 300.0  # the server's full hint, not the cap


@respx.mock
async def test_a_promised_hint_within_the_cap_is_waited_for(make_client, fake_sleep) -> None:
    respx.post(URL).mock(
        side_effect=[
            err(429, {"retry-after-ms": "45000", "x-prefixgate-promise-ms": "57000"}),
            httpx.Response(200, json=OK),
        ]
    )
    async with make_client() as client:
        await client.chat.completions.create(model="m", messages=MSG)
    assert fake_sleep.waits == [45.0]


@respx.mock
async def test_a_promised_hint_over_a_raised_cap_is_waited_for(fake_sleep) -> None:
    respx.post(URL).mock(
        side_effect=[
            err(429, {"retry-after": "300", "x-prefixgate-promise-ms": "376500"}),
            httpx.Response(200, json=OK),
        ]
    )
    policy = RetryPolicy(max_retry_after=600.0, sleep=fake_sleep, clock=lambda: 1_000_000.0)
    async with AsyncClient(BASE, retry_policy=policy) as client:
        await client.chat.completions.create(model="m", messages=MSG)
    assert fake_sleep.waits == [300.0]
