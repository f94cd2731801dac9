"""Prefix reuse: register once, send only the user turn with prefix_id, fall back, re-register."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
import respx
from prefixgate.sdk import NotFoundError

from .conftest import BASE

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful assistant. " * 20


def chat_ok(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    msg = {"role": "assistant", "content": f"{len(body['messages'])} msgs"}
    return httpx.Response(200, json={"choices": [{"message": msg}], "echo": body})


def prefix_obj(pid: str, expires_at: float = 2e9) -> httpx.Response:
    return httpx.Response(
        200, json={"id": pid, "object": "prefix", "prompt_tokens": 120, "expires_at": expires_at}
    )


@respx.mock
async def test_registers_once_and_sends_only_the_user_turn(make_client) -> None:
    reg = respx.post(f"{BASE}/prefixes").mock(return_value=prefix_obj("pfx-1"))
    chat = respx.post(f"{BASE}/chat/completions").mock(side_effect=chat_ok)
    delete = respx.delete(f"{BASE}/prefixes/pfx-1").mock(
        return_value=httpx.Response(200, json={"id": "pfx-1", "deleted": True})
    )
    async with make_client() as client:
        async with client.prefixes.session(SYSTEM, model="m", ttl_seconds=120) as s:
            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(lambda i=i: s.create(f"task {i}", max_tokens=8))
            r = await s.create([{"role": "user", "content": "last"}])
            assert s.supported is True and s.prefix.id == "pfx-1"
    assert reg.call_count == 1 and chat.call_count == 11 and delete.call_count == 1
    sent = json.loads(reg.calls[0].request.content)
    assert sent == {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}],
        "ttl_seconds": 120,
    }
    body = r.echo
    assert body["prefix_id"] == "pfx-1" and body["messages"] == [
        {"role": "user", "content": "last"}
    ]


@pytest.mark.parametrize("status", [404, 405])
@respx.mock
async def test_falls_back_to_full_messages_without_the_route(make_client, status) -> None:
    reg = respx.post(f"{BASE}/prefixes").mock(return_value=httpx.Response(status, text="nope"))
    chat = respx.post(f"{BASE}/chat/completions").mock(side_effect=chat_ok)
    async with make_client() as client:
        s = client.prefixes.session(SYSTEM, model="m")
        r1 = await s.create("hello")
        r2 = await s.create("again")
        await s.close()
    assert s.supported is False and reg.call_count == 1 and chat.call_count == 2
    for r in (r1, r2):
        assert "prefix_id" not in r.echo
        assert r.echo["messages"][0] == {"role": "system", "content": SYSTEM}
        assert len(r.echo["messages"]) == 2


@respx.mock
async def test_reregisters_after_server_side_expiry(make_client) -> None:
    reg = respx.post(f"{BASE}/prefixes").mock(
        side_effect=[prefix_obj("pfx-1"), prefix_obj("pfx-2")]
    )
    expired = httpx.Response(
        404,
        json={"error": {"message": "gone", "param": "prefix_id", "code": "prefix_not_found"}},
    )
    chat = respx.post(f"{BASE}/chat/completions").mock(
        side_effect=[httpx.Response(200, json={"choices": []}), expired, chat_ok]
    )
    async with make_client() as client:
        s = client.prefixes.session(SYSTEM, model="m")
        await s.create("one")
        r = await s.create("two")
    assert reg.call_count == 2 and chat.call_count == 3
    assert r.echo["prefix_id"] == "pfx-2" and s.prefix.id == "pfx-2"


@respx.mock
async def test_refreshes_before_expires_at_and_falls_back_when_space_full(make_client) -> None:
    full = httpx.Response(
        429,
        headers={"retry-after": "300"},
        json={"error": {"message": "full", "code": "prefix_limit_exceeded"}},
    )
    reg = respx.post(f"{BASE}/prefixes").mock(
        side_effect=[prefix_obj("pfx-1", expires_at=100.0), full]
    )
    respx.post(f"{BASE}/chat/completions").mock(side_effect=chat_ok)
    async with make_client() as client:
        now = [0.0]
        s = client.prefixes.session(SYSTEM, model="m", ttl_seconds=100)
        s._clock = lambda: now[0]
        assert "prefix_id" in (await s.create("a")).echo
        now[0] = 95.0  # within the refresh margin of expires_at
        r = await s.create("b")
    assert reg.call_count == 2  # refreshed, got "full": not retried, full messages sent
    assert "prefix_id" not in r.echo and len(r.echo["messages"]) == 2


@respx.mock
async def test_prefixes_resource_and_other_errors(make_client) -> None:
    respx.get(f"{BASE}/prefixes/pfx-9").mock(return_value=prefix_obj("pfx-9"))
    respx.delete(f"{BASE}/prefixes/pfx-9").mock(
        return_value=httpx.Response(
            404, json={"error": {"message": "x", "code": "prefix_not_found"}}
        )
    )
    async with make_client() as client:
        p = await client.prefixes.get("pfx-9")
        assert p.prompt_tokens == 120 and p.object == "prefix"
        with pytest.raises(NotFoundError):
            await client.prefixes.delete("pfx-9")
        with pytest.raises(TypeError):
            client.prefixes.session(SYSTEM, model="")
        with pytest.raises(ValueError):
            await client.prefixes.create(
                model="m", messages=[{"role": "system", "content": "x"}], ttl_seconds=0
            )
        s = client.prefixes.session(SYSTEM, model="m")
        with pytest.raises(TypeError):
            await s.create("x", prefix_id="other")
