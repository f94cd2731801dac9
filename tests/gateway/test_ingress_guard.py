"""The ingress guard (``http/json_guard.py``): every route of every dialect, in local and proxy
mode, refuses a body past its bounds before any model parsing, in the dialect's error object.

- JSON nested 100,000 deep is a 400 ``invalid_json`` on every route (the Messages routes were a
  500: ``RecursionError``);
- ~4 MB bodies of 130k content blocks, 110k turns or 10k tools are 400s by count while a small
  request sent beside them is served (no timings asserted);
- a route added later (a Gemini-style ``/v1beta/`` route, no code of its own) is guarded and
  answered in Gemini's error shape;
- a hypothesis fuzz over every route's request shapes with hostile values (deep, long, wide,
  empty) at random places finds no 5xx in either mode (``GUARD_FUZZ_EXAMPLES`` per mode).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prefixgate.gateway import app as app_module
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.json_guard import (
    MAX_ARRAY_ITEMS,
    MAX_JSON_VALUES,
    MAX_MESSAGES,
    MAX_TOKEN_IDS,
    MAX_TOOLS,
    check_body,
    json_guard_middleware,
)
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import FakeEngine
from support.fuzz import live_server_settings

EXAMPLES = int(os.environ.get("GUARD_FUZZ_EXAMPLES", "120"))
ANTHROPIC_ROUTES = {"/v1/messages", "/v1/messages/count_tokens"}
LOCAL_ONLY: set[str] = set()  # every route is served in both modes now


class Upstream:
    """A well-behaved OpenAI-compatible upstream for proxy mode: chat and completions (whole
    or streamed), ``/tokenize``, ``/detokenize``, ``/v1/embeddings`` and ``/v1/models``,
    whatever the prompt's shape."""

    name = "fake"

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        completions = request.path == "/v1/completions"
        kind = "text_completion" if completions else "chat.completion"
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "stop"}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if not body.get("stream"):
            if completions:
                choice["text"] = "ok"
            else:
                choice["message"] = {"role": "assistant", "content": "ok"}
            return web.json_response(
                {"id": "x", "object": kind, "created": 0, "model": self.name,
                 "choices": [choice], "usage": usage}
            )  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = kind if completions else "chat.completion.chunk"
        part = {"text": "ok"} if completions else {"delta": {"role": "assistant", "content": "ok"}}
        chunk = {"id": "x", "object": obj, "created": 0, "model": self.name,
                 "choices": [{**choice, **part}]}  # fmt: skip
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            last = {"id": "x", "object": obj, "created": 0, "model": self.name, "choices": [],
                    "usage": usage}  # fmt: skip
            await resp.write(f"data: {json.dumps(last)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"count": 3, "max_model_len": 128, "tokens": [1, 2, 3]})

    async def detokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"prompt": "ok"})

    async def embeddings(self, request: web.Request) -> web.Response:
        vector = {"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}
        usage = {"prompt_tokens": 1, "total_tokens": 1}
        return web.json_response(
            {"object": "list", "data": [vector], "model": self.name, "usage": usage}
        )

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.name, "object": "model", "owned_by": "vllm", "max_model_len": 128}
        return web.json_response({"object": "list", "data": [card]})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", lambda r: web.json_response({"ok": True}))
        return app


@pytest.fixture(scope="module")
def modes() -> Iterator[dict[str, str]]:
    """``{"local": url, "proxy": url}``: a gateway on the fake engine, and a proxy in front of
    a stub upstream."""
    opened: list[BackgroundServer] = []

    def serve(make) -> BackgroundServer:
        srv = BackgroundServer(make).__enter__()
        opened.append(srv)
        return srv

    try:
        local = serve(
            lambda: create_app(FakeEngine(token_delay_s=0.0), GatewaySettings(model_name="fake"))
        )
        up = serve(Upstream().app)
        proxy = serve(lambda: create_proxy_app([up.url], GatewaySettings()))
        yield {"local": local.url, "proxy": proxy.url}
    finally:
        for srv in reversed(opened):
            srv.close()


def _dialect_error(path: str, r: httpx.Response) -> dict:
    """The error object of ``r`` in ``path``'s dialect (asserting the shape)."""
    body = r.json()
    if path in ANTHROPIC_ROUTES:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]
    if path.startswith("/v1beta/"):
        # Google's shape; ``details`` (a google.rpc.BadRequest naming the field) when known
        assert (
            {"code", "message", "status"}
            <= set(body["error"])
            <= {"code", "message", "status", "details"}
        ), body
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


SMALL = {
    "/v1/chat/completions": {"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": "fake", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {
        "model": "fake",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/messages/count_tokens": {"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/prefixes": {"model": "fake", "messages": [{"role": "system", "content": "be brief"}]},
    "/v1/embeddings": {"model": "fake", "input": "hi"},
    "/tokenize": {"model": "fake", "prompt": "hi"},
    "/detokenize": {"model": "fake", "tokens": [1, 2]},
}


def _refused_on_every_route(
    http: httpx.Client, mode: str, body_of: Callable[[str], bytes]
) -> Iterator[tuple[str, dict]]:
    """POST ``body_of(path)`` to every route of ``SMALL``; each must be a 400 in its dialect's
    shape (a proxy's 501 for a local-only route); yield ``(path, error object)``."""
    for path in SMALL:
        r = http.post(path, content=body_of(path))
        if mode == "proxy" and path in LOCAL_ONLY:
            assert r.status_code == 501, (path, r.text)
            continue
        assert r.status_code == 400, (mode, path, r.text[:300])
        yield path, _dialect_error(path, r)


def test_deep_json_is_a_400_in_the_dialects_shape_on_every_route(modes):
    deep = "[" * 100_000 + "]" * 100_000
    body = '{"model": "fake", "messages": DEEP, "x": 1}'.replace("DEEP", deep).encode()
    for mode, url in modes.items():
        with httpx.Client(base_url=url, timeout=30) as http:
            for path, err in _refused_on_every_route(http, mode, lambda path: body):
                assert "nested deeper than 200" in err["message"], (mode, path, err)
            assert http.get("/health").status_code == 200


def test_a_lone_surrogate_is_told_as_one_on_every_route(modes):
    """Was: a JSON string holding a lone UTF-16 surrogate (``"\\ud800"``: JSON's escapes may
    spell one, Unicode has no such character) was told in the JSON parser's words,
    "malformed JSON body: unexpected end of hex escape at line 1 column 47". It is a 400
    saying what it is and where: the escape, the field's path, not valid Unicode."""

    def where(path: str) -> str:
        return "messages.0.content" if "messages" in SMALL[path] else "model"

    def body_of(path: str) -> bytes:
        body = json.dumps(SMALL[path])
        if where(path) == "model":
            return body.replace('"fake"', '"fa\\ud800ke"', 1).encode()
        return body.replace('"hi"', '"h\\ud800i"').replace('"be brief"', '"h\\ud800i"').encode()

    for mode, url in modes.items():
        with httpx.Client(base_url=url, timeout=30) as http:
            for path, err in _refused_on_every_route(http, mode, body_of):
                message = err["message"]
                at = where(path)
                assert message.startswith(f"{at}: lone surrogate \\ud800"), (mode, path, err)
                assert "not valid Unicode" in message and "hex escape" not in message, message
                if path not in ANTHROPIC_ROUTES:
                    assert err["param"] == at and err["code"] == "invalid_json", err
            r = http.post(
                "/v1beta/models/fake:generateContent",
                content=b'{"contents": [{"parts": [{"text": "a"}, {"text": "\\udc00"}]}]}',
            )
            assert r.status_code == 400, (mode, r.text)
            err = _dialect_error("/v1beta/", r)
            assert err["status"] == "INVALID_ARGUMENT", err
            assert err["message"].startswith("contents.0.parts.1.text: lone surrogate \\udc00")


def test_check_body_tells_each_lone_surrogate() -> None:
    def told(body: bytes) -> APIError:
        with pytest.raises(APIError) as refused:
            check_body(body)
        return refused.value

    for body, where, escape in [
        (b'{"a": "x\\ud800"}', "a", "\\ud800"),  # a high one at the string's end
        (b'{"a": "\\ud800x"}', "a", "\\ud800"),  # followed by a character
        (b'{"a": "\\ud800\\u0041"}', "a", "\\ud800"),  # followed by another escape
        (b'{"a": "\\udc00"}', "a", "\\udc00"),  # a low one first
        (b'{"a": "\\udc00\\ud800"}', "a", "\\udc00"),  # low then high: the low one is told
        (b'{"a": ["ok", {"\\uDBFFk": 1}]}', "a.1", "\\udbff"),  # in a key
        (b'{"a": "\\ud83d\\ude00", "b": "\\ud800"}', "b", "\\ud800"),  # the first lone one
    ]:
        err = told(body)
        assert err.status == 400 and err.code == "invalid_json"
        assert err.param == where, (body, err.message)
        assert err.message.startswith(f"{where}: lone surrogate {escape} "), err.message
        assert "not valid Unicode" in err.message
        assert "leading" not in err.message  # the parser's "lone leading surrogate", not ours
    ok = check_body(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}')  # a pair; an escaped backslash
    assert ok == {"a": "\U0001f600", "b": "\\ud800"}
    err = told(b'{"a": "\xff"}')
    assert "not valid UTF-8" in err.message and err.code == "invalid_json"


def _big_bodies() -> list[tuple[str, dict, str]]:
    """(path, body, the expected code): the issue's ~4 MB bodies per dialect, and bodies
    just past each count."""
    block = {"type": "text", "text": "a"}
    blocks = [{"role": "user", "content": [block] * 130_000}]
    turns = [{"role": "user", "content": "a"}] * 110_000
    tools = [
        {
            "name": f"t{i}",
            "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}},
        }
        for i in range(10_000)
    ]
    chat_tools = [{"type": "function", "function": {"name": t["name"]}} for t in tools]
    spread = [{"role": "user", "content": [block] * 30}] * 4000  # each array within bounds
    one = [{"role": "user", "content": "hi"}]
    few_blocks = [{"role": "user", "content": [block] * (MAX_ARRAY_ITEMS + 1)}]
    few_turns = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    numbers = [1] * 1_000_000
    msg = {"model": "fake", "max_tokens": 2}
    count = {"model": "fake"}
    chat = {"model": "fake"}
    return [
        # refused by the quote count, before parsing
        ("/v1/messages", {**msg, "messages": blocks}, "too_many_values"),
        ("/v1/messages", {**msg, "messages": turns}, "too_many_values"),
        ("/v1/messages/count_tokens", {**count, "messages": blocks}, "too_many_values"),
        ("/v1/messages/count_tokens", {**count, "messages": turns}, "too_many_values"),
        ("/v1/chat/completions", {**chat, "messages": blocks}, "too_many_values"),
        ("/v1/chat/completions", {**chat, "messages": turns}, "too_many_values"),
        # counted on the parsed body
        ("/v1/messages", {**msg, "messages": spread}, "too_many_values"),
        ("/v1/messages", {**msg, "messages": one, "tools": tools}, "too_many_tools"),
        ("/v1/messages", {**msg, "messages": few_blocks}, "too_many_items"),
        ("/v1/messages", {**msg, "messages": few_turns}, "too_many_messages"),
        ("/v1/messages/count_tokens", {**count, "messages": one, "tools": tools}, "too_many_tools"),
        ("/v1/messages/count_tokens", {**count, "messages": few_turns}, "too_many_messages"),
        ("/v1/chat/completions", {**chat, "messages": one, "tools": chat_tools}, "too_many_tools"),
        ("/v1/chat/completions", {**chat, "messages": few_blocks}, "too_many_items"),
        # numbers where objects belong: a million of them were one validation error apiece
        # (~10 s of the event loop per request on a 2-vCPU Xeon), let through as token ids
        ("/v1/messages", {**msg, "messages": numbers}, "too_many_messages"),
        ("/v1/messages", {**msg, "messages": [{"role": "user", "content": numbers}]}, "too_many_items"),
        ("/v1/messages", {**msg, "messages": one, "system": numbers}, "too_many_items"),
        ("/v1/chat/completions", {**chat, "messages": numbers}, "too_many_messages"),
        ("/v1/chat/completions", {**chat, "messages": one, "stop": numbers}, "too_many_items"),
        (f"/v1beta/models/{chat['model']}:generateContent", {"contents": numbers}, "too_many_messages"),
        (f"/v1beta/models/{chat['model']}:generateContent", {"contents": [{"parts": numbers}]}, "too_many_items"),
    ]  # fmt: skip


def test_big_bodies_are_refused_by_count_while_a_small_request_is_served(modes):
    """The issue's ~4 MB bodies, sent at once in each mode beside a small Messages request:
    every big one a 400 naming its bound (in its dialect's shape), the small one a 200."""
    bodies = [(path, json.dumps(body).encode(), code) for path, body, code in _big_bodies()]
    for mode, url in modes.items():
        results: dict[int, httpx.Response] = {}

        def send(results: dict, i: int, url: str, path: str, body: bytes) -> None:
            results[i] = httpx.post(url + path, content=body, timeout=120)

        threads = [
            threading.Thread(target=send, args=(results, i, url, path, body))
            for i, (path, body, _) in enumerate(bodies)
        ]
        for t in threads:
            t.start()
        small = httpx.post(url + "/v1/messages", json=SMALL["/v1/messages"], timeout=120)
        for t in threads:
            t.join()
        assert small.status_code == 200, (mode, small.text)
        assert small.json()["type"] == "message"
        for i, (path, _, code) in enumerate(bodies):
            r = results[i]
            assert r.status_code == 400, (mode, path, r.text[:300])
            err = _dialect_error(path, r)
            if path.startswith("/v1beta/"):  # Google's shape: a status, its words "items"
                assert err["status"] == "INVALID_ARGUMENT", (mode, path, err)
                assert "at most" in err["message"], (path, err)
                continue
            if path not in ANTHROPIC_ROUTES:
                assert err["code"] == code, (mode, path, err)
            else:
                assert err["type"] == "invalid_request_error"
            assert code.removeprefix("too_many_").rstrip("s") in err["message"], (path, err)


def test_check_body_bounds() -> None:
    def refused(value: object) -> APIError:
        with pytest.raises(APIError) as info:
            check_body(json.dumps(value).encode())
        assert info.value.status == 400
        return info.value

    check_body(json.dumps({"prompt": [1] * (MAX_ARRAY_ITEMS * 4)}).encode())  # token ids
    check_body(json.dumps({"a": [{"b": ["x"] * MAX_ARRAY_ITEMS}]}).encode())
    check_body(json.dumps({"messages": [{}] * MAX_MESSAGES, "tools": [{}] * MAX_TOOLS}).encode())
    err = refused({"a": [{"b": ["x"] * (MAX_ARRAY_ITEMS + 1)}]})
    assert (err.code, err.param) == ("too_many_items", "a.0.b")
    err = refused({"messages": [{}] * (MAX_MESSAGES + 1)})
    assert (err.code, err.param) == ("too_many_messages", "messages")
    err = refused({"tools": [{"function_declarations": [{}] * (MAX_TOOLS + 1)}]})
    assert (err.code, err.param) == ("too_many_tools", "tools.0.function_declarations")
    err = refused({"logit_bias": {str(i): 1 for i in range(MAX_ARRAY_ITEMS + 1)}})
    assert (err.code, err.param) == ("too_many_items", "logit_bias")
    err = refused({"a": [["s"] * 3000] * 50})  # each array within its bound
    assert err.code == "too_many_values"
    assert MAX_JSON_VALUES < 3000 * 50
    err = refused({"prompt": [1] * (MAX_TOKEN_IDS + 1)})
    assert (err.code, err.param) == ("too_many_items", "prompt")
    # token ids only where a field takes them (a batch's inner lists too); numbers elsewhere
    # are items like any other
    many = [1] * (MAX_ARRAY_ITEMS + 1)
    for ok in ({"prompt": [many, many]}, {"input": many}, {"tokens": many}):
        check_body(json.dumps(ok).encode())
    err = refused({"messages": many})
    assert (err.code, err.param) == ("too_many_messages", "messages")
    err = refused({"messages": [{"role": "user", "content": many}]})
    assert (err.code, err.param) == ("too_many_items", "messages.0.content")
    err = refused({"contents": [{"parts": many}]})
    assert (err.code, err.param) == ("too_many_items", "contents.0.parts")
    with pytest.raises(APIError) as info:
        check_body(b'{"a": ' + b"[" * 201 + b"]" * 201 + b"}")
    assert info.value.code == "invalid_json" and "200" in info.value.message


def test_a_route_added_later_is_guarded_without_a_line_of_its_own(monkeypatch):
    """A new dialect's route (Gemini-style, under ``/v1beta/``) registered with no guard code:
    deep JSON and too many ``contents`` are 400s in Gemini's error object before it runs."""
    seen: list[bytes] = []

    async def generate(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"candidates": []})

    fallback = app_module._add_fallback_route

    def with_new_route(app: web.Application) -> None:
        app.router.add_post("/v1beta/files/{name}", generate)  # a Gemini route not served yet
        fallback(app)

    monkeypatch.setattr(app_module, "_add_fallback_route", with_new_route)
    made: dict[str, web.Application] = {}

    def make() -> web.Application:
        made["app"] = create_app(FakeEngine(), GatewaySettings(model_name="fake"))
        return made["app"]

    with BackgroundServer(make) as srv:
        assert json_guard_middleware in made["app"].middlewares
        path = "/v1beta/files/upload"
        ok = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        assert httpx.post(srv.url + path, json=ok).status_code == 200
        r = httpx.post(srv.url + path, content=b'{"contents": ' + b"[" * 5000 + b"]" * 5000 + b"}")
        assert r.status_code == 400
        assert _dialect_error(path, r)["status"] == "INVALID_ARGUMENT"
        many = {"contents": [{"role": "user", "parts": [{"text": "a"}]}] * (MAX_MESSAGES + 1)}
        r = httpx.post(srv.url + path, json=many)
        err = _dialect_error(path, r)
        assert r.status_code == 400 and err["code"] == 400 and "contents" in err["message"]
        tools = {"contents": ok["contents"], "tools": [{"functionDeclarations": [{}] * 200}]}
        r = httpx.post(srv.url + path, json=tools)
        assert r.status_code == 400 and "functionDeclarations" in r.json()["error"]["message"]
        assert len(seen) == 1  # only the first reached the handler


# --- the fuzz -----------------------------------------------------------------------------

MESSAGE_SHAPES = {
    "/v1/chat/completions": {
        "model": "fake",
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_tokens": 2,
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "stop": ["x"],
        "logit_bias": {"1": 1.0},
        "metadata": {"k": "v"},
    },
    "/v1/completions": {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 2, "stop": ["x"]},
    "/v1/responses": {
        "model": "fake",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "instructions": "be brief",
        "max_output_tokens": 2,
        "tools": [],
        "include": [],
    },
    "/v1/messages": {
        "model": "fake",
        "max_tokens": 2,
        "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": [1]}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "stop_sequences": ["x"],
    },  # fmt: skip
    "/v1/messages/count_tokens": {
        "model": "fake",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    },
    "/v1/prefixes": {"model": "fake", "messages": [{"role": "system", "content": "s"}]},
    "/v1/embeddings": {"model": "fake", "input": ["hi", "there"]},
    "/tokenize": {"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
    "/detokenize": {"model": "fake", "tokens": [1, 2]},
}

leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.just(""), st.just([]), st.just({}),
    st.text(max_size=5),
)  # fmt: skip
hostile = st.one_of(
    leaf,
    st.integers(150, 400).map(lambda d: {"deep": d}),  # placeholder: nesting depth d
    st.tuples(
        leaf | st.just({"type": "text", "text": "a"}),
        st.sampled_from([0, 1, MAX_TOOLS, MAX_TOOLS + 1, MAX_ARRAY_ITEMS, MAX_ARRAY_ITEMS + 1]),
    ).map(lambda t: [t[0]] * t[1]),
    st.integers(MAX_ARRAY_ITEMS - 1, MAX_ARRAY_ITEMS + 1).map(
        lambda n: {str(i): i for i in range(n)}
    ),
    st.sampled_from([MAX_ARRAY_ITEMS * 2, 200_000]).map(lambda n: list(range(n))),
)


def _paths(value: Any, here: tuple = ()) -> list[tuple]:
    out = [here]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*here, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*here, i))
    return out


def _put(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _put(copy[path[0]], path[1:], new)
    return copy


def _encode(value: Any) -> bytes:
    """JSON with ``{"deep": d}`` written as ``d`` nested arrays."""
    text = json.dumps(value)
    return re.sub(r'\{"deep": (\d+)\}', lambda m: "[" * int(m[1]) + "]" * int(m[1]), text).encode()


@st.composite
def guarded_requests(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(MESSAGE_SHAPES)))
    body: Any = MESSAGE_SHAPES[path]
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(_paths(body)))
        body = _put(body, where, draw(hostile))
    if draw(st.booleans()) and isinstance(body, dict):
        body = {**body, "stream": True}
    return path, _encode(body)


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_fuzz_of_every_routes_shapes_finds_no_5xx(modes, mode):
    url = modes[mode]
    statuses: dict[int, int] = {}
    faults: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as http:

        @live_server_settings(EXAMPLES)
        @given(guarded_requests())
        def one(req: tuple[str, bytes]) -> None:
            path, body = req
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500 and not (mode == "proxy" and path in LOCAL_ONLY):
                faults.append(f"{r.status_code} {path} {r.text[:200]} <- {body[:300]!r}")
            elif r.status_code >= 400:
                _dialect_error(path, r)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                assert "Traceback" not in r.text

        one()
        assert http.get("/health").status_code == 200
    assert not faults, faults[:5]
    assert statuses.get(400, 0) > 0, statuses


def test_the_settable_bounds_are_the_servers(serve_fake):
    """``max_request_tools`` / ``max_request_values`` (``--max-request-tools``,
    ``--max-request-values``) move the guard's bounds."""
    srv, _ = serve_fake(
        GatewaySettings(model_name="fake", max_request_tools=300, max_request_values=2048),
        token_delay_s=0.0,
    )
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(200)]
    body = {**SMALL["/v1/messages/count_tokens"], "tools": tools}
    r = httpx.post(srv.url + "/v1/messages/count_tokens", json=body, timeout=30)
    # 200 tools: past the default, within 300: counted (a count needs no tool-call parser)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    many = {
        **SMALL["/v1/chat/completions"],
        "stop": None,
        "metadata": {str(i): "v" for i in range(1100)},
    }
    r = httpx.post(srv.url + "/v1/chat/completions", json=many, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_values", r.text
