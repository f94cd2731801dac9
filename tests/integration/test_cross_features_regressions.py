"""Every failure the cross-feature property test (``test_cross_features.py``) found, as a
named test holding the right value, each on the request hypothesis drew (shrunk by hand).

The engine classes (grammar vs ``min_tokens``, stop strings vs ``min_tokens``, stop ids vs the
grammar) are fixed in the engine's ordered logits pipeline (``engine/logits_processors.py``);
the gateway class (a cut ``required`` call returned as content) in ``wire/tools.py``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from support.gateway import serve_aidreams, wait_idle  # noqa: E402
from support.schemas import TIME_TOOL as TIME

MODEL = "aidreams-260k"
CHOICE = ["yes", "no", "maybe"]
PET = [{"role": "user", "content": "A pet, please"}]


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(
        aidreams_path, num_kv_blocks=8, model_name=MODEL, tool_call_parser="hermes"
    )


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60) as client:
        yield client


def _post(http: httpx.Client, server, **body) -> httpx.Response:
    return http.post(
        server.url + "/v1/chat/completions", json={"model": MODEL, "messages": PET, **body}
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_complete_before_min_tokens_is_not_a_500(server, http, pool_whole, stream):
    """Drawn: choice + ``min_tokens`` 23, n 2, temperature 0. Was: every logit −inf once the
    choice was complete, token 0 sampled, the engine raised, 500 ``engine_error``. The
    grammar wins (vLLM): the answer is a choice, finish "stop"."""
    r = _post(
        http, server, structured_outputs={"choice": CHOICE}, max_tokens=55, min_tokens=23, n=2,
        temperature=0, stream=stream,
    )  # fmt: skip
    try:
        assert r.status_code == 200, r.text
        if stream:  # the error of a stream comes in band, after the 200
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            assert not [e for e in events if "error" in e], events
            texts = ["", ""]
            for e in events:
                for c in e["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
            assert all(t in CHOICE for t in texts), texts
        else:
            for c in r.json()["choices"]:
                assert c["finish_reason"] == "stop" and c["message"]["content"] in CHOICE
    finally:
        wait_idle(server, pool_whole)


def test_a_required_call_complete_before_min_tokens_is_not_a_500(server, http, pool_whole):
    """Drawn: ``tool_choice: "required"``, one tool, ``min_tokens`` 28, seed 0. Was: 500."""
    r = _post(
        http, server, tools=[TIME], tool_choice="required", max_tokens=60, min_tokens=28,
        temperature=0.7, seed=0,
    )  # fmt: skip
    try:
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), TIME["function"]["parameters"]
        )
    finally:
        wait_idle(server, pool_whole)


def test_stop_strings_apply_only_after_min_tokens(server, http, pool_whole):
    """Drawn: ``min_tokens`` 52, stop ``["\\n", "."]``, temperature 0. Was: "stop" after 17
    tokens at the first ".". vLLM's current rule: stop strings only after ``min_tokens``."""
    r = _post(
        http, server, max_tokens=56, min_tokens=52, stop=["\n", "."], temperature=0,
        logprobs=True,
    )  # fmt: skip
    try:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 52, body
        assert len(body["choices"][0]["logprobs"]["content"]) >= 52
    finally:
        wait_idle(server, pool_whole)


def test_a_stop_token_id_never_cuts_a_json_answer(server, http, pool_whole):
    """Drawn: ``json_object``, ``stop_token_ids`` [451] (aidreams' "y"), n 2, seed 0. Was:
    ``{"ands matrices unfolding like s sing maps. Contrast emerge, tendr`` with finish
    "stop": the stop id ended the answer mid-string. A finished answer is whole JSON."""
    r = _post(
        http, server, response_format={"type": "json_object"}, max_tokens=39,
        stop_token_ids=[451], n=2, temperature=0.7, seed=0,
    )  # fmt: skip
    try:
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            if c["finish_reason"] == "stop":
                assert isinstance(json.loads(c["message"]["content"]), dict), c
    finally:
        wait_idle(server, pool_whole)


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_required_call_never_returns_its_json_as_content(server, http, pool_whole, stream):
    """Drawn (before the gateway fix): ``tool_choice: "required"``, two tools, parallel calls,
    ``max_tokens`` 8, n 3, temperature 0: each choice's ``content`` was the internal array
    text ``[{"name"`` (finish "length"). A cut constrained call is never content."""
    r = _post(
        http, server, tools=[TIME, {**TIME, "function": {**TIME["function"], "name": "t2"}}],
        tool_choice="required", parallel_tool_calls=True, max_tokens=8, n=3, temperature=0,
        stream=stream,
    )  # fmt: skip
    try:
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            deltas = [c for e in events for c in e["choices"]]
            assert not [c for c in deltas if c["delta"].get("content")], deltas
            assert [c["finish_reason"] for c in deltas if c["finish_reason"]] == ["length"] * 3
        else:
            for c in r.json()["choices"]:
                assert c["finish_reason"] == "length" and c["message"]["content"] is None, c
    finally:
        wait_idle(server, pool_whole)
