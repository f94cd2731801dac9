"""Typed results: nested parsing, defaults for missing fields, unknown fields kept."""

from __future__ import annotations

import pytest
from prefixgate.sdk.types import ChatCompletion, ChatCompletionChunk, Completion, ModelList

from .conftest import completion_body


def test_chat_completion_nested_and_unknown_fields() -> None:
    logprobs = {"content": [{"token": "hi", "logprob": -0.1, "top_logprobs": []}]}
    message = {"role": "assistant", "content": "hi", "audio": None}
    data = {
        **completion_body(message, logprobs=logprobs),
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 1,
            "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 8, "audio_tokens": 0},
        },
        "service_tier": "default",
    }
    c = ChatCompletion.from_dict(data)
    assert c.choices[0].message.content == "hi"
    assert c.choices[0].logprobs.content[0].logprob == -0.1
    assert c.usage.prompt_tokens_details.cached_tokens == 8
    assert c.usage.cached_tokens == 8
    assert c.service_tier == "default"  # unknown top-level field
    assert c.usage.prompt_tokens_details.audio_tokens == 0  # unknown nested field
    assert c.to_dict()["usage"]["prompt_tokens_details"] == {"cached_tokens": 8, "audio_tokens": 0}
    with pytest.raises(AttributeError):
        _ = c.nope


def test_partial_bodies_get_defaults() -> None:
    c = ChatCompletion.from_dict({"choices": [{"message": {"content": "x"}}]})
    assert c.usage is None and c.choices[0].finish_reason is None
    chunk = ChatCompletionChunk.from_dict({"choices": [{"delta": {}}]})
    assert chunk.choices[0].delta.content is None
    assert Completion.from_dict({"choices": [{"text": "a"}]}).choices[0].text == "a"
    models = ModelList.from_dict({"data": [{"id": "a"}, {"id": "b"}]})
    assert [m.id for m in models] == ["a", "b"] and len(models) == 2


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(TypeError):
        ChatCompletion.from_dict(["not", "a", "dict"])  # type: ignore[arg-type]
