"""Batch: input order, per-item errors that cancel nothing, progress bar, bad items."""

from __future__ import annotations

import json

import httpx
import pytest
import respx
from prefixgate.sdk import BadRequestError

from .conftest import BASE

pytestmark = pytest.mark.anyio


def answer(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    text = body["messages"][-1]["content"]
    if text == "bad":
        return httpx.Response(400, json={"error": {"message": "no", "param": "messages"}})
    msg = {"role": "assistant", "content": text.upper()}
    return httpx.Response(200, json={"id": text, "choices": [{"index": 0, "message": msg}]})


@respx.mock
async def test_batch_order_and_per_item_errors(make_client, capsys) -> None:
    respx.post(f"{BASE}/chat/completions").mock(side_effect=answer)
    texts = [f"q{i}" for i in range(30)]
    texts[7] = "bad"
    reqs = [{"model": "m", "messages": [{"role": "user", "content": t}]} for t in texts]
    reqs[12] = {"model": "m", "messages": "not a list"}
    async with make_client(max_concurrency=4) as client:
        results = await client.chat.completions.batch(reqs, progress=True)
    assert len(results) == 30
    assert isinstance(results[7], BadRequestError)
    assert isinstance(results[12], TypeError)
    for i, r in enumerate(results):
        if i not in (7, 12):
            assert r.choices[0].message.content == texts[i].upper()
    assert "30/30" in capsys.readouterr().err  # tqdm progress bar on stderr


@respx.mock
async def test_batch_rejects_streams_and_non_mappings(make_client) -> None:
    respx.post(f"{BASE}/chat/completions").mock(side_effect=answer)
    async with make_client() as client:
        (r,) = await client.chat.completions.batch(
            [{"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": True}]
        )
        assert isinstance(r, ValueError)
        with pytest.raises(TypeError):
            await client.chat.completions.batch(["not a mapping"])  # type: ignore[list-item]
        assert await client.chat.completions.batch([]) == []


@respx.mock
async def test_completions_batch(make_client) -> None:
    route = respx.post(f"{BASE}/completions").mock(
        side_effect=lambda req: httpx.Response(
            200, json={"choices": [{"text": json.loads(req.content)["prompt"] * 2}]}
        )
    )
    async with make_client() as client:
        out = await client.completions.batch([{"model": "m", "prompt": p} for p in "abc"])
    assert [c.choices[0].text for c in out] == ["aa", "bb", "cc"] and route.call_count == 3
