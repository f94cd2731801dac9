"""``/v1/responses``'s ``text.format`` (local mode): ``json_schema`` and ``json_object`` constrain
the output as chat's ``response_format`` does, through the official client's ``responses.parse``
and ``responses.create`` (whole and streamed); wrong shapes are 400s naming ``text.format``."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

pytest.importorskip("prefixgate.engine.async_engine")

from support.gateway import openai_client, serve_aidreams, wait_idle  # noqa: E402

MODEL = "aidreams-260k"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}


class Pick(BaseModel):
    color: Literal["red", "blue"]


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(aidreams_path, model_name=MODEL)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def test_parse_with_a_pydantic_model_gives_an_instance(client, server, pool_whole):
    # openai-python sends text.format json_schema (strict) and parses the output text
    got = client.responses.parse(
        model=MODEL, input="Pick a color.", text_format=Pick, max_output_tokens=40, temperature=0
    )
    assert got.status == "completed", got
    assert isinstance(got.output_parsed, Pick)
    assert got.text.format.type == "json_schema" and got.text.format.name == "Pick"
    wait_idle(server, pool_whole, 10, pinned_ok=True)


def test_json_schema_whole_and_streamed_agree(client, server, pool_whole):
    kw = dict(model=MODEL, input="Pick a color.", max_output_tokens=40, temperature=0)
    whole = client.responses.create(text={"format": FORMAT}, **kw)
    assert whole.status == "completed"
    assert json.loads(whole.output_text)["color"] in ("red", "blue")
    # the format is stated back as asked
    assert whole.text.format.model_dump(exclude_none=True, by_alias=True) == FORMAT
    with client.responses.stream(text={"format": FORMAT}, **kw) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    wait_idle(server, pool_whole, 10, pinned_ok=True)


def test_json_object_gives_a_json_object(client, server, pool_whole):
    got = client.responses.create(
        model=MODEL,
        input="Give an object.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        temperature=0,
    )
    if got.status == "completed":  # a cut answer is a prefix of one
        assert isinstance(json.loads(got.output_text), dict)
    else:
        assert got.output_text.lstrip().startswith("{")
    wait_idle(server, pool_whole, 10, pinned_ok=True)


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema", "schema": SCHEMA}, "text.format"),  # no name
        ({"type": "json_schema", "name": "x"}, "text.format"),  # no schema
        ({"type": "json_schema", "name": "a b", "schema": SCHEMA}, "text.format.name"),
        ({"type": "json_schema", "name": "x", "schema": "{}"}, "text.format.schema"),
        (
            {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": "yes"},
            "text.format.strict",
        ),
        (
            {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}},
            "text.format.schema",
        ),
        ({"type": "text", "name": "x"}, "text.format"),
        ({"type": "json_object", "schema": SCHEMA}, "text.format"),
        ({"type": "json_schema", "name": "x", "schema": SCHEMA, "extra": 1}, "text.format.extra"),
    ],
)
def test_a_wrong_format_is_a_400_naming_it(server, fmt, param, pool_whole):
    body = {"model": MODEL, "input": "hi", "text": {"format": fmt}}
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    wait_idle(server, pool_whole, 10, pinned_ok=True)
