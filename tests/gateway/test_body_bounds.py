"""Work bounded before it is done, on every route (``wire/request_models.py``: ``load_json``,
``check_counts``, ``parse``; ``local/tokenize.py``): JSON nested past ``MAX_JSON_DEPTH`` is a 400
``invalid_json`` on every route (``/v1/responses`` was a 500, a RecursionError), more than
``MAX_MESSAGES`` messages a 400 ``too_many_messages`` counted before any message is validated
or rendered, and ``/tokenize`` tokenizes nothing it could never use (past
``TOKENIZE_CONTEXTS`` x the context by the text's lower bound), in local and proxy mode."""

from __future__ import annotations

import json

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.tokenize import TOKENIZE_CONTEXTS
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.wire.request_models import MAX_JSON_DEPTH, MAX_MESSAGES
from support.http import assert_openai_error

DEEP = 2000
assert DEEP > MAX_JSON_DEPTH


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (path, the body with NESTED where the deep value goes)
ROUTES = [
    ("/v1/chat/completions", '{"model": "fake", "messages": NESTED}'),
    (
        "/v1/chat/completions",
        '{"model": "fake", "messages": [{"role": "user", "content": NESTED}]}',
    ),
    ("/v1/chat/completions", '{"model": "fake", "messages": [], "metadata": NESTED}'),
    ("/v1/completions", '{"model": "fake", "prompt": NESTED}'),
    ("/v1/responses", '{"model": "fake", "input": NESTED}'),
    ("/v1/responses", '{"model": "fake", "input": "hi", "metadata": {"a": NESTED}}'),
    ("/v1/prefixes", '{"model": "fake", "messages": NESTED}'),
    ("/v1/embeddings", '{"model": "fake", "input": NESTED}'),
    ("/tokenize", '{"model": "fake", "messages": NESTED}'),
    ("/tokenize", '{"model": "fake", "prompt": NESTED}'),
    ("/detokenize", '{"model": "fake", "tokens": NESTED}'),
]


@pytest.fixture
def both(serve_fake):
    """``[(mode, url)]``: a gateway on the fake engine, and a proxy in front of it."""
    local, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    proxy = BackgroundServer(lambda: create_proxy_app([local.url], GatewaySettings())).__enter__()
    yield [("local", local.url), ("proxy", proxy.url)]
    proxy.close()


def test_nesting_past_the_bound_is_a_400_on_every_route(both):
    for mode, url in both:
        with httpx.Client(base_url=url, timeout=30) as http:
            for path, template in ROUTES:
                body = template.replace("NESTED", _nested(DEEP)).encode()
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
                err = assert_openai_error(r, 400)
                assert err["code"] == "invalid_json", (mode, path, err)
                assert "recursion" in err["message"], (mode, path, err)
                # well-formed JSON, too deep: told its depth, never "malformed"
                assert "malformed" not in err["message"], (mode, path, err)
                assert str(MAX_JSON_DEPTH) in err["message"], (mode, path, err)
            assert http.get("/health").status_code == 200


def test_nesting_within_the_bound_is_judged_by_the_fields(both):
    """A body nested less than ``MAX_JSON_DEPTH`` is parsed: its fields decide (400 naming
    the field, not ``invalid_json``)."""
    body = '{"model": "fake", "messages": [{"role": "user", "content": NESTED}]}'
    for _, url in both:
        r = httpx.post(
            url + "/v1/chat/completions",
            content=body.replace("NESTED", _nested(MAX_JSON_DEPTH - 10)).encode(),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        err = assert_openai_error(r, 400)
        assert err["code"] != "invalid_json", err


def _many(n: int) -> list[dict]:
    return [{"role": "user", "content": "a"}] * n


def test_more_messages_than_the_bound_are_refused_by_count(both):
    """~120k tiny messages (4.1 MB): 400 ``too_many_values`` (the ingress guard counts their
    strings before parsing), and one more than ``MAX_MESSAGES`` ``too_many_messages`` naming
    the field, counted on the parsed JSON before a message is validated or rendered; chat,
    responses, prefixes, tokenize, and the proxy's chat and prefixes."""
    many = _many(120_000)  # 4.1 MB, under the default 4 MiB body limit
    bodies = [
        ("/v1/chat/completions", {"model": "fake", "messages": many}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "fake", "messages": _many(MAX_MESSAGES + 1)},
            "messages",
        ),
        ("/v1/responses", {"model": "fake", "input": many}, "input"),
        ("/v1/prefixes", {"model": "fake", "messages": many}, "messages"),
        ("/tokenize", {"model": "fake", "messages": many}, "messages"),
    ]
    for _mode, url in both:
        with httpx.Client(base_url=url, timeout=60) as http:
            for path, body, param in bodies:
                r = http.post(path, content=json.dumps(body).encode())
                err = assert_openai_error(r, 400)
                if len(body["messages" if "messages" in body else "input"]) > 100_000:
                    # counted by the ingress guard's quote count, before parsing
                    assert err["code"] == "too_many_values", err
                    continue
                assert (err["code"], err["param"]) == ("too_many_messages", param), err
                assert str(MAX_MESSAGES) in err["message"]


def test_the_bound_itself_is_not_refused_by_count(both):
    """``MAX_MESSAGES`` messages pass the count (the fake model's context of 128 tokens then
    refuses them: by length, not by count)."""
    for _mode, url in both:
        with httpx.Client(base_url=url, timeout=60) as http:
            for path, body in [
                ("/v1/chat/completions", {"model": "fake", "messages": _many(MAX_MESSAGES)}),
                ("/tokenize", {"model": "fake", "messages": _many(MAX_MESSAGES)}),
            ]:
                r = http.post(path, json=body)
                assert_openai_error(r, 400, "context_length_exceeded", "messages")


def test_tokenize_counts_up_to_its_cap_and_refuses_beyond_before_tokenizing(serve_fake):
    """The fake tokenizer is one token per byte (its lower bound exact): a prompt of
    ``TOKENIZE_CONTEXTS * max_model_len - 1`` bytes is counted, one byte more refused naming
    the field, for ``prompt`` (both ``add_special_tokens``) and ``messages``."""
    srv, engine = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    cap = TOKENIZE_CONTEXTS * engine.max_model_len
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for extra in ({}, {"add_special_tokens": False}):
            r = http.post("/tokenize", json={"model": "fake", "prompt": "a" * (cap - 1), **extra})
            assert r.status_code == 200, r.text
            assert r.json()["count"] >= cap - 1  # counted beyond the context
            assert r.json()["count"] > engine.max_model_len
            r = http.post("/tokenize", json={"model": "fake", "prompt": "a" * cap, **extra})
            err = assert_openai_error(r, 400, "context_length_exceeded", "prompt")
            assert f"{cap} tokens" in err["message"] and "the text of prompt" in err["message"]
        msgs = [{"role": "user", "content": "a" * (4 * 1024 * 1024 - 100)}]
        r = http.post("/tokenize", json={"model": "fake", "messages": msgs})
        assert_openai_error(r, 400, "context_length_exceeded", "messages")
