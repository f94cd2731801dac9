"""The real gateway on loopback serving the real aidreams-260k model, driven by `openai`.

aidreams has a 128-token context: prompts are kept short (a real system prompt from
workloads/system_prompts.csv truncated at a word boundary) so prompt + max_tokens < 128.
"""

from __future__ import annotations

import asyncio
import csv
import time

import aiohttp
import httpx
import openai
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.engine import LLM, AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from prefixgate.gateway.app import create_app  # noqa: E402
from prefixgate.gateway.http.server import BackgroundServer  # noqa: E402
from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from prefixgate.gateway.settings import GatewaySettings
from support.gateway import wait_idle  # noqa: E402

MODEL = "aidreams-260k"


def _serve(path: str, **engine_kw) -> BackgroundServer:
    def make():
        engine = AsyncEngine(EngineConfig(model=path, num_kv_blocks=256, **engine_kw))
        return create_app(
            engine, GatewaySettings(model_name=MODEL, poll_s=0.02, max_queued_requests=32)
        )

    return BackgroundServer(make).__enter__()


@pytest.fixture(scope="module")
def server(aidreams_path):
    srv = _serve(aidreams_path)
    yield srv
    srv.call(srv.app[LOCAL].engine.shutdown)
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def system_prompt(workloads_path, aidreams_path) -> str:
    """A real system prompt, cut at a word boundary to at most 60 tokens."""
    from prefixgate.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(aidreams_path)
    with open(workloads_path / "system_prompts.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["act"] == "Linux Terminal")
    words = row["prompt"].split()
    while len(tok.encode(" ".join(words))) > 60:
        words.pop()
    return " ".join(words)


def _engine(server):
    return server.app[LOCAL].engine


def _idle(server, pool_whole) -> dict:
    """``wait_idle`` (up to 10 s; pinned blocks allowed), then the engine's stats."""
    wait_idle(server, pool_whole, 10.0, pinned_ok=True)
    return _engine(server).stats()


def test_chat_completion_streaming_usage(client, server, pool_whole):
    msgs = [
        {"role": "system", "content": "You dream."},
        {"role": "user", "content": "I sense the nodes"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 5
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert sum(1 for c in chunks if c.usage is not None) == 1
    comp = client.completions.create(
        model=MODEL, prompt="I sense the nodes", max_tokens=12, temperature=0
    )
    assert comp.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]
    lp = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2
    )
    content = lp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == text  # token texts keep their leading spaces
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the top one
    _idle(server, pool_whole)


def test_http_greedy_equals_llm_generate(client, server, aidreams_path, pool_whole):
    llm = LLM(aidreams_path, num_kv_blocks=64)
    prompts = ["I sense the nodes", "The dream unfolds", "Quiet circuits hum"]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    got = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    assert got == expected
    msgs = [{"role": "system", "content": "You dream."}, {"role": "user", "content": prompts[0]}]
    ids = llm.engine.tokenizer.encode(
        llm.engine.tokenizer.apply_chat_template(msgs), add_special_tokens=False
    )
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == llm.generate([ids], params)[0].outputs[0].text
    _idle(server, pool_whole)


def test_system_prompt_twice_hits_cache(client, server, system_prompt, pool_whole):
    msgs = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": "my first command is pwd"},
    ]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    assert first.usage.prompt_tokens + 16 < 128
    second = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0
    )
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    _idle(server, pool_whole)


def test_prefix_api_equals_full_messages(client, server, system_prompt, pool_whole):
    http = httpx.Client(base_url=server.url)
    pfx = http.post(
        "/v1/prefixes",
        json={
            "model": MODEL,
            "ttl_seconds": 30,
            "messages": [{"role": "system", "content": system_prompt}],
        },
    ).json()
    assert pfx["object"] == "prefix" and pfx["prompt_tokens"] > 16
    user = [{"role": "user", "content": "ls -la"}]
    via = client.chat.completions.create(
        model=MODEL,
        messages=user,
        max_tokens=16,
        temperature=0,
        extra_body={"prefix_id": pfx["id"]},
    )
    assert via.usage.prompt_tokens_details.cached_tokens >= 16  # the pinned blocks
    full = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system_prompt}, *user],
        max_tokens=16,
        temperature=0,
    )
    assert via.choices[0].message.content == full.choices[0].message.content
    assert via.usage.prompt_tokens == full.usage.prompt_tokens
    assert _engine(server).stats()["pinned_blocks"] > 0
    assert http.delete(f"/v1/prefixes/{pfx['id']}").status_code == 200
    assert http.get(f"/v1/prefixes/{pfx['id']}").status_code == 404
    stats = _idle(server, pool_whole)
    assert stats["pinned_blocks"] == 0 and stats["kv_blocks_used"] == 0


def test_bad_input_on_real_model(server, pool_whole):
    with httpx.Client(base_url=server.url) as http:
        long = {"model": MODEL, "messages": [{"role": "user", "content": "dream " * 200}]}
        r = http.post("/v1/chat/completions", json=long)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 500,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        assert r.status_code == 404
        assert (
            http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
            ).status_code
            == 200
        )
    _idle(server, pool_whole)


def test_500_concurrent_over_capacity(server, pool_whole):
    """500 connections at once, queue bound 32: 200s and 429s (server_overloaded, Retry-After)
    only, then the server still serves and the KV pool is whole."""

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def one(i):
                body = {"model": MODEL, "prompt": f"Dream {i}", "max_tokens": 4, "temperature": 0}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    return r.status, await r.json(), r.headers.get("Retry-After")

            return await asyncio.gather(*(one(i) for i in range(500)))

    results = asyncio.run(run())
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 32, set(statuses)
    for status, body, retry in results:
        if status == 429:
            assert body["error"]["code"] == "server_overloaded" and int(retry) >= 1
        else:
            assert body["usage"]["completion_tokens"] == 4
    stats = _idle(server, pool_whole)
    assert stats["kv_blocks_used"] == 0
    with httpx.Client(base_url=server.url) as http:
        assert (
            http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
            ).status_code
            == 200
        )


def test_disconnects_free_blocks(aidreams_path, pool_whole):
    """Mid-stream and while waiting (max_num_seqs=1): both engine requests aborted."""
    srv = _serve(aidreams_path, max_num_seqs=1)
    engine = _engine(srv)
    # Each step takes >= 10 ms, so 100 tokens take >= 1 s: the disconnects must abort them,
    # not race them (this tiny model decodes 100 tokens faster than a loaded machine may
    # notice a closed connection: both then ran to max_tokens, 200 tokens).
    inner = engine.engine
    step = inner.step

    def slow_step():
        time.sleep(0.01)
        return step()

    inner.step = slow_step
    try:

        async def go(stream: bool, started: asyncio.Event | None = None):
            body = {
                "model": MODEL,
                "prompt": "I sense the nodes",
                "max_tokens": 100,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
            }
            async with (
                aiohttp.ClientSession() as s,
                s.post(srv.url + "/v1/completions", json=body) as r,
            ):
                if stream:
                    await r.content.readline()
                    started.set()
                await asyncio.sleep(30)

        async def scenario():
            started = asyncio.Event()
            streaming = asyncio.create_task(go(True, started))
            await started.wait()
            waiting = asyncio.create_task(go(False))
            # wait (not a fixed sleep: a loaded machine is slow) until the second request
            # has reached the engine and waits behind the streaming one
            for _ in range(500):
                await asyncio.sleep(0.02)
                mid = engine.stats()
                if mid["num_waiting"] == 1:
                    break
            streaming.cancel()
            waiting.cancel()
            await asyncio.gather(streaming, waiting, return_exceptions=True)
            return mid

        mid = asyncio.run(scenario())
        assert mid["num_running"] == 1 and mid["num_waiting"] == 1, mid
        deadline = time.monotonic() + 10
        while (
            engine.stats()["num_running"] + engine.stats()["num_waiting"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        stats = engine.stats()
        assert stats["tokens_decoded"] < 200, stats  # neither ran to max_tokens
        pool_whole(engine)
    finally:
        srv.call(engine.shutdown)
        srv.close()


def test_pin_cap_gives_429(aidreams_path, system_prompt, pool_whole):
    """The engine's PinLimitError (pins over max_pinned_fraction) → 429 prefix_limit_exceeded."""
    srv = _serve(aidreams_path, max_pinned_fraction=0.01)  # 2 of 256 blocks
    engine = _engine(srv)
    try:
        with httpx.Client(base_url=srv.url) as http:
            r = http.post(
                "/v1/prefixes",
                json={"model": MODEL, "messages": [{"role": "system", "content": system_prompt}]},
            )
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "prefix_limit_exceeded" and "full" in err["message"]
            ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200
        pool_whole(engine)
    finally:
        srv.call(engine.shutdown)
        srv.close()
