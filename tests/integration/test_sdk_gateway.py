"""The SDK against the real gateway serving aidreams-260k on loopback.

create (greedy text equal to transformers'), stream (same text as non-streamed), batch (in
order under the limit), prefix reuse (``cached_tokens > 0`` after the first request, same text
as sending the full messages), the blocking ``Client``, and typed errors from the gateway.
"""

from __future__ import annotations

import anyio
import pytest
from prefixgate.sdk import AsyncClient, BadRequestError, Client, NotFoundError

pytestmark = pytest.mark.anyio

MODEL = "aidreams"
SYSTEM = (
    "You dream of quiet machines. Every answer is a short dream about circuits, light and the "
    "slow hum of probability."
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def gateway(aidreams_path):
    """``(base_url, engine)`` of a gateway serving aidreams-260k from a background thread."""
    pytest.importorskip("prefixgate.engine.async_engine")
    from prefixgate.engine.async_engine import AsyncEngine
    from prefixgate.engine.config import EngineConfig
    from prefixgate.gateway.app import create_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings

    engines = []

    def make_app():
        engine = AsyncEngine(EngineConfig(model=aidreams_path, device="cpu", num_kv_blocks=256))
        engines.append(engine)
        return create_app(engine, GatewaySettings(model_name=MODEL))

    with BackgroundServer(make_app) as server:
        yield server.url + "/v1", engines[0], server
        server.call(engines[0].shutdown)


@pytest.fixture(scope="module")
def hf(aidreams_path):
    """transformers' model and tokenizer (the greedy reference)."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(aidreams_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(aidreams_path).eval()
    return model, tok


def hf_greedy(hf, prompt: str, max_new_tokens: int) -> str:
    import torch

    model, tok = hf
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    full = tok.decode(out[0], skip_special_tokens=True)
    head = tok.decode(ids[0], skip_special_tokens=True)
    assert full.startswith(head)
    return full[len(head) :]


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _greedy(user: str, max_tokens: int) -> dict:
    """A greedy chat request of ``user``'s turn after the system prompt (``messages``)."""
    return {
        "model": MODEL,
        "messages": messages(user),
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def test_models_and_greedy_completion_equals_transformers(gateway, hf) -> None:
    base, _, _ = gateway
    async with AsyncClient(base, max_concurrency=4) as client:
        models = await client.models.list()
        assert MODEL in [m.id for m in models]
        for prompt in ("I sense the nodes", "The light"):
            r = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=20, temperature=0
            )
            assert r.choices[0].text == hf_greedy(hf, prompt, 20)
            assert r.usage.completion_tokens > 0


async def test_chat_create_and_stream_agree(gateway) -> None:
    base, _, _ = gateway
    async with AsyncClient(base, max_concurrency=4) as client:
        r = await client.chat.completions.create(**_greedy("I sense the nodes", 16))
        text = r.choices[0].message.content
        assert text and r.choices[0].finish_reason in ("stop", "length")
        stream = await client.chat.completions.create(
            **_greedy("I sense the nodes", 16), stream=True, stream_options={"include_usage": True}
        )
        parts, usage = [], None
        async with stream:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
        assert "".join(parts) == text
        assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
        assert client.limiter.in_flight == 0


async def test_responses_create_and_stream_agree(gateway) -> None:
    """``client.responses`` on the real ``/v1/responses``: the whole response and its stream
    (typed events ending with ``response.completed`` / ``.incomplete``, no ``[DONE]``) give
    the same text, that of the same chat."""
    base, _, _ = gateway
    async with AsyncClient(base, max_concurrency=4) as client:
        chat = await client.chat.completions.create(**_greedy("I sense the nodes", 16))
        args = {"model": MODEL, "instructions": SYSTEM, "input": "I sense the nodes"}
        args["max_output_tokens"] = 16
        r = await client.responses.create(**args, temperature=0)
        assert r.status in ("completed", "incomplete")
        assert r.output_text == chat.choices[0].message.content
        assert r.usage is not None and r.usage.output_tokens == chat.usage.completion_tokens
        stream = await client.responses.create(**args, temperature=0, stream=True)
        async with stream:
            got = [e async for e in stream]
        assert got[0].type == "response.created"
        assert got[-1].type in ("response.completed", "response.incomplete")
        deltas = "".join(e.delta for e in got if e.type == "response.output_text.delta")
        assert deltas == got[-1].response.output_text == r.output_text
        assert client.limiter.in_flight == 0


async def test_stream_early_exit_frees_everything(gateway, pool_whole) -> None:
    base, engine, _ = gateway
    async with AsyncClient(base, max_concurrency=2) as client:
        stream = await client.chat.completions.create(**_greedy("A long dream", 40), stream=True)
        async for _chunk in stream:
            break
        await anyio.sleep(0.05)
        assert client.limiter.in_flight == 0 and stream.response.is_closed
        # the engine request ends (aborted by the gateway on disconnect, or finished)
        with anyio.fail_after(10):
            while engine.stats()["num_running"] or engine.stats()["num_waiting"]:
                await anyio.sleep(0.05)
    pool_whole(engine, pinned_ok=True)


async def test_batch_in_order_under_the_limit(gateway) -> None:
    base, _, _ = gateway
    users = [f"Dream number {i}" for i in range(12)]
    reqs = [
        {"model": MODEL, "messages": messages(u), "max_tokens": 8, "temperature": 0} for u in users
    ]
    reqs[5] = {**reqs[5], "max_tokens": -1}  # bad item: a 400 for it alone
    async with AsyncClient(base, max_concurrency=3) as client:
        results = await client.chat.completions.batch(reqs)
        singles = [await client.chat.completions.create(**reqs[i]) for i in (0, 11)]
    assert isinstance(results[5], BadRequestError)
    ok = [r for i, r in enumerate(results) if i != 5]
    assert all(not isinstance(r, Exception) for r in ok), ok
    assert results[0].choices[0].message.content == singles[0].choices[0].message.content
    assert results[11].choices[0].message.content == singles[1].choices[0].message.content


async def test_prefix_session_reuses_the_cache(gateway, pool_whole) -> None:
    base, engine, _ = gateway
    async with AsyncClient(base, max_concurrency=4) as client:
        full = await client.chat.completions.create(**_greedy("The circuit", 12))
        async with client.prefixes.session(SYSTEM, model=MODEL, ttl_seconds=60) as session:
            first = await session.create("The circuit", max_tokens=12, temperature=0)
            second = await session.create("A light", max_tokens=12, temperature=0)
            assert session.supported is True and session.prefix is not None
            pid = session.prefix.id
            assert (await client.prefixes.get(pid)).prompt_tokens > 0
        # leaving the session deleted the prefix
        with pytest.raises(NotFoundError):
            await client.prefixes.get(pid)
    assert first.choices[0].message.content == full.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert first.usage.prompt_tokens == full.usage.prompt_tokens
    pool_whole(engine)


def test_sync_client_against_gateway(gateway) -> None:
    base, _, _ = gateway
    with Client(base, max_concurrency=2) as client:
        r = client.chat.completions.create(**_greedy("Sync dream", 8))
        chunks = list(client.chat.completions.create(**_greedy("Sync dream", 8), stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == r.choices[0].message.content
        with pytest.raises(NotFoundError):
            client.chat.completions.create(model="no-such-model", messages=messages("x"))
