"""The SDK's types parse the recorded OpenAI wire shapes in ``tests/fixtures/openai_wire``.

The same files are checked against openai-python's own response models (so they are the real
shapes) and, on the server side, against the gateway's pydantic models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prefixgate.sdk.types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelInfo,
    ModelList,
)

WIRE = Path(__file__).resolve().parents[1] / "fixtures" / "openai_wire"


def load(name: str) -> Any:
    return json.loads((WIRE / name).read_text())


def test_chat_completion_parses() -> None:
    c = ChatCompletion.from_dict(load("chat_completion.json"))
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion"
    assert c.choices[0].message.content.startswith("The image shows")
    assert c.choices[0].finish_reason == "stop"
    assert c.usage is not None and c.usage.prompt_tokens == 1117
    assert c.usage.prompt_tokens_details.cached_tokens == 1024
    assert c.usage.cached_tokens == 1024
    assert c.usage.completion_tokens_details.reasoning_tokens == 0
    assert c.system_fingerprint == "fp_fc9f1d7035"
    assert c.service_tier == "default"  # a field the SDK does not declare stays readable


def test_chat_completion_tool_calls_parse() -> None:
    c = ChatCompletion.from_dict(load("chat_completion_tool_calls.json"))
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 2
    assert [call.id for call in calls] == ["call_abc123", "call_def456"]
    assert {call.type for call in calls} == {"function"}
    assert {call.function.name for call in calls} == {"get_current_weather"}
    assert [json.loads(call.function.arguments) for call in calls] == [
        {"location": "Boston, MA"},
        {"location": "Paris, France", "unit": "celsius"},
    ]


def test_chat_completion_logprobs_parse() -> None:
    c = ChatCompletion.from_dict(load("chat_completion_logprobs.json"))
    content = c.choices[0].logprobs.content
    assert [t.token for t in content][:2] == ["Hello", "!"]
    assert content[0].top_logprobs[1].token == "Hi"
    assert content[0].top_logprobs[1].logprob == pytest.approx(-1.3190403)
    assert bytes(content[3].bytes + content[4].bytes).decode() == "é"


def test_chat_stream_chunks_parse() -> None:
    chunks = [ChatCompletionChunk.from_dict(d) for d in load("chat_completion_chunks.json")]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello! How can I assist you today?"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.cached_tokens == 1024
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_tool_call_fragments_parse() -> None:
    chunks = [
        ChatCompletionChunk.from_dict(d) for d in load("chat_completion_tool_call_chunks.json")
    ]
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for chunk in chunks:
        for frag in chunk.choices[0].delta.tool_calls or []:
            assert frag.function is not None
            names[frag.index] = names.get(frag.index, "") + (frag.function.name or "")
            args[frag.index] = args.get(frag.index, "") + (frag.function.arguments or "")
    assert names == {0: "get_weather", 1: "get_time"}
    assert {i: json.loads(a) for i, a in args.items()} == {
        0: {"location": "Paris"},
        1: {"tz": "CET"},
    }
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_completion_and_chunks_parse() -> None:
    c = Completion.from_dict(load("completion.json"))
    assert (
        c.choices[0].text == "\n\nThis is indeed a test" and c.choices[0].finish_reason == "length"
    )
    lp = c.choices[0].logprobs
    assert lp.tokens[2] == "This" and lp.top_logprobs[2]["Yes"] == pytest.approx(-1.2)
    assert lp.text_offset[-1] == 34
    chunks = [Completion.from_dict(d) for d in load("completion_chunks.json")]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "This is a test"
    assert chunks[-1].usage.total_tokens == 8


def test_models_parse() -> None:
    models = ModelList.from_dict(load("models_list.json"))
    assert [m.id for m in models][0] == "gpt-4o-mini" and len(models) == 3
    assert ModelInfo.from_dict(load("model.json")).owned_by == "system"


@pytest.mark.parametrize(
    "name", ["error_invalid_request.json", "error_rate_limit.json", "error_context_length.json"]
)
def test_error_objects_become_typed_errors(name: str) -> None:
    import httpx
    from prefixgate.sdk.errors import status_error

    body = load(name)
    status = 429 if "rate_limit" in name else 400
    response = httpx.Response(status, json=body, request=httpx.Request("POST", "http://x/v1"))
    err = status_error(response, body)
    assert err.status_code == status
    assert err.message.endswith(body["error"]["message"])
    assert (err.type, err.param, err.code) == (
        body["error"]["type"],
        body["error"]["param"],
        body["error"]["code"],
    )


def test_fixtures_are_openai_python_shapes() -> None:
    """Every fixture validates against openai-python's own response models."""
    openai_types = pytest.importorskip("openai.types")
    from openai.types.chat import ChatCompletion as OAChat
    from openai.types.chat import ChatCompletionChunk as OAChunk
    from openai.types.shared import ErrorObject

    for name in (
        "chat_completion.json",
        "chat_completion_tool_calls.json",
        "chat_completion_logprobs.json",
    ):
        OAChat.model_validate(load(name))
    for name in ("chat_completion_chunks.json", "chat_completion_tool_call_chunks.json"):
        for chunk in load(name):
            OAChunk.model_validate(chunk)
    openai_types.Completion.model_validate(load("completion.json"))
    for chunk in load("completion_chunks.json"):
        # openai-python types a completion choice's finish_reason as never null, yet streams
        # send null until the last chunk (it builds stream chunks without validation).
        if all(c["finish_reason"] is not None for c in chunk["choices"]):
            openai_types.Completion.model_validate(chunk)
    for m in load("models_list.json")["data"]:
        openai_types.Model.model_validate(m)
    openai_types.Model.model_validate(load("model.json"))
    for name in sorted(p.name for p in WIRE.glob("error_*.json")):
        ErrorObject.model_validate(load(name)["error"])


TYPED = {
    "chat_completion.json": ChatCompletion,
    "chat_completion_tool_calls.json": ChatCompletion,
    "chat_completion_logprobs.json": ChatCompletion,
    "chat_completion_chunks.json": ChatCompletionChunk,
    "chat_completion_tool_call_chunks.json": ChatCompletionChunk,
    "completion.json": Completion,
    "completion_chunks.json": Completion,
    "models_list.json": ModelList,
    "model.json": ModelInfo,
}


@pytest.mark.parametrize("name", sorted(TYPED))
def test_round_trip_is_lossless(name: str) -> None:
    """Parsed and dumped again, every fixture comes back exactly as sent (no field lost,
    renamed or re-typed), through ``to_dict()`` and ``model_dump_json()``."""
    data = load(name)
    items = data if isinstance(data, list) else [data]
    for item in items:
        parsed = TYPED[name].model_validate(item)
        assert parsed.to_dict() == item
        assert json.loads(parsed.model_dump_json(exclude_unset=True)) == item


def test_every_fixture_is_covered() -> None:
    errors = {p.name for p in WIRE.glob("error_*.json")}
    assert {p.name for p in WIRE.glob("*.json")} == set(TYPED) | errors
