"""The Responses API in upstream mode (``proxy.responses_relay``): relayed as a chat completion
and answered as local mode answers — the same ``response`` object and the same stream events
in the same order, through the real ``openai`` client too; the same 400 for a refused field
in both modes; what a proxy cannot relay refused by name; the request translated field by
field; an upstream's error reworded in OpenAI's shape; a stream cut short ended with
``error`` then ``response.failed``; a client that leaves aborts the upstream's request; the
upstream engine idle with its pool whole and the proxy's admission counts 0 after each."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.state import STATE
from support.chat_stub import SECRET, ChatStub
from support.fake_engine import assert_idle_and_whole

openai = pytest.importorskip("openai")

BODY = {
    "model": "fake",
    "instructions": "Answer briefly.",
    "input": [
        {"role": "user", "content": "High tide?"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "At six."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And low tide?"}]},
    ],
    "max_output_tokens": 6,
    "temperature": 0.0,
}
VOLATILE = ("id", "created_at", "item_id")


def _quiet(proxy: BackgroundServer) -> None:
    """The proxy's admission and its keys' in-flight counts back at 0."""
    state = proxy.app[STATE]
    deadline = time.monotonic() + 5
    while True:
        adm = state.admission
        busy = [p for p in [*state.keys._by_digest.values(), state.keys._anonymous] if p.concurrent]
        quiet = adm.in_flight == 0 and adm.queued_requests == 0 and adm.queued_tokens == 0
        if (quiet and not busy) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert quiet and not busy, vars(adm)


@pytest.fixture
def pair(serve_fake, servers: Callable[..., BackgroundServer]):
    """A local-mode gateway on the fake engine, and a proxy in front of it; after the test
    the engine is idle with its pool whole and the proxy's counts are 0."""
    local, engine = serve_fake()
    proxy = servers(lambda: create_proxy_app([local.url], GatewaySettings()))
    yield local, proxy
    assert_idle_and_whole(local, engine)
    _quiet(proxy)


@pytest.fixture
def stubbed(servers: Callable[..., BackgroundServer]):
    """A proxy in front of a scripted OpenAI-compatible upstream (``ChatStub``, model
    ``llama``)."""

    def start(
        settings: GatewaySettings | None = None, **stub_kw: Any
    ) -> tuple[ChatStub, BackgroundServer]:
        stub = ChatStub(**stub_kw)
        up = servers(stub.app)
        return stub, servers(lambda: create_proxy_app([up.url], settings or GatewaySettings()))

    return start


def _shape(obj: Any) -> Any:
    """``obj`` with what differs between two answers blanked: ids, times, token counts."""
    if isinstance(obj, dict):
        return {
            k: "*" if k in VOLATILE or k.endswith("_tokens") else _shape(v) for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_shape(v) for v in obj]
    return obj


def _events(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream(
        "POST", url + "/v1/responses", json={**body, "stream": True}, timeout=30
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        out, name = [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert line[6:] != "[DONE]"
                out.append((name, json.loads(line[6:])))
    return out


def test_a_response_through_the_proxy_is_local_mode_s(pair):
    local, proxy = pair
    answers = [
        httpx.post(u + "/v1/responses", json=BODY, timeout=30) for u in (local.url, proxy.url)
    ]
    for r in answers:
        assert r.status_code == 200, r.text
    a, b = (r.json() for r in answers)
    assert _shape(a) == _shape(b)
    assert a["output"][0]["content"][0]["text"] == b["output"][0]["content"][0]["text"] != ""
    assert b["status"] == "incomplete" and b["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert b["model"] == "fake" and b["id"].startswith("resp_")
    usage = b["usage"]
    assert usage["input_tokens"] == a["usage"]["input_tokens"] and usage["output_tokens"] == 6
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 0  # a prefixgate upstream reports it
    assert usage["input_tokens_details"]["cache_write_tokens"] == 0  # nothing marked


def test_a_streamed_response_through_the_proxy_is_local_mode_s(pair):
    local, proxy = pair
    a, b = _events(local.url, BODY), _events(proxy.url, BODY)
    assert [n for n, _ in a] == [n for n, _ in b]
    assert [n for n, _ in b][:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [n for n, _ in b][-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    for events in (a, b):
        assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
        assert all(n == e["type"] for n, e in events)
    assert [_shape(e) for _, e in a] == [_shape(e) for _, e in b]
    text = "".join(e["delta"] for n, e in b if n == "response.output_text.delta")
    assert text == b[-1][1]["response"]["output"][0]["content"][0]["text"] != ""
    assert b[-1][1]["response"]["usage"]["output_tokens"] == 6


def test_the_openai_client_s_responses_through_the_proxy(pair):
    local, proxy = pair
    texts = []
    for url in (local.url, proxy.url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = client.responses.create(model="fake", input="hi", max_output_tokens=4)
        assert resp.status == "incomplete" and resp.usage.output_tokens == 4
        events = list(
            client.responses.create(model="fake", input="hi", max_output_tokens=4, stream=True)
        )
        assert events[-1].type == "response.incomplete"
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed == resp.output_text
        texts.append((resp.output_text, streamed))
    assert texts[0] == texts[1] and texts[0][0] != ""


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
        {"store": True},
        {"reasoning": {"effort": "low"}},
        {"previous_response_id": "resp_1"},
        {"include": ["reasoning.encrypted_content"]},
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
        {"frobnicate": 1},
        {"temperature": 3},
        {"max_output_tokens": 0},
        {"service_tier": "flex"},
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
        {
            "input": [
                {"role": "user", "content": "x", "prompt_cache_breakpoint": {"mode": "explicit"}}
            ]
        },
        {"input": []},
        # judged by the upstream through the proxy: its chat's refusal in the Responses words
        {"max_output_tokens": 10**6},
        {"input": "x" * 300},
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
    ],
)
def test_a_refused_field_is_the_same_400_in_both_modes(pair, extra):
    local, proxy = pair
    body = {**BODY, "stream": False, **extra}
    answers = [
        httpx.post(u + "/v1/responses", json=body, timeout=30) for u in (local.url, proxy.url)
    ]
    (a, b) = answers
    assert a.status_code == b.status_code == 400, (a.text, b.text)
    assert a.json() == b.json()
    assert b.json()["error"]["param"], b.text


def test_what_a_proxy_cannot_relay_is_a_400_naming_it(stubbed):
    _, gw = stubbed()
    for options, param in (
        ({"comparison_response_id": "resp_1"}, "prompt_cache_options.comparison_response_id"),
        ({"ttl": "12h"}, "prompt_cache_options.ttl"),
    ):
        r = httpx.post(
            gw.url + "/v1/responses",
            json={"model": "llama", "input": "hi", "prompt_cache_options": options},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_the_request_is_sent_as_the_chat_local_mode_renders(stubbed):
    stub, gw = stubbed()
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = {
        "model": "llama",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metres."},
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_text",
                        "text": "Tide ",
                        "prompt_cache_breakpoint": {"mode": "explicit"},
                    },
                    {"type": "input_text", "text": "now?"},
                ],
            },
        ],
        "max_output_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "user": "u-1",
        "prompt_cache_key": "harbour",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "explicit", "ttl": "12h"},
        "text": {
            "format": {"type": "json_schema", "name": "tide", "schema": schema, "strict": True}
        },
        "metadata": {"k": "v"},
        "store": False,
    }
    r = httpx.post(gw.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    sent = stub.seen[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use metres."},
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Tide ",
                    "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
                },
                {"type": "text", "text": "now?"},
            ],
        },
    ]
    assert sent["max_tokens"] == 9 and sent["temperature"] == 0.5 and sent["top_p"] == 0.9
    assert sent["user"] == "u-1" and sent["prompt_cache_key"] == "harbour"
    assert sent["prompt_cache_retention"] == "24h"
    assert sent["prompt_cache_options"] == {"mode": "explicit"}
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "tide", "schema": schema, "strict": True},
    }
    assert sent["model"] == "llama" and "stream" not in sent
    assert not {"metadata", "store", "text", "input", "instructions"} & set(sent)
    answer = r.json()
    assert answer["output"][0]["content"][0]["text"] == "hello there"
    assert answer["status"] == "completed" and answer["model"] == "llama"
    assert answer["text"]["format"]["type"] == "json_schema" and answer["metadata"] == {"k": "v"}
    # a breakpoint was sent and the upstream reports no writes: not known, never 0
    assert answer["usage"]["input_tokens_details"] == {
        "cached_tokens": 8,
        "cache_write_tokens": None,
    }
    r = httpx.post(gw.url + "/v1/responses", json={**body, "stream": True}, timeout=30)
    assert stub.seen[-1]["stream"] is True
    assert stub.seen[-1]["stream_options"] == {"include_usage": True}


def test_cached_tokens_an_upstream_does_not_report_are_null(stubbed):
    _, gw = stubbed(cached=None)
    r = httpx.post(gw.url + "/v1/responses", json={"model": "llama", "input": "hi"})
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["input_tokens_details"]
    assert details == {"cached_tokens": None, "cache_write_tokens": 0}
    events = _events(gw.url, {"model": "llama", "input": "hi"})
    assert events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] is None


def test_an_upstream_error_is_openai_s_error_object_naming_the_responses_field(stubbed):
    stub, gw = stubbed(status=400)
    r = httpx.post(gw.url + "/v1/responses", json={"model": "llama", "input": "hi"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err  # OpenAI's error object
    stub, gw = stubbed(status=500)
    r = httpx.post(gw.url + "/v1/responses", json={"model": "llama", "input": "hi"})
    assert r.status_code >= 500 and SECRET not in r.text, r.text
    assert "error" in r.json()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError):
        client.responses.create(model="llama", input="hi")


def test_an_upstream_refusal_of_max_tokens_names_max_output_tokens(servers):
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        err = {"message": "max_tokens is too large", "type": "invalid_request_error",
               "param": "max_tokens", "code": None}  # fmt: skip
        return web.json_response({"error": err}, status=400)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def make() -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        return app

    up = servers(make)
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings()))
    r = httpx.post(
        gw.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 5}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_output_tokens", r.text


@pytest.mark.parametrize(
    "stub_kw",
    [{"cut": True}, {"cut": True, "after_first": b"data: {not json\n\n"}],
)
def test_an_upstream_that_dies_mid_stream_ends_with_an_error_event(stubbed, stub_kw):
    _, gw = stubbed(**stub_kw)
    events = _events(gw.url, {"model": "llama", "input": "hi"})
    names = [n for n, _ in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-2:] == ["error", "response.failed"], names
    assert not {"response.completed", "response.incomplete"} & set(names)
    error, failed = events[-2][1], events[-1][1]
    assert error["code"] == "upstream_error" and error["message"]
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "upstream_error"
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    last = list(client.responses.create(model="llama", input="hi", stream=True))[-1]
    assert last.type == "response.failed" and last.response.status == "failed"


def test_a_client_that_leaves_aborts_the_upstream_request(serve_fake, servers):
    local, engine = serve_fake(token_delay_s=0.05)
    proxy = servers(lambda: create_proxy_app([local.url], GatewaySettings()))
    body = {"model": "fake", "input": "long", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/responses", json=body, timeout=30) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
    assert_idle_and_whole(local, engine)  # aborted long before its 400 tokens
    _quiet(proxy)


def test_a_breakpoint_through_the_proxy_is_pinned_by_a_prefixgate_upstream(pair):
    """The cache controls go on as chat's: a prefixgate upstream pins the input for a day
    (``prompt_cache_retention: "24h"``), reports the tokens written and says so in its
    ``x-prefixgate-cache`` header, passed on."""
    _, proxy = pair
    body = {"model": "fake", "input": "tide " * 20, "max_output_tokens": 2}
    r = httpx.post(
        proxy.url + "/v1/responses", json={**body, "prompt_cache_retention": "24h"}, timeout=30
    )
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["input_tokens_details"]
    assert isinstance(details["cache_write_tokens"], int) and details["cache_write_tokens"] > 0
    assert "prompt_cache_retention" in r.headers["x-prefixgate-cache"], r.headers
    again = httpx.post(proxy.url + "/v1/responses", json=body, timeout=30).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] >= details["cache_write_tokens"]


def _lines(url: str, body: dict) -> list[str]:
    with httpx.stream(
        "POST", url + "/v1/responses", json={**body, "stream": True}, timeout=30
    ) as r:
        assert r.status_code == 200, r.read()
        return list(r.iter_lines())


def test_a_silent_upstream_gets_keepalive_comments_then_the_rest(stubbed):
    """An upstream silent mid-stream for longer than ``--keepalive-s``: the client gets
    ``: keep-alive`` comment lines (local mode's Responses stream sends the same) between the
    first delta and the rest; the openai client reads the stream whole."""
    _, gw = stubbed(GatewaySettings(keepalive_s=0.2), pause_s=0.7)
    lines = _lines(gw.url, {"model": "llama", "input": "hi"})
    first = lines.index("event: response.output_text.delta")
    kept = [i for i, ln in enumerate(lines) if ln == ": keep-alive"]
    assert kept and first < kept[0], lines
    after = lines[kept[-1] :]
    assert "event: response.output_text.delta" in after and "event: response.completed" in after
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    events = list(client.responses.create(model="llama", input="hi", stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "hello there"


def test_a_stream_whose_upstream_goes_silent_ends_with_a_timeout(servers):
    """An upstream silent mid-stream past ``--upstream-timeout-s``: the stream ends with an
    ``error`` event ``upstream_timeout`` saying how long it waited, then ``response.failed``,
    as the chat relay's; the keep-alives sent meanwhile do not push the limit back."""
    import asyncio

    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "he"}, "finish_reason": None}]}  # fmt: skip
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(30)
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def make() -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        return app

    up = servers(make)
    settings = GatewaySettings(upstream_timeout_s=0.5, keepalive_s=0.1)
    gw = servers(lambda: create_proxy_app([up.url], settings))
    t0 = time.monotonic()
    lines = _lines(gw.url, {"model": "m", "input": "hi"})
    assert time.monotonic() - t0 < 3, "the silence limit holds with keep-alives going out"
    assert ": keep-alive" in lines, lines
    events = _events(gw.url, {"model": "m", "input": "hi"})
    assert [n for n, _ in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    error, failed = events[-2][1], events[-1][1]
    assert error["code"] == "upstream_timeout" and "0.5 s" in error["message"], error
    assert failed["response"]["output"][0]["content"][0]["text"] == "he"


def test_the_cache_header_names_the_marks_as_local_mode_does(pair):
    """The upstream's ``x-prefixgate-cache`` is about the chat it was sent (instructions its
    first message); the proxy's answer names each mark by its ``input`` item, as local mode's
    answer to the same request does."""
    local, proxy = pair
    mark = {"mode": "explicit"}
    part = {"type": "input_text", "text": "tide " * 8, "prompt_cache_breakpoint": mark}
    body = {**BODY, "input": [BODY["input"][0], {"role": "user", "content": [part]}]}

    def marks(url: str) -> list[str]:
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        parts = r.headers["x-prefixgate-cache"].split("; ")
        return [p.split(":")[0] for p in parts if not p.startswith("read=")]  # no states

    (said,) = marks(local.url)
    assert said.startswith("input.1.content.0.prompt_cache_breakpoint="), said
    assert marks(proxy.url) == [said]


def _vllm_takes_salt(salt: str) -> bool:
    """vLLM 0.32's check of a request's ``cache_salt`` (``validate_cache_salt``): at most 128
    characters, none of ``@``, ``/``, ``\\`` or NUL."""
    return 0 < len(salt) <= 128 and not set(salt) & set("@/\\\x00")


def test_the_cache_salt_sent_upstream_is_one_vllm_takes(servers, tmp_path):
    """A request's own ``cache_salt`` nested in its key's (``keys.effective_salt``) reaches the
    upstream as a salt vLLM accepts: it refuses the whole request otherwise (400 naming a
    ``cache_salt`` the client may never have sent)."""
    stub = ChatStub()
    up = servers(stub.app)
    keys = tmp_path / "keys.json"
    specs = [{"key": "k", "salt": "tenant-a"}, {"key": "k2", "salt": "acme/prod@eu"}]
    keys.write_text(json.dumps({"keys": specs}))
    settings = GatewaySettings(upstream_cache_salt="on", keys_file=str(keys))
    gw = servers(lambda: create_proxy_app([up.url], settings))
    for key in ("k", "k2"):
        for salt in (None, "run/1", "x" * 256):
            body = {"model": "llama", "input": "hi", **({"cache_salt": salt} if salt else {})}
            auth = {"Authorization": f"Bearer {key}"}
            r = httpx.post(gw.url + "/v1/responses", json=body, headers=auth, timeout=30)
            assert r.status_code == 200, r.text
            sent = stub.seen[-1]["cache_salt"]
            assert _vllm_takes_salt(sent), repr(sent)
    assert stub.seen[0]["cache_salt"] == "tenant-a"  # a key salt vLLM takes goes as it is
    assert len({s["cache_salt"] for s in stub.seen}) == 6  # six partitions


def test_vllm_s_context_refusal_names_input_as_local_mode_does(servers):
    """vLLM 0.32 names the prompt ``input_tokens`` when it is over the context (its own
    parameter, no chat field): the Responses answer names ``input``, as local mode's 400
    ``context_length_exceeded`` does."""
    from aiohttp import web

    words = ("This model's maximum context length is 2048 tokens. However, your prompt "
             "contains at least 2049 input tokens, which exceeds this limit even without any "
             "output tokens. Please reduce the length of the input prompt. "
             "(parameter=input_tokens, value=2049)")  # fmt: skip

    async def chat(request: web.Request) -> web.Response:
        err = {"message": words, "type": "BadRequestError", "param": "input_tokens",
               "code": "context_length_exceeded"}  # fmt: skip
        return web.json_response({"error": err}, status=400)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def make() -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        return app

    up = servers(make)
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings()))
    for body in (
        {"input": "hi"},
        {"instructions": "be", "input": [{"role": "user", "content": "x"}]},
    ):
        r = httpx.post(gw.url + "/v1/responses", json={"model": "m", **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "input" and err["code"] == "context_length_exceeded", err
        assert "input_tokens" not in err["message"], err


def test_an_upstream_abort_is_a_failed_response_never_a_completed_one(stubbed):
    """vLLM ends a request it aborted with ``finish_reason: "abort"``: whole, a 502
    ``request_aborted``; streamed, ``error`` then ``response.failed`` (the status the openai
    client reads as the end of a failed response), never ``completed``."""
    _, gw = stubbed(finish_reason="abort")
    r = httpx.post(gw.url + "/v1/responses", json={"model": "llama", "input": "hi"})
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "request_aborted"
    events = _events(gw.url, {"model": "llama", "input": "hi"})
    names = [n for n, _ in events]
    assert names[-2:] == ["error", "response.failed"], names
    assert not {"response.completed", "response.incomplete"} & set(names)
    assert events[-2][1]["code"] == "request_aborted"
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "request_aborted"
    assert failed["output"][0]["status"] == "incomplete"  # the text so far, cut
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    last = list(client.responses.create(model="llama", input="hi", stream=True))[-1]
    assert last.type == "response.failed" and last.response.status == "failed"


KEY = "sk-upstream-key-1234"


@pytest.mark.parametrize(
    "error, said",
    [  # a 4xx: its message, the key scrubbed; a 5xx: the gateway's words, never its message
        ({"message": f"bad logit_bias for {KEY}", "type": "BadRequestError", "code": 400},
         "bad logit_bias for [redacted]"),
        ({"message": SECRET, "type": "InternalServerError", "code": 500},
         "the upstream ended its stream with an error (InternalServerError)"),
    ],
)  # fmt: skip
def test_an_upstream_error_event_mid_stream_keeps_its_message_as_the_chat_relay(
    stubbed, error, said
):
    after = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    _, gw = stubbed(GatewaySettings(upstream_api_key=KEY), after_first=after)
    events = _events(gw.url, {"model": "llama", "input": "hi"})
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert events[-2][1]["message"] == said
    assert events[-1][1]["response"]["error"]["message"] == said
    text = json.dumps(events)
    assert KEY not in text and SECRET not in text
