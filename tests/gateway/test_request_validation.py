"""Bad request bodies get the documented OpenAI error naming the field (or are served), the
server keeps serving and nothing leaks; a huge prompt's tokenization stalls no other client
(fake engine, fast)."""

from __future__ import annotations

import logging

import pytest
from prefixgate.gateway.wire.prompts import check_tool_turns, choice_seeds
from support.http import assert_openai_error as _error


def _raw(body: str) -> dict:
    """Send JSON text as is (NaN / Infinity literals that json.dumps would also write)."""
    return {"content": body.encode(), "headers": {"content-type": "application/json"}}


def test_non_finite_numbers_are_refused(serve_fake, gw):
    # Infinity passed `repetition_penalty > 0` and reached the sampler; NaN / Infinity are
    # never valid sampling values (nor a prefix TTL).
    srv, engine = serve_fake()
    base = '{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
    with gw.client(srv) as http:
        for field in (
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
        ):
            for literal in ("Infinity", "-Infinity", "NaN"):
                r = http.post("/v1/chat/completions", **_raw(f'{base}, "{field}": {literal}}}'))
                _error(r, 400, param=field)
        r = http.post(
            "/v1/prefixes",
            **_raw(
                '{"model": "fake", "messages": [{"role": "system", "content": "x"}], '
                '"ttl_seconds": Infinity}'
            ),
        )
        _error(r, 400, param="ttl_seconds")
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
    assert engine.requests_seen and len(engine.requests_seen) == 1
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_seed_out_of_range_names_the_field(serve_fake, gw):
    # 2**64 reached torch's Generator.manual_seed: "Overflow when unpacking long long", param null.
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        for seed in (2**64, 10**30, -(2**63) - 1):
            err = _error(
                http.post("/v1/chat/completions", json=gw.chat_body(seed=seed)), 400, param="seed"
            )
            assert "long long" not in err["message"]
            _error(
                http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "seed": seed}),
                400,
                param="seed",
            )
        # the int64 edges are served, also with n > 1 (seed + i must stay a valid seed)
        for seed in (2**63 - 1, -(2**63)):
            r = http.post("/v1/chat/completions", json=gw.chat_body(seed=seed, n=3, max_tokens=2))
            assert r.status_code == 200, r.text
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_choice_seeds_stay_int64():
    lo, hi = -(2**63), 2**63 - 1
    for seed in (hi, hi - 1, lo, 0, 7):
        seeds = choice_seeds(seed, 16)
        assert all(lo <= s <= hi for s in seeds), seeds
        assert len(set(seeds)) == 16 and seeds[0] == seed
    assert choice_seeds(5, 3) == [5, 6, 7]  # ordinary seeds unchanged


def test_union_errors_name_the_real_fault(serve_fake, gw):
    # `stop` with 100 strings said "Input should be a valid string"; an image part said the
    # content "should be a valid string": the message must describe the branch that was sent.
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        err = _error(
            http.post(
                "/v1/chat/completions", json=gw.chat_body(stop=[f"s{i}" for i in range(100)])
            ),
            400,
            param="stop",
        )
        assert "at most 4" in err["message"], err
        body = {
            "model": "fake",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        }
        err = _error(http.post("/v1/chat/completions", json=body), 400)
        assert err["param"] == "messages.0.content.0.type", err
        assert "valid string" not in err["message"], err
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_undecodable_body_is_400_not_500(serve_fake, gw, caplog):
    # `Content-Encoding: gzip` over bytes that are not gzip: aiohttp's RequestPayloadError
    # reached the catch-all and was answered 500 "internal server error" (traceback logged).
    # Then, answered 400, aiohttp still read the rest of the body, met the same error and
    # logged an ERROR "Unhandled exception" traceback per such request (log spam at will).
    srv, engine = serve_fake()
    with caplog.at_level(logging.DEBUG), gw.client(srv) as http:
        for encoding in ("gzip", "deflate"):
            r = http.post(
                "/v1/chat/completions",
                content=b"0123456789",
                headers={"content-type": "application/json", "content-encoding": encoding},
            )
            err = _error(r, 400, code="invalid_body")
            assert encoding in err["message"], err
        r = http.post(
            "/v1/prefixes", content=b"not gzip at all", headers={"content-encoding": "gzip"}
        )
        _error(r, 400, code="invalid_body")
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
    assert len(engine.requests_seen) == 1
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_options_without_their_switch_are_refused(serve_fake, gw):
    # top_logprobs without logprobs=true, and stream_options without stream=true, were
    # silently ignored (OpenAI and vLLM answer 400: the client expects logprobs / a usage chunk).
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        _error(
            http.post("/v1/chat/completions", json=gw.chat_body(top_logprobs=3)),
            400,
            param="top_logprobs",
        )
        _error(
            http.post("/v1/chat/completions", json=gw.chat_body(logprobs=False, top_logprobs=3)),
            400,
            param="top_logprobs",
        )
        _error(
            http.post(
                "/v1/chat/completions", json=gw.chat_body(stream_options={"include_usage": True})
            ),
            400,
            param="stream_options",
        )
        _error(
            http.post(
                "/v1/completions",
                json={"model": "fake", "prompt": "x", "stream_options": {"include_usage": True}},
            ),
            400,
            param="stream_options",
        )
        for body in (
            gw.chat_body(logprobs=True, top_logprobs=2, max_tokens=2),
            gw.chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=2),
            gw.chat_body(stream=False, stream_options=None, max_tokens=2),
        ):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert len(engine.requests_seen) == 3


def test_errors_do_not_echo_megabytes_of_input(serve_fake, gw):
    # A 1 MB model name came back whole inside the 404 message.
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        name = "m" * 1_000_000
        err = _error(
            http.post("/v1/chat/completions", json=gw.chat_body(model=name)),
            404,
            code="model_not_found",
        )
        assert len(err["message"]) < 400 and "fake" in err["message"], len(err["message"])
        err = _error(
            http.post("/v1/chat/completions", json=gw.chat_body(prefix_id="p" * 100_000)),
            404,
            code="prefix_not_found",
        )
        assert len(err["message"]) < 400
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200


def test_tokenizing_a_huge_prompt_does_not_stall_other_clients(serve_fake, gw):
    # Tokenization ran on the event loop: one 3.6 MB prompt (2.4 M tokens, refused anyway as
    # over the context) froze every client, /health included, for ~3 s.
    import threading
    import time

    srv, engine = serve_fake()
    tok = engine.tokenizer
    plain = tok.encode

    def slow_encode(text, add_special_tokens=True):
        if len(text) > 1000:
            time.sleep(1.5)  # a long encode (the real tokenizer releases the GIL)
        return plain(text, add_special_tokens)

    tok.encode = slow_encode
    results = {}

    def big(path, body):
        with gw.client(srv) as http:
            results[path] = http.post(path, json=body).status_code

    threads = [
        threading.Thread(target=big, args=("/v1/chat/completions", gw.chat_body("x" * 5000))),
        threading.Thread(
            target=big, args=("/v1/completions", {"model": "fake", "prompt": "x" * 5000})
        ),
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)
    with gw.client(srv) as http:
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        stalled = time.monotonic() - t0
        r = http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2))
        assert r.status_code == 200
    for t in threads:
        t.join()
    assert stalled < 0.5, f"/health waited {stalled:.2f} s behind a tokenization"
    assert results == {"/v1/chat/completions": 400, "/v1/completions": 400}
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_a_message_without_content_is_refused_naming_it(serve_fake, gw):
    """Was: a user (system, tool) message with no ``content``, or ``null``, was served as an
    empty turn; only an assistant turn (of tool calls) may go without content."""
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        for msg in ({"role": "user"}, {"role": "user", "content": None}, {"role": "system"}):
            body = {"model": "fake", "messages": [msg], "max_tokens": 2}
            err = _error(
                http.post("/v1/chat/completions", json=body), 400, param="messages.0.content"
            )
            assert f"a {msg['role']} message needs content" in err["message"]
            tok = {"model": "fake", "messages": [msg]}
            _error(http.post("/tokenize", json=tok), 400, param="messages.0.content")
        turn = {"role": "assistant", "content": None}
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}, turn]}
        assert http.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200
    assert len(engine.requests_seen) == 1


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ],
)
def test_null_on_a_nullable_field_is_its_default(serve_fake, gw, route, body):
    # OpenAI's spec makes n, stream, logprobs, echo and the penalties nullable: an explicit
    # null was a 400 "Input should be a valid integer" (a new user's probe)
    srv, engine = serve_fake()
    nulls = {"n": None, "stream": None, "frequency_penalty": None, "presence_penalty": None}
    nulls |= {"logprobs": None} if "messages" in body else {"echo": None}
    with gw.client(srv) as http:
        r = http.post(route, json={"model": "fake", "max_tokens": 2, **body, **nulls})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1
    assert len(engine.requests_seen) == 1


def test_a_tool_message_must_answer_an_earlier_call(serve_fake, gw):
    # a tool result of no call (or with no tool_call_id) was rendered and answered 200 (a new
    # user's probe); OpenAI refuses it, as our Messages route refuses a stray tool_use_id
    srv, engine = serve_fake()
    user = {"role": "user", "content": "I sense the nodes"}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    with gw.client(srv) as http:
        for messages, words in (
            ([user, {"role": "tool", "tool_call_id": "zzz", "content": "r"}], "'zzz'"),
            ([user, {"role": "tool", "content": "r"}], "needs the tool_call_id"),
            ([user, asked, {"role": "tool", "tool_call_id": "call_2", "content": "r"}], "call_2"),
        ):
            body = {"model": "fake", "messages": messages, "max_tokens": 2}
            err = _error(http.post("/v1/chat/completions", json=body), 400, param="messages")
            assert "messages.1" in err["message"] or "messages.2" in err["message"], err
            assert words in err["message"], err
        answered = [user, asked, {"role": "tool", "tool_call_id": "call_1", "content": "r"}]
        check_tool_turns(answered)  # passes (the fake's template has no tool role to render)
    assert engine.requests_seen == []


def test_refused_fields_say_unsupported_parameter_on_every_route(serve_fake, gw):
    # completions' echo / suffix and the Responses API's refusals had code null, where chat's
    # refused fields say unsupported_parameter (a new user's probe)
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        for route, body, param in (
            ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
            ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
            ("/v1/responses", {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
            ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ):
            r = http.post(route, json={"model": "fake", **body})
            _error(r, 400, code="unsupported_parameter", param=param)
    assert engine.requests_seen == []


@pytest.mark.parametrize(
    ("role", "content", "said"),
    [
        ("user", [], "must not be empty"),
        ("system", [], "must not be empty"),
        ("developer", [], "must not be empty"),
        ("assistant", [], "must not be empty"),
        ("tool", [], "must not be empty"),
        ("user", None, "a user message needs content"),
        ("system", None, "a system message needs content"),
    ],
)
def test_empty_or_null_content_is_refused_alike_in_both_modes(serve_fake, role, content, said):
    """Was: ``content: []`` on a chat message was served (an empty turn) while ``null`` was a
    400 in local mode, and proxy mode relayed both to its upstream. OpenAI's API schema gives
    every message's array of content parts ``minItems: 1`` (its answer: ``empty_array``), and
    only an assistant turn (of tool calls) may go without content: both modes answer 400
    naming ``messages.N.content``, in the same words, before anything is generated or sent."""
    import httpx
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings
    from support.chat_stub import ChatStub

    messages: list[dict] = [{"role": "user", "content": "hi"}]
    if role == "tool":  # a tool message answers a call of the turn before it
        call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    at = f"messages.{len(messages)}.content"
    msg: dict = {"role": role, "content": content}
    if role == "tool":
        msg["tool_call_id"] = "call_0"
    messages += [msg, {"role": "user", "content": "go on"}]
    stub = ChatStub(name="fake")
    srv, engine = serve_fake()
    with (
        BackgroundServer(stub.app) as up,
        BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as proxy,
    ):
        told = []
        for url in (srv.url, proxy.url):
            body = {"model": "fake", "messages": messages, "max_tokens": 2}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            err = _error(r, 400, param=at)
            assert err["message"].startswith(f"{at}: {said}"), err
            assert err["code"] == ("empty_array" if content == [] else None), err
            told.append(err)
        assert told[0] == told[1]
        assert stub.seen == []  # nothing reached the upstream
    assert engine.requests_seen == []  # nor generated from
