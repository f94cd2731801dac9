"""The transformers static-batch baseline server (bench target d) on aidreams-260k."""

from __future__ import annotations

import asyncio
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from prefixgate.engine.hf_server import HFBatchServer  # noqa: E402

MSG = [{"role": "user", "content": "I sense the nodes"}]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_batches_streams_and_rejects(aidreams_path):
    async def go():
        server = HFBatchServer(aidreams_path, max_batch_size=4, batch_wait_s=0.05)
        async with TestClient(TestServer(server.app())) as c:
            models = await (await c.get("/v1/models")).json()
            assert models["data"][0]["id"] == "aidreams-260k"

            # three requests at once form one static batch; each is cut to its own max_tokens
            async def ask(n: int) -> dict:
                r = await c.post(
                    "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": n}
                )
                assert r.status == 200
                return await r.json()

            outs = await asyncio.gather(ask(3), ask(8), ask(5))
            assert [o["usage"]["completion_tokens"] for o in outs] == [3, 8, 5]
            assert outs[1]["choices"][0]["message"]["content"].startswith(
                outs[0]["choices"][0]["message"]["content"]
            )
            assert outs[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

            r = await c.post(
                "/v1/chat/completions",
                json={
                    "model": "m",
                    "messages": MSG,
                    "max_tokens": 8,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            text = await r.text()
            events = [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            content = "".join(
                ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]
            )
            assert content == outs[1]["choices"][0]["message"]["content"]  # greedy: same 8 tokens
            assert chunks[-1]["usage"]["completion_tokens"] == 8

            for bad in (
                {"model": "m", "messages": []},
                {"model": "m"},
                {"model": "m", "messages": MSG, "max_tokens": 0},
                {"model": "m", "messages": MSG, "max_tokens": 10_000},
            ):
                r = await c.post("/v1/chat/completions", json=bad)
                assert r.status == 400 and "error" in await r.json()
            r = await c.post("/v1/chat/completions", data=b"{not json")
            assert r.status == 400
            assert (await ask(2))["usage"]["completion_tokens"] == 2  # still serving

    asyncio.run(go())
