"""vLLM's ``truncate_prompt_tokens`` in local mode: the prompt's last k tokens are kept (chat
and completions; ``-1``: ``max_model_len``), a prompt past the context is served once cut, and
0, below -1 or over ``max_model_len`` is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.support.gateway import module_server

MODEL = "aidreams-260k"
server = module_server(MODEL)
LONG = "Once upon a time, " * 60  # more tokens than the 128-token context holds


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _post(http: httpx.Client, path: str, **body) -> httpx.Response:
    return http.post(path, json={"model": MODEL, "max_tokens": 4, "temperature": 0, **body})


def test_completions_keep_the_last_tokens(http):
    assert _post(http, "/v1/completions", prompt=LONG).status_code == 400  # past the context
    r = _post(http, "/v1/completions", prompt=LONG, truncate_prompt_tokens=20)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20
    last = http.post("/tokenize", json={"prompt": LONG}).json()["tokens"][-20:]
    same = _post(http, "/v1/completions", prompt=last)
    assert same.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]


def test_chat_keeps_the_last_tokens(http):
    messages = [{"role": "user", "content": LONG}]
    assert _post(http, "/v1/chat/completions", messages=messages).status_code == 400
    r = _post(http, "/v1/chat/completions", messages=messages, truncate_prompt_tokens=32)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 32


def test_minus_one_is_the_context_and_a_short_prompt_is_kept_whole(http):
    whole = _post(http, "/v1/completions", prompt="Once upon a time")
    cut = _post(http, "/v1/completions", prompt="Once upon a time", truncate_prompt_tokens=-1)
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"] == whole.json()["usage"]
    assert cut.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]


@pytest.mark.parametrize("value", [0, -2, 129, "5", 1.5])
def test_bad_values_are_400s_naming_the_field(http, value):
    for path, extra in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = _post(http, path, truncate_prompt_tokens=value, **extra)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
