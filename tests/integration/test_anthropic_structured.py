"""Anthropic's structured output on ``/v1/messages`` (``output_config.format`` and the older
``output_format``, ``{"type": "json_schema", "schema": ...}``) on the grammar path, against the
real tiny Llama (aidreams-260k, whose free text is never JSON): the answer's text parses and
follows the schema, whole and streamed, in local mode and through a proxy relaying to it; the
``anthropic`` client and langchain-anthropic's ``with_structured_output(method="json_schema")``
end to end. What cannot go together (a forced tool call, stop sequences, both spellings) is a
400 naming the field, and a schema that does not compile a 400 naming its place."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import anthropic
import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from pydantic import BaseModel
from support.gateway import serve_aidreams, wait_idle
from support.schemas import PET_SCHEMA as SCHEMA
from support.schemas import Pet

pytest.importorskip("prefixgate.engine.async_engine")

MODEL = "aidreams-260k"


@pytest.fixture(scope="module")
def local(aidreams_path) -> Iterator[BackgroundServer]:
    """aidreams served."""
    yield from serve_aidreams(aidreams_path, model_name=MODEL)


@pytest.fixture(scope="module")
def urls(local) -> Iterator[dict[str, str]]:
    """``{"local": url, "proxy": url}``: aidreams served, and a proxy relaying to it."""
    proxy = BackgroundServer(lambda: create_proxy_app([local.url], GatewaySettings())).__enter__()
    try:
        yield {"local": local.url, "proxy": proxy.url}
    finally:
        proxy.close()


@pytest.fixture(autouse=True)
def _pool_whole_after(local, pool_whole) -> Iterator[None]:
    """Every scenario ends with the engine idle and its block pool whole."""
    yield
    wait_idle(local, pool_whole)


def _body(**kw: object) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "A pet"}],
        **kw,
    }


def _check(text: str) -> None:
    Pet.model_validate(json.loads(text))


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_output_config_format_constrains_whole_and_streamed_answers(urls, mode):
    client = anthropic.Anthropic(base_url=urls[mode], api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "schema": SCHEMA}
    for seed_text in ("A pet", "Another pet"):
        msg = client.messages.create(
            model=MODEL,
            max_tokens=100,
            messages=[{"role": "user", "content": seed_text}],
            extra_body={"output_config": {"format": fmt}},
        )
        assert msg.stop_reason == "end_turn", msg
        _check(msg.content[0].text)
    with client.messages.stream(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "A pet"}],
        extra_body={"output_format": fmt},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    _check(text)


def test_refusals_name_the_field(urls):
    fmt = {"type": "json_schema", "schema": SCHEMA}
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    cases = [
        (_body(output_config={"format": fmt}, stop_sequences=["}"]), "stop_sequences"),
        (
            _body(output_config={"format": fmt}, tools=tools, tool_choice={"type": "any"}),
            "output_config.format",
        ),
        (_body(output_config={"format": fmt}, output_format=fmt), "output_format"),
        (_body(output_config={"effort": "low"}), "output_config.effort"),
        (
            _body(output_config={"format": {"type": "json_schema", "schema": {"type": 5}}}),
            "output_config.format.schema",
        ),
    ]
    for mode, url in urls.items():
        for body, field in cases:
            if mode == "proxy" and field == "output_config.format.schema":
                continue  # the relayed upstream answers it (a 400 too)
            r = httpx.post(url + "/v1/messages", json=body, timeout=30)
            assert r.status_code == 400, (mode, field, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert err["message"].startswith(field), (mode, field, err)


class Choice(BaseModel):
    """For langchain-anthropic: its ``transform_schema`` moves ``maxLength`` / ``minimum`` /
    ``maximum`` into descriptions (Anthropic's schema subset), so a free string or integer
    of the tiny model's would be unbounded; enums and booleans stay bounded."""

    kind: Literal["cat", "dog", "owl"]
    indoor: bool


def test_langchain_anthropic_with_structured_output_json_schema(urls):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    llm = langchain_anthropic.ChatAnthropic(
        model=MODEL,
        base_url=urls["local"],
        api_key="none",
        max_tokens=100,
        max_retries=0,
    )
    structured = llm.with_structured_output(Choice, method="json_schema")
    for prompt in ("A pet", "Which pet?"):
        assert isinstance(structured.invoke(prompt), Choice)
