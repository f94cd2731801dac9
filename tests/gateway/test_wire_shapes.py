"""The gateway's OpenAI wire shapes against the recorded OpenAI bodies (tests/fixtures/openai_wire).

Two checks per shape, on the server side of the fixtures the SDK's types also parse:
1. every recorded body validates against the gateway's pydantic model of it (``responses``);
2. every body the gateway sends validates against the same model, and every key it sends at
   every level is a key the recorded OpenAI body has at that level (nothing invented), but
   for the extras named in ``EXTRAS`` (vLLM's ``max_model_len`` of a model card).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prefixgate.gateway.http.errors import ErrorResponse
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.wire.response_models import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelCard,
    ModelList,
)
from pydantic import BaseModel

WIRE = Path(__file__).resolve().parents[1] / "fixtures" / "openai_wire"

RECORDED: list[tuple[str, type[BaseModel]]] = [
    ("chat_completion.json", ChatCompletion),
    ("chat_completion_logprobs.json", ChatCompletion),
    ("chat_completion_tool_calls.json", ChatCompletion),
    ("chat_completion_chunks.json", ChatCompletionChunk),
    ("chat_completion_tool_call_chunks.json", ChatCompletionChunk),
    ("completion.json", Completion),
    ("completion_chunks.json", Completion),
    ("models_list.json", ModelList),
    ("model.json", ModelCard),
    ("error_context_length.json", ErrorResponse),
    ("error_invalid_request.json", ErrorResponse),
    ("error_rate_limit.json", ErrorResponse),
]

EXTRAS = {"max_model_len"}


def load(name: str) -> Any:
    return json.loads((WIRE / name).read_text())


@pytest.mark.parametrize(("name", "model"), RECORDED)
def test_recorded_bodies_validate_against_the_gateway_models(name, model):
    data = load(name)
    for body in data if isinstance(data, list) else [data]:
        parsed = model.model_validate(body)
        # What the model declares keeps the recorded value (no coercion, nothing dropped).
        declared = parsed.model_dump(exclude_unset=True)
        assert_same_where_declared(declared, body, name)


def assert_same_where_declared(ours: Any, recorded: Any, path: str) -> None:
    if isinstance(ours, dict):
        for key, value in ours.items():
            assert key in recorded, f"{path}.{key}"
            assert_same_where_declared(value, recorded[key], f"{path}.{key}")
    elif isinstance(ours, list):
        assert len(ours) == len(recorded), path
        for i, (a, b) in enumerate(zip(ours, recorded, strict=True)):
            assert_same_where_declared(a, b, f"{path}[{i}]")
    else:
        assert ours == recorded, path


def assert_keys_recorded(ours: Any, recorded: Any, path: str = "body") -> None:
    """Every key of ``ours`` (at every level) is a key of ``recorded`` at that level; list
    items are compared with the recorded list's items (any one holding the key)."""
    if isinstance(ours, dict):
        assert isinstance(recorded, dict), f"{path}: recorded is {type(recorded).__name__}"
        for key, value in ours.items():
            if key in EXTRAS:
                continue
            assert key in recorded, f"{path}.{key} is not in the recorded OpenAI body"
            if value is not None and recorded[key] is not None:
                assert_keys_recorded(value, recorded[key], f"{path}.{key}")
    elif isinstance(ours, list) and ours and isinstance(ours[0], dict):
        if all(isinstance(v, int | float) for item in recorded for v in item.values()):
            return  # a map (completions' top_logprobs: token -> logprob): its keys are data
        merged: dict[str, Any] = {}
        for item in recorded:
            for key, value in item.items():
                if merged.get(key) is None:
                    merged[key] = value
        for i, item in enumerate(ours):
            assert_keys_recorded(item, merged, f"{path}[{i}]")


def assert_keys_in_one_of(ours: dict, recorded: list[dict]) -> None:
    """``assert_keys_recorded`` against at least one of the recorded stream's chunks."""
    failures = []
    for item in recorded:
        try:
            assert_keys_recorded(ours, item)
            return
        except AssertionError as exc:
            failures.append(str(exc))
    raise AssertionError(f"{ours} matches no recorded chunk: {failures}")


def sse_events(response) -> list[dict]:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def check(body: dict, model: type[BaseModel], *recorded: str) -> None:
    model.model_validate(body)
    for name in recorded:
        data = load(name)
        assert_keys_recorded(body, data[0] if isinstance(data, list) else data)


def test_gateway_bodies_have_the_recorded_shapes(serve_fake, gw):
    srv, _ = serve_fake(GatewaySettings(model_name="fake"))
    with gw.client(srv) as http:
        chat = http.post(
            "/v1/chat/completions", json=gw.chat_body(max_tokens=3, logprobs=True, top_logprobs=2)
        )
        assert chat.status_code == 200
        check(chat.json(), ChatCompletion, "chat_completion.json")
        check(chat.json(), ChatCompletion, "chat_completion_logprobs.json")

        stream = http.post(
            "/v1/chat/completions",
            json=gw.chat_body(
                max_tokens=3, n=2, stream=True, stream_options={"include_usage": True}
            ),
        )
        chunks = sse_events(stream)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        for chunk in chunks:
            check(chunk, ChatCompletionChunk)
        recorded_chunks = load("chat_completion_chunks.json")
        for chunk in chunks:
            assert_keys_in_one_of(chunk, recorded_chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}

        comp = http.post(
            "/v1/completions",
            json={"model": "fake", "prompt": "hi", "max_tokens": 3, "logprobs": 2},
        )
        assert comp.status_code == 200
        check(comp.json(), Completion, "completion.json")

        comp_stream = http.post(
            "/v1/completions",
            json={
                "model": "fake",
                "prompt": "hi",
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        recorded = load("completion_chunks.json")
        cchunks = sse_events(comp_stream)
        assert cchunks[-1]["choices"] == [] and "usage" in cchunks[-1]
        for chunk in cchunks:
            check(chunk, Completion)
            assert_keys_in_one_of(chunk, recorded)

        check(http.get("/v1/models").json(), ModelList, "models_list.json")
        check(http.get("/v1/models/fake").json(), ModelCard, "model.json")
        error = http.get("/v1/models/nope")
        assert error.status_code == 404
        check(error.json(), ErrorResponse, "error_invalid_request.json")
