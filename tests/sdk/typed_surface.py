"""What the type checker sees of the SDK's calls (checked by ``.ci/typecheck``, never run):
results typed per ``stream``, ``parse`` generic in its ``response_format``, and a keyword that
is unknown, mistyped or missing an error (``warn_unused_ignores`` turns each ``ignore`` below
into an assertion that the error is reported). The parameters come from one TypedDict per
endpoint, shared by the async and the blocking method."""

from __future__ import annotations

from typing import assert_type

import pydantic
from prefixgate.sdk import AsyncClient, AsyncStream, Client, SyncStream
from prefixgate.sdk.types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CreateEmbeddingResponse,
    ModelList,
    ParsedChatCompletion,
    Prefix,
    Response,
    ResponseStreamEvent,
)

MSG = [{"role": "user", "content": "hi"}]


class City(pydantic.BaseModel):
    name: str


def blocking(client: Client) -> None:
    assert_type(client.chat.completions.create(model="m", messages=MSG), ChatCompletion)
    assert_type(
        client.chat.completions.create(model="m", messages=MSG, stream=True),
        SyncStream[ChatCompletionChunk],
    )
    assert_type(
        client.chat.completions.parse(model="m", messages=MSG, response_format=City),
        ParsedChatCompletion[City],
    )
    assert_type(
        client.completions.create(model="m", prompt="p", stream=True), SyncStream[Completion]
    )
    assert_type(client.models.list(timeout=3), ModelList)
    client.chat.completions.create(model="m", messages=MSG, guided_json={})  # type: ignore[call-overload]
    client.chat.completions.create(model="m", messages=MSG, temperature="hot")  # type: ignore[call-overload]
    client.chat.completions.create(messages=MSG)  # type: ignore[call-overload]
    client.models.retrieve("x", bogus=1)  # type: ignore[call-arg]
    assert_type(client.responses.create(model="m", input="hi"), Response)
    assert_type(
        client.responses.create(model="m", input="hi", stream=True),
        SyncStream[ResponseStreamEvent],
    )
    assert_type(client.embeddings.create(input="x", model="e"), CreateEmbeddingResponse)
    client.embeddings.create(input="x")  # type: ignore[call-arg]


async def asynchronous(client: AsyncClient) -> None:
    assert_type(await client.chat.completions.create(model="m", messages=MSG), ChatCompletion)
    assert_type(
        await client.chat.completions.create(model="m", messages=MSG, stream=True),
        AsyncStream[ChatCompletionChunk],
    )
    assert_type(
        await client.chat.completions.parse(model="m", messages=MSG, response_format=City),
        ParsedChatCompletion[City],
    )
    assert_type(await client.prefixes.create(model="m", messages=MSG, ttl_seconds=5), Prefix)
    await client.prefixes.create(model="m", messages=MSG, ttl=5)  # type: ignore[call-arg]
    await client.completions.create(model="m", prompt="p", best_of="2")  # type: ignore[call-overload]
    assert_type(await client.responses.create(model="m", input="hi"), Response)
    assert_type(
        await client.responses.create(model="m", input=MSG, stream=True),
        AsyncStream[ResponseStreamEvent],
    )
    await client.responses.create(model="m", input="hi", max_tokens=5)  # type: ignore[call-overload]
    assert_type(await client.embeddings.create(input=[1, 2], model="e"), CreateEmbeddingResponse)
