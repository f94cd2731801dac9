"""``chat.completions.parse``: strict json_schema sent, content validated into ``parsed``,
finish reasons and refusals handled as openai-python does; typed tool calls."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import httpx
import pydantic
import pytest
import respx
from prefixgate.sdk import Client, ContentFilterFinishReasonError, LengthFinishReasonError
from prefixgate.sdk._parsing import strict_json_schema

from .conftest import BASE, completion_body

pytestmark = pytest.mark.anyio
MSG = [{"role": "user", "content": "Describe a city."}]


class Address(pydantic.BaseModel):
    street: str
    zip_code: str | None = None


class City(pydantic.BaseModel):
    name: str
    population: int = pydantic.Field(ge=0)
    kind: Literal["town", "city"]
    capital: bool
    address: Address
    tags: list[str] = pydantic.Field(max_length=3)


CITY = {
    "name": "Lyon",
    "population": 522_000,
    "kind": "city",
    "capital": False,
    "address": {"street": "Rue de la République", "zip_code": None},
    "tags": ["food", "silk"],
}


def answer(content: str | None, finish: str = "stop", **message) -> dict:
    body = completion_body({"role": "assistant", "content": content, **message}, finish)
    return {**body, "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}


@respx.mock
async def test_parse_sends_strict_json_schema_and_validates(make_client) -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, json=answer(json.dumps(CITY)))
    )
    async with make_client() as client:
        out = await client.chat.completions.parse(
            model="m", messages=MSG, response_format=City, max_tokens=200
        )
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and city.address.street == "Rue de la République"
    assert out.choices[0].message.content == json.dumps(CITY)
    assert out.usage is not None and out.usage.total_tokens == 12
    sent = json.loads(route.calls[0].request.content)
    fmt = sent["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["name"] == "City" and "stream" not in sent
    schema = fmt["json_schema"]["schema"]
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["name", "population", "kind", "capital", "address", "tags"]
    nested = schema["$defs"]["Address"]
    assert nested["additionalProperties"] is False and nested["required"] == ["street", "zip_code"]
    assert "default" not in nested["properties"]["zip_code"]  # null defaults dropped


@respx.mock
async def test_parse_length_content_filter_refusal_and_invalid(make_client) -> None:
    route = respx.post(f"{BASE}/chat/completions")
    async with make_client() as client:
        route.mock(return_value=httpx.Response(200, json=answer('{"name": "Ly', "length")))
        with pytest.raises(LengthFinishReasonError) as info:
            await client.chat.completions.parse(model="m", messages=MSG, response_format=City)
        assert info.value.completion.choices[0].finish_reason == "length"
        route.mock(return_value=httpx.Response(200, json=answer(None, "content_filter")))
        with pytest.raises(ContentFilterFinishReasonError):
            await client.chat.completions.parse(model="m", messages=MSG, response_format=City)
        route.mock(return_value=httpx.Response(200, json=answer(None, refusal="I can't.")))
        out = await client.chat.completions.parse(model="m", messages=MSG, response_format=City)
        assert out.choices[0].message.parsed is None
        assert out.choices[0].message.refusal == "I can't."
        route.mock(return_value=httpx.Response(200, json=answer('{"name": "x"}')))
        with pytest.raises(pydantic.ValidationError):
            await client.chat.completions.parse(model="m", messages=MSG, response_format=City)
        with pytest.raises(TypeError):
            await client.chat.completions.parse(model="m", messages=MSG, response_format=42)  # type: ignore[arg-type]
        assert client.limiter.in_flight == 0


@respx.mock
async def test_parse_dataclass_and_dict_formats_and_strict_tool_arguments(make_client) -> None:
    @dataclasses.dataclass
    class Point:
        x: int
        y: int

    tools = [
        {
            "type": "function",
            "function": {
                "name": "move",
                "strict": True,
                "parameters": {"type": "object", "properties": {"dx": {"type": "integer"}}},
            },
        },
        {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}},
    ]
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "move", "arguments": '{"dx": 2}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "look", "arguments": "{}"}},
    ]
    route = respx.post(f"{BASE}/chat/completions")
    async with make_client() as client:
        route.mock(return_value=httpx.Response(200, json=answer('{"x": 1, "y": 2}')))
        out = await client.chat.completions.parse(model="m", messages=MSG, response_format=Point)
        assert out.choices[0].message.parsed == Point(1, 2)
        route.mock(return_value=httpx.Response(200, json=answer('{"a": 1}')))
        fmt = {"type": "json_object"}
        out = await client.chat.completions.parse(model="m", messages=MSG, response_format=fmt)
        assert out.choices[0].message.parsed is None  # a dict format is sent, not parsed
        assert json.loads(route.calls[-1].request.content)["response_format"] == fmt
        route.mock(
            return_value=httpx.Response(200, json=answer(None, "tool_calls", tool_calls=calls))
        )
        out = await client.chat.completions.parse(
            model="m", messages=MSG, tools=tools, tool_choice="required"
        )
    got = out.choices[0].message.tool_calls
    assert got is not None and [c.function.name for c in got] == ["move", "look"]
    assert got[0].function.parsed_arguments == {"dx": 2}  # a strict tool: decoded
    assert got[1].function.parsed_arguments is None  # not strict: left to the caller
    assert json.loads(route.calls[-1].request.content)["tool_choice"] == "required"


def test_strict_schema_keeps_dict_fields_open() -> None:
    class Bag(pydantic.BaseModel):
        counts: dict[str, int]

    schema = strict_json_schema(Bag.model_json_schema())
    assert schema["additionalProperties"] is False and schema["required"] == ["counts"]
    assert schema["properties"]["counts"]["additionalProperties"] == {"type": "integer"}


@respx.mock
def test_sync_parse() -> None:
    respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, json=answer(json.dumps(CITY)))
    )
    with Client(BASE, max_retries=0) as client:
        out = client.chat.completions.parse(model="m", messages=MSG, response_format=City)
    assert out.choices[0].message.parsed == City.model_validate(CITY)
