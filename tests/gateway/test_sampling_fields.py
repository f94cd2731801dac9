"""Each dialect's request model makes its own SamplingParams through wire/sampling.py: a field
not given is the engine's default; a value the engine refuses is a 400 naming the wire field."""

from __future__ import annotations

import pytest
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.local.responses_api import ResponsesRequest
from prefixgate.gateway.wire.anthropic_models import MessagesRequest
from prefixgate.gateway.wire.gemini_models import GenerationConfig
from prefixgate.gateway.wire.request_models import ChatCompletionRequest
from prefixgate.gateway.wire.sampling import sampling_params


def test_absent_fields_are_the_engine_defaults():
    got = sampling_params({"temperature": None, "top_k": None, "max_tokens": 5}, {})
    assert got == SamplingParams(max_tokens=5)
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    assert chat.sampling_params(5, None) == SamplingParams(max_tokens=5)
    gc = GenerationConfig.model_validate({})
    assert gc.sampling_params(5, None, [], None, True) == SamplingParams(max_tokens=5)
    resp = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    assert resp.sampling_params(5) == SamplingParams(max_tokens=5)


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda: sampling_params({"top_k": -7}, {"top_k": "topK"}, prefix="g."), "g.topK"),
        (lambda: sampling_params({"top_k": -7}, {}), None),
        (
            lambda: ChatCompletionRequest.model_construct(
                **{**ChatCompletionRequest.model_validate({"model": "m"}).__dict__, "top_k": -7}
            ).sampling_params(5, None),
            "top_k",
        ),
        (
            lambda: MessagesRequest.model_construct(
                temperature=None, top_p=None, top_k=-7, stop_sequences=None
            ).sampling_params(5, None, True),
            "top_k",
        ),
        (
            lambda: GenerationConfig.model_construct(
                **{**GenerationConfig.model_validate({}).__dict__, "topK": -7}
            ).sampling_params(5, None, [], None, True),
            "generationConfig.topK",
        ),
        (
            lambda: ResponsesRequest.model_construct(temperature=-1.0, top_p=None).sampling_params(
                5
            ),
            "temperature",
        ),
    ],
)
def test_a_refused_value_names_its_wire_field(make, param):
    with pytest.raises(APIError) as info:
        make()
    assert info.value.status == 400 and info.value.param == param
