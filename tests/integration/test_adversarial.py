"""Adversarial input found by QA against the real stack: the engine's Python API with bad
sampling parameters, the real gateway on loopback serving aidreams-260k, and the SDK against
a server answering garbage."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.server import BackgroundServer
from prefixgate.sdk import AsyncClient
from prefixgate.sdk.errors import APIConnectionError, APIResponseValidationError

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.engine import LLM, AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from prefixgate.gateway.app import create_app  # noqa: E402
from prefixgate.gateway.state import STATE, GatewaySettings  # noqa: E402

MODEL = "aidreams-260k"
NAN, INF = float("nan"), float("inf")


# --- engine: SamplingParams ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw", [{"skip_special_tokens": None}, {"skip_special_tokens": "no"}, {"ignore_eos": "yes"}]
)
def test_sampling_params_bool_fields_type_checked(kw):
    # skip_special_tokens=None passed and reached tokenizers.decode inside the engine step,
    # failing every request of that step (see test_bad_params_do_not_fail_bystanders).
    with pytest.raises(TypeError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": NAN},
        {"temperature": INF},
        {"repetition_penalty": NAN},
        {"repetition_penalty": INF},
    ],
)
def test_sampling_params_refuse_non_finite(kw):
    # NaN passed every range check (NaN < 0 is False) and inf had no upper bound.
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_sampling_params_seed_range(seed):
    # Out of torch's range, the seed failed late in add_request ("Overflow when unpacking
    # long long"); the edges of the range are valid seeds.
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_bad_params_do_not_fail_bystanders(pool_whole):
    async def main():
        engine = AsyncEngine(EngineConfig(num_kv_blocks=64))
        good = SamplingParams(max_tokens=6, temperature=0)

        async def run(rid, params):
            outs = [out async for out in engine.generate("hello", params, rid)]
            return outs[-1].outputs[0].text

        try:
            ref = await run("ref", good)
            bad = SamplingParams(max_tokens=6)
            bad.skip_special_tokens = None  # broken after construction: re-validated on submit
            res = await asyncio.gather(
                run("a", good), run("bad", bad), run("b", good), return_exceptions=True
            )
            assert isinstance(res[1], TypeError)
            assert res[0] == ref and res[2] == ref, res  # bystanders undisturbed
            pool_whole(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_llm_bad_prompts_leave_the_pool_whole(pool_whole):
    llm = LLM(num_kv_blocks=64)
    sp = SamplingParams(max_tokens=3, temperature=0)
    ref = llm.generate(["hello"], sp)[0].outputs[0].text
    for prompts, exc in [
        ("", ValueError),
        ([[]], ValueError),
        ([[1, -1]], ValueError),
        ([[1, 10**9]], ValueError),
        ([[1, 2.0]], TypeError),
        ([[[1, 2]]], TypeError),
        (None, TypeError),
        (5, TypeError),
        (["hello", ""], ValueError),
        (["hello", [1, 10**6]], ValueError),
    ]:
        with pytest.raises(exc):
            llm.generate(prompts, sp)
        pool_whole(llm)
    with pytest.raises(TypeError):
        llm.generate(["a"], ["not params"])
    assert llm.generate(["hello"], sp)[0].outputs[0].text == ref
    pool_whole(llm)


# --- the real gateway ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(aidreams_path):
    def make():
        engine = AsyncEngine(EngineConfig(model=aidreams_path, num_kv_blocks=256))
        return create_app(
            engine, GatewaySettings(model_name=MODEL, poll_s=0.02, max_queued_requests=32)
        )

    srv = BackgroundServer(make).__enter__()
    yield srv
    srv.call(srv.app[STATE].engine.shutdown)
    srv.close()


def _error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    return err


def _raw(body: str) -> dict:
    return {"content": body.encode(), "headers": {"content-type": "application/json"}}


def test_gateway_refuses_what_the_engine_would_mishandle(server, pool_whole):
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    base = (
        '{"model": "'
        + MODEL
        + '", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4'
    )
    with httpx.Client(base_url=server.url, timeout=60) as http:
        ref = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        for field in ("repetition_penalty", "temperature"):
            for literal in ("Infinity", "NaN"):
                _error(
                    http.post("/v1/chat/completions", **_raw(f'{base}, "{field}": {literal}}}')),
                    400,
                    field,
                )
        for seed in (2**64, -(2**63) - 1):
            err = _error(http.post("/v1/chat/completions", json=dict(chat, seed=seed)), 400, "seed")
            assert "long long" not in err["message"]
        r = http.post("/v1/chat/completions", json=dict(chat, seed=2**63 - 1, n=2))
        assert r.status_code == 200, r.text
        # a batch of 3 prompts x n=16 is 48 engine requests > the queue's 32
        _error(
            http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": ["a"] * 3, "n": 16, "max_tokens": 2},
            ),
            400,
            "prompt",
        )
        assert http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"] == ref
    engine = server.app[STATE].engine
    for _ in range(200):
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        time.sleep(0.02)
    pool_whole(engine, pinned_ok=False)


# --- the SDK against garbage -----------------------------------------------------------------


def _garbage_app() -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + request.match_info["payload"].encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/{payload}/v1/chat/completions", stream)
    return app


def test_sdk_stream_of_non_object_chunks_is_a_validation_error():
    # `data: [1, 2]` raised a bare TypeError out of the SDK's stream (a non-stream body of the
    # same shape gives APIResponseValidationError).
    with BackgroundServer(_garbage_app) as srv:

        async def main():
            for payload in ("[1,2]", "5", "null", '"text"'):
                async with AsyncClient(
                    f"{srv.url}/{payload}/v1", max_retries=0, timeout=5
                ) as client:
                    stream = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                    )
                    with pytest.raises(APIResponseValidationError):
                        async for _ in stream:
                            pass
                    assert client.limiter.in_flight == 0  # the slot came back

        asyncio.run(main())


def test_sdk_dead_port_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        async with AsyncClient(f"http://127.0.0.1:{port}/v1", max_retries=1, timeout=2) as c:
            with pytest.raises(APIConnectionError):
                await c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}]
                )
            with pytest.raises(APIConnectionError):
                await c.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "x"}]
                )

    asyncio.run(main())


def test_sdk_ids_cannot_leave_their_path():
    # prefixes.get("../models") sent GET /v1/models (and parsed the model list as a Prefix);
    # "a?x=1" became a query string. Ids are one percent-encoded path segment.
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path)
        return httpx.Response(
            404,
            json={
                "error": {
                    "message": "no",
                    "type": "not_found_error",
                    "param": None,
                    "code": "prefix_not_found",
                }
            },
        )

    async def main():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with AsyncClient("http://gw/v1", max_retries=0, http_client=http) as client:
            for pid in ("../models", "..", ".", "a/b", "a?x=1", "a#b", "ok-1"):
                for call in (client.prefixes.get, client.prefixes.delete):
                    with pytest.raises(Exception, match="404"):
                        await call(pid)
            for model in ("../prefixes/x", "org/name"):
                with pytest.raises(Exception, match="404"):
                    await client.models.retrieve(model)
        await http.aclose()

    asyncio.run(main())
    prefix_paths = seen[:14]
    assert all(p.startswith(b"/v1/prefixes/") and p.count(b"/") == 3 for p in prefix_paths), seen
    assert b"/v1/prefixes/ok-1" in seen and b"/v1/prefixes/a%3Fx%3D1" in seen
    assert seen[14].startswith(b"/v1/models/") and b"/../" not in seen[14], seen
    assert seen[15] == b"/v1/models/org/name"  # model ids keep their slashes (org/name)


def test_sdk_bad_client_options_fail_at_construction():
    # A base_url without http(s), a key with CR/LF (header injection) or a negative timeout
    # were accepted; each call then failed as a *connection* error and was retried.
    for kw, exc in [
        ({"base_url": "ftp://x/v1"}, ValueError),
        ({"base_url": "not a url"}, ValueError),
        ({"api_key": "sk\r\nX-Evil: 1"}, ValueError),
        ({"api_key": 5}, TypeError),
        ({"timeout": -1}, ValueError),
        ({"timeout": "x"}, TypeError),
        ({"stream_idle_timeout": -1}, ValueError),
    ]:
        with pytest.raises(exc):
            AsyncClient(**kw)


def test_sdk_bad_header_is_not_retried_as_a_connection_error():
    sleeps: list[float] = []

    async def no_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    from prefixgate.sdk.retry import RetryPolicy

    with BackgroundServer(_garbage_app) as srv:

        async def main():
            async with AsyncClient(
                f"{srv.url}/x/v1", max_retries=3, retry_policy=RetryPolicy(sleep=no_sleep)
            ) as client:
                with pytest.raises(ValueError):
                    await client.chat.completions.create(
                        model="m",
                        messages=[{"role": "user", "content": "hi"}],
                        extra_headers={"X-Bad": "a\r\nb"},
                    )
                assert client.limiter.in_flight == 0

        asyncio.run(main())
    assert sleeps == []  # a local mistake is final


def test_tiny_top_p_keeps_the_most_likely_token(pool_whole):
    # top_p=1e-50 (valid: > 0) became 0.0 in a float32 tensor, so "mass before >= top_p" was
    # true for every token, the most likely one included: every logit -inf, garbage text
    # ('μμμμ' on aidreams where greedy says 'pes of vectors').
    import torch
    from prefixgate.engine.sampler import apply_top_p

    scores = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.2, 0.3]])
    for p in (1e-50, 1e-300, 5e-324, 1e-9):
        out = apply_top_p(scores, [p, 1.0])
        assert torch.isfinite(out[0]).tolist() == [False, True, False, False], (p, out)
        assert torch.equal(out[1], scores[1])
    llm = LLM(num_kv_blocks=64)
    greedy = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0))
    tiny = llm.generate(["hello"], SamplingParams(max_tokens=8, top_p=1e-50, seed=3))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    pool_whole(llm)


def test_cancelled_pin_prefix_leaks_no_pin(pool_whole):
    # A caller cancelled while AsyncEngine.pin_prefix prefilled its prefix (a client gone,
    # a timeout) left the pin in place for the whole TTL, its id known to no one.
    async def main():
        engine = AsyncEngine(EngineConfig(num_kv_blocks=64))
        try:
            for i in range(3):
                task = asyncio.create_task(engine.pin_prefix(list(range(3 + i, 40 + i)), 3600.0))
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            for _ in range(100):
                await asyncio.sleep(0.02)
                if engine.stats()["pinned_blocks"] == 0 and engine.stats()["num_running"] == 0:
                    break
            assert engine.stats()["pinned_blocks"] == 0, engine.stats()
            pool_whole(engine)
            pin = await engine.pin_prefix(list(range(3, 40)), 60.0)  # still pins
            assert pin.num_tokens == 32 and engine.stats()["pinned_blocks"] == 2
            engine.unpin_prefix(pin.id)
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize(
    "kw",
    [
        {"num_kv_blocks": "8"},
        {"kv_cache_memory": "lots"},
        {"block_size": 16.0},
        {"max_num_seqs": True},
        {"max_model_len": "128"},
        {"seed": "0"},
        {"enable_prefix_caching": "no"},
        {"max_pinned_fraction": "0.5"},
    ],
)
def test_engine_config_types_named(kw):
    # num_kv_blocks="8" gave "'<' not supported between instances of 'str' and 'int'".
    from prefixgate.engine import EngineConfig

    with pytest.raises(TypeError, match=next(iter(kw))):
        EngineConfig(**kw)


def test_engine_config_seed_range():
    from prefixgate.engine import EngineConfig

    with pytest.raises(ValueError, match="seed"):
        EngineConfig(seed=2**70)  # was torch's "Overflow when unpacking long long"
