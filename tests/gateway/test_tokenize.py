"""POST /tokenize against the fake engine: counts as the generation routes render prompts."""

from __future__ import annotations

import httpx
import openai


def test_tokenize_counts_what_chat_and_completions_send(serve_fake):
    srv, engine = serve_fake()
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(srv.url + "/tokenize", json={"model": "fake", "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    chat = client.chat.completions.create(model="fake", messages=messages, max_tokens=1)
    assert body["count"] == chat.usage.prompt_tokens == len(body["tokens"])
    assert body["max_model_len"] == engine.max_model_len
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "hello"})
    done = client.completions.create(model="fake", prompt="hello", max_tokens=1)
    assert r.json()["count"] == done.usage.prompt_tokens
    assert len(engine.requests_seen) == 2  # counting ran no engine request


def test_tokenize_bad_input(serve_fake):
    srv, _ = serve_fake()
    both = {"messages": [{"role": "user", "content": "a"}], "prompt": "a"}
    for body in ({}, both, {"prompt": 5}):
        r = httpx.post(srv.url + "/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(srv.url + "/tokenize", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
