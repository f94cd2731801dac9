"""vLLM's sampling extras in local mode, on chat and completions: ``skip_special_tokens``
(default true), ``include_stop_str_in_output`` (the stop string, or the stop token's text,
kept at the end), ``bad_words`` (never generated); their bad values are 400s naming them."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.gateway import module_server

MODEL = "aidreams-260k"
server = module_server(MODEL)
EOS = 2  # "</s>"
GREEDY = ", pixels unfolding like petals"  # aidreams-260k's greedy 12 tokens after PROMPT
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _complete(http: httpx.Client, **body) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed(http: httpx.Client, path: str, body: dict) -> tuple[str, str | None]:
    text, finish = "", None
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
    return text, finish


def test_greedy_reference(http):
    assert _complete(http)["text"] == GREEDY


def test_skip_special_tokens_false_keeps_them_in_the_text(http):
    forced = {"ignore_eos": True, "logit_bias": {str(EOS): 100}, "max_tokens": 3}
    assert _complete(http, **forced)["text"] == ""
    assert _complete(http, **forced, skip_special_tokens=False)["text"] == "</s>" * 3
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **forced}
    r = http.post("/v1/chat/completions", json={**chat, "skip_special_tokens": False})
    assert r.json()["choices"][0]["message"]["content"] == "</s>" * 3, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(http, stream):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    for include, want in ((True, ", pixels unfolding"), (False, ", pixels ")):
        extra = {"stop": ["unfolding"], "include_stop_str_in_output": include}
        if stream:
            text, finish = _streamed(http, "/v1/completions", {**body, **extra})
        else:
            choice = _complete(http, **extra)
            text, finish = choice["text"], choice["finish_reason"]
        assert (text, finish) == (want, "stop")


def test_include_stop_str_in_output_keeps_a_stop_token_text(http):
    forced = {"stop_token_ids": [EOS], "logit_bias": {str(EOS): 100}, "skip_special_tokens": False}
    assert _complete(http, **forced)["text"] == ""
    kept = _complete(http, **forced, include_stop_str_in_output=True)
    assert (kept["text"], kept["finish_reason"]) == ("</s>", "stop")


def test_bad_words_are_never_generated(http):
    assert "pixels" not in _complete(http, bad_words=["pixels"])["text"]
    assert "petals" not in _complete(http, bad_words=["petals"])["text"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12}
    first = http.post("/v1/chat/completions", json={**chat, "temperature": 0}).json()
    words = [w for w in first["choices"][0]["message"]["content"].split() if w.isalpha()]
    again = http.post(
        "/v1/chat/completions", json={**chat, "temperature": 0, "bad_words": words[:1]}
    ).json()
    assert words[0] not in again["choices"][0]["message"]["content"].split()


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("skip_special_tokens", "no", "skip_special_tokens"),
        ("include_stop_str_in_output", 1, "include_stop_str_in_output"),
        ("bad_words", "pixels", "bad_words"),
        ("bad_words", [1], "bad_words.0"),
        ("bad_words", [" "], "bad_words"),
    ],
)
def test_bad_values_are_400s_naming_the_field(http, field, value, param):
    for path, extra in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = http.post(path, json={"model": MODEL, "max_tokens": 2, field: value, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
