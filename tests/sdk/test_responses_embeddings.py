"""``client.responses`` and ``client.embeddings`` (openai-python's shape) against respx: the
body sent, the typed result, a Responses stream that ends with its final typed event (no
``data: [DONE]``) or is cut short, argument errors before anything is sent, the blocking
twins."""

from __future__ import annotations

import json

import httpx
import pytest
import respx
from prefixgate.sdk import APIConnectionError, APIError, Client
from prefixgate.sdk.types import CreateEmbeddingResponse, Response

from .conftest import BASE

pytestmark = pytest.mark.anyio

RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1,
    "model": "m",
    "status": "completed",
    "output": [
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello there", "annotations": []}],
        }
    ],
    "usage": {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 7,
    },
}
EMBEDDINGS = {
    "object": "list",
    "data": [
        {"object": "embedding", "index": 0, "embedding": [0.5, -0.25]},
        {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]},
    ],
    "model": "e",
    "usage": {"prompt_tokens": 4, "total_tokens": 4},
}


def events(*objs: dict, done: bool = False) -> bytes:
    out = "".join(f"event: {o['type']}\ndata: {json.dumps(o)}\n\n" for o in objs)
    return (out + ("data: [DONE]\n\n" if done else "")).encode()


def stream_of(final: str = "response.completed") -> list[dict]:
    created = {**RESPONSE, "status": "in_progress", "output": [], "usage": None}
    return [
        {"type": "response.created", "sequence_number": 0, "response": created},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": "Hello"},
        {"type": "response.output_text.delta", "sequence_number": 2, "delta": " there"},
        {"type": final, "sequence_number": 3, "response": RESPONSE},
    ]


@respx.mock
async def test_responses_create_sends_the_body_and_types_the_answer(make_client) -> None:
    route = respx.post(f"{BASE}/responses").mock(return_value=httpx.Response(200, json=RESPONSE))
    async with make_client() as client:
        r = await client.responses.create(
            model="m", input="hi", instructions="be brief", max_output_tokens=8, temperature=0
        )
    sent = json.loads(route.calls[0].request.content)
    assert sent == {
        "model": "m",
        "input": "hi",
        "instructions": "be brief",
        "max_output_tokens": 8,
        "temperature": 0,
    }
    assert isinstance(r, Response) and r.output_text == "Hello there"
    assert r.usage is not None and r.usage.input_tokens_details.cached_tokens == 2


@respx.mock
async def test_a_responses_stream_ends_with_its_final_event(make_client) -> None:
    body = events(*stream_of())  # as OpenAI's: no data: [DONE]
    route = respx.post(f"{BASE}/responses").mock(return_value=httpx.Response(200, content=body))
    async with make_client() as client:
        stream = await client.responses.create(
            model="m", input=[{"role": "user", "content": "hi"}], stream=True
        )
        got = [e async for e in stream]
    assert json.loads(route.calls[0].request.content)["stream"] is True
    assert [e.type for e in got][-1] == "response.completed"
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == (
        got[-1].response.output_text
    )
    assert [e.sequence_number for e in got] == [0, 1, 2, 3]


@pytest.mark.parametrize("final", ["response.incomplete", "response.failed"])
@respx.mock
async def test_a_responses_stream_ends_with_any_final_event(make_client, final) -> None:
    respx.post(f"{BASE}/responses").mock(
        return_value=httpx.Response(200, content=events(*stream_of(final)))
    )
    async with make_client() as client:
        got = [e async for e in await client.responses.create(model="m", input="x", stream=True)]
    assert got[-1].type == final


@respx.mock
async def test_a_responses_stream_cut_before_its_final_event_raises(make_client) -> None:
    respx.post(f"{BASE}/responses").mock(
        return_value=httpx.Response(200, content=events(*stream_of()[:3]))
    )
    async with make_client() as client:
        stream = await client.responses.create(model="m", input="x", stream=True)
        with pytest.raises(APIConnectionError, match="response.completed"):
            [e async for e in stream]


@respx.mock
async def test_a_responses_stream_error_event_raises(make_client) -> None:
    err = {"type": "error", "sequence_number": 1, "code": "server_error", "message": "boom"}
    respx.post(f"{BASE}/responses").mock(
        return_value=httpx.Response(200, content=events(stream_of()[0], err))
    )
    async with make_client() as client:
        stream = await client.responses.create(model="m", input="x", stream=True)
        with pytest.raises(APIError, match="boom"):
            [e async for e in stream]


@respx.mock
async def test_embeddings_create_sends_the_body_and_types_the_answer(make_client) -> None:
    route = respx.post(f"{BASE}/embeddings").mock(return_value=httpx.Response(200, json=EMBEDDINGS))
    async with make_client() as client:
        r = await client.embeddings.create(input=["a", "b"], model="e", encoding_format="float")
    assert json.loads(route.calls[0].request.content) == {
        "input": ["a", "b"],
        "model": "e",
        "encoding_format": "float",
    }
    assert isinstance(r, CreateEmbeddingResponse)
    assert [d.embedding for d in r.data] == [[0.5, -0.25], [1.0, 0.0]]
    assert r.usage is not None and r.usage.prompt_tokens == 4


async def test_bad_arguments_raise_before_anything_is_sent(make_client) -> None:
    async with make_client() as client:
        with pytest.raises(TypeError, match="input"):
            await client.responses.create(model="m", input=3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"input\[0\]"):
            await client.responses.create(model="m", input=["hi"])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="frobnicate"):
            await client.responses.create(model="m", input="x", frobnicate=1)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="model"):
            await client.embeddings.create(input="x", model="")
        with pytest.raises(TypeError, match="input"):
            await client.embeddings.create(input=b"x", model="e")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="input"):
            await client.embeddings.create(model="e")  # type: ignore[call-arg]


@respx.mock
def test_the_blocking_twins() -> None:
    respx.post(f"{BASE}/responses").mock(
        side_effect=lambda request: httpx.Response(
            200,
            content=events(*stream_of()) if b'"stream"' in request.content else None,
            json=None if b'"stream"' in request.content else RESPONSE,
        )
    )
    respx.post(f"{BASE}/embeddings").mock(return_value=httpx.Response(200, json=EMBEDDINGS))
    with Client(BASE, max_retries=0) as client:
        assert client.responses.create(model="m", input="hi").output_text == "Hello there"
        with client.responses.create(model="m", input="hi", stream=True) as stream:
            assert [e.type for e in stream][-1] == "response.completed"
        assert len(client.embeddings.create(input="a", model="e").data) == 2
        raw = client.responses.with_raw_response.create(model="m", input="hi")
        assert raw.status_code == 200 and raw.parse().output_text == "Hello there"


def test_the_shapes_are_openai_python_s() -> None:
    """The bodies above are real shapes: openai-python's own models take them and read the
    same values as the SDK's types."""
    openai_types = pytest.importorskip("openai.types")
    from openai.types.responses import Response as OpenAIResponse

    theirs = OpenAIResponse.model_validate(
        {**RESPONSE, "parallel_tool_calls": False, "tool_choice": "none", "tools": []}
    )
    assert theirs.output_text == Response.from_dict(RESPONSE).output_text == "Hello there"
    embedded = openai_types.CreateEmbeddingResponse.model_validate(EMBEDDINGS)
    ours = CreateEmbeddingResponse.from_dict(EMBEDDINGS)
    assert [d.embedding for d in embedded.data] == [d.embedding for d in ours.data]
