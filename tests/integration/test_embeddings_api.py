"""POST /v1/embeddings with the official openai client against a gateway serving a pooling
runner (a tiny random Llama with aidreams-260k's tokenizer), and the refusals around it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch

pytest.importorskip("prefixgate.engine.pooling")

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from model_helpers import tiny_hf_model  # noqa: E402
from prefixgate.engine import AsyncEngine, EngineConfig  # noqa: E402
from prefixgate.engine.pooling import PoolingEngine  # noqa: E402
from prefixgate.gateway.app import create_app  # noqa: E402
from prefixgate.gateway.http.server import BackgroundServer  # noqa: E402
from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from prefixgate.gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, aidreams_path):
    out = tmp_path_factory.mktemp("embedder")
    hf = tiny_hf_model("llama", out, vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(aidreams_path) / name, out / name)
    return out, hf


@pytest.fixture(scope="module")
def server(checkpoint):
    path, _ = checkpoint

    def make():
        cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", runner="pooling")
        return create_app(PoolingEngine(cfg), GatewaySettings(model_name="embedder"))

    srv = BackgroundServer(make).__enter__()
    yield srv
    srv.close()


def _reference(hf, tokenizer, texts: list[str]) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for t in texts:
            ids = tokenizer.encode(t, add_special_tokens=True)
            rows.append(hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float())
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def test_openai_client_embeddings(server, checkpoint):
    _, hf = checkpoint
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    texts = ["The fox and the bird", "an old oak tree", "x"]
    floats = client.embeddings.create(model="embedder", input=texts, encoding_format="float")
    b64 = client.embeddings.create(model="embedder", input=texts)  # the client asks base64
    tok = server.app[LOCAL].engine.tokenizer
    want = _reference(hf, tok, texts)
    for res in (floats, b64):
        got = torch.tensor([d.embedding for d in res.data])
        assert [d.index for d in res.data] == [0, 1, 2]
        assert (got - want).abs().max().item() < 1e-4
    n = sum(len(tok.encode(t)) for t in texts)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n
    ids = client.embeddings.create(model="embedder", input=[[5, 6, 7]], encoding_format="float")
    assert len(ids.data[0].embedding) == hf.config.hidden_size


def test_sdk_embeddings_equal_the_openai_client_s(server):
    """prefixgate's SDK (``client.embeddings.create``, openai-python's shape) gets the same
    vectors and usage as the official client, async and blocking."""
    from prefixgate.sdk import AsyncClient, Client

    texts = ["The fox and the bird", "x"]
    ref = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    want = ref.embeddings.create(model="embedder", input=texts, encoding_format="float")
    with Client(server.url + "/v1", max_retries=0) as client:
        got = client.embeddings.create(input=texts, model="embedder")
        b64 = client.embeddings.create(input=texts, model="embedder", encoding_format="base64")

    async def via_async():
        async with AsyncClient(server.url + "/v1", max_retries=0) as client:
            return await client.embeddings.create(input=[[5, 6, 7]], model="embedder")

    import anyio

    ids = anyio.run(via_async)
    assert [d.embedding for d in got.data] == [d.embedding for d in want.data]
    assert all(isinstance(d.embedding, str) for d in b64.data)  # base64 text, as it came
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert len(ids.data[0].embedding) == len(want.data[0].embedding)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[1, 10**6]]}, "input"),
        ({"input": "x", "extra": 1}, "extra"),
    ],
)
def test_bad_embedding_requests(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "embedder", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if param == "dimensions":  # was "dimensions: Input should be null"
        assert "not supported" in r.json()["error"]["message"]


def test_token_ids_input_is_one_input_whatever_its_length():
    # 3,000 token ids (one input) were refused as "at most 2048 inputs per request": the
    # bound on inputs counted the ids of a single input; only its context bounds its length.
    import asyncio

    from prefixgate.gateway.http.errors import APIError
    from prefixgate.gateway.local.embeddings import MAX_INPUTS, _token_inputs

    ids = [5] * (MAX_INPUTS + 952)
    assert asyncio.run(_token_inputs(None, ids, 4096)) == [ids]  # type: ignore[arg-type]
    with pytest.raises(APIError) as err:
        asyncio.run(_token_inputs(None, [[5]] * (MAX_INPUTS + 1), 4096))  # type: ignore[arg-type]
    assert err.value.param == "input" and f"got {MAX_INPUTS + 1}" in str(err.value.message)


def test_chat_on_a_pooling_runner_is_400(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "embedder", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200


def test_embeddings_on_a_generation_runner_is_400(aidreams_path, pool_whole):
    def make():
        return create_app(AsyncEngine(EngineConfig(model=aidreams_path, num_kv_blocks=64)))

    srv = BackgroundServer(make).__enter__()
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "aidreams-260k", "input": "x"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "model_not_embedding"
        assert err["param"] == "model", err  # the model is at fault, not the body
        pool_whole(srv.app[LOCAL].engine)
    finally:
        srv.call(srv.app[LOCAL].engine.shutdown)
        srv.close()


def test_embeddings_are_charged_to_the_key(checkpoint, tmp_path):
    """A served embeddings request spends its input tokens from the key's tokens_per_minute
    (as a chat spends prompt + completion); once spent, the key gets 429 with Retry-After."""
    import json

    path, _ = checkpoint
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-e", "name": "e", "tokens_per_minute": 60}]}))

    def make():
        cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", runner="pooling")
        settings = GatewaySettings(model_name="embedder", keys_file=str(keys))
        return create_app(PoolingEngine(cfg), settings)

    with BackgroundServer(make) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-e", max_retries=0)
        first = client.embeddings.create(model="embedder", input="one two three four five six")
        assert first.usage.prompt_tokens > 0
        with pytest.raises(openai.RateLimitError) as err:
            for _ in range(60):  # 60 tokens a minute: spent within a few requests
                client.embeddings.create(model="embedder", input="one two three four five six")
        assert err.value.response.headers.get("retry-after")
        open_client = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            open_client.embeddings.create(model="embedder", input="x")
