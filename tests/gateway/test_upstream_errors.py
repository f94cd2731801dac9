"""Upstream mode: an upstream error without an OpenAI body (HTML, traceback, nothing, gzip
garbage) is wrapped in one; OpenAI error bodies pass as they are."""

from __future__ import annotations

import pytest
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error as _error


def test_upstream_errors_without_an_openai_body_are_wrapped():
    # Upstream mode passed an upstream's error body through verbatim: an HTML 404 page, an
    # empty 500, even a Python traceback reached the client (the rule: OpenAI error objects,
    # never a stack trace on the wire). OpenAI error bodies still pass as they are.
    import gzip
    import json

    from aiohttp import web
    from support.chat_upstream import proxy_over_chat

    answers = {
        "traceback": (
            500,
            b"Traceback (most recent call last):\n  File \"x\"\nKeyError: 'k'",
            "text/plain",
            None,
        ),
        "html": (404, b"<h1>Not Found</h1>", "text/html", None),
        "empty": (500, b"", "application/json", None),
        "list": (400, b"[1, 2]", "application/json", None),
        "gzip-garbage": (
            500,
            gzip.compress(b"Traceback (most recent call last):"),
            "text/plain",
            "gzip",
        ),
        "openai": (
            429,
            json.dumps(
                {
                    "error": {
                        "message": "slow down",
                        "type": "rate_limit_error",
                        "param": None,
                        "code": "x",
                    }
                }
            ).encode(),
            "application/json",
            None,
        ),
        "openai-gzip": (
            400,
            gzip.compress(
                json.dumps(
                    {
                        "error": {
                            "message": "nope",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": None,
                        }
                    }
                ).encode()
            ),
            "application/json",
            "gzip",
        ),
    }

    async def chat(request: web.Request) -> web.Response:
        status, body, ctype, enc = answers[(await request.json())["model"]]
        headers = {"Content-Type": ctype, "Retry-After": "3"}
        if enc:
            headers["Content-Encoding"] = enc
        return web.Response(status=status, body=body, headers=headers)

    with proxy_over_chat(chat) as http:
        for model, (status, _, _, _) in answers.items():
            r = http.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "x"}]},
            )
            assert r.status_code == status, (model, r.text)
            err = _error(r, status)
            assert "Traceback" not in r.text and "<h1>" not in r.text
            assert r.headers.get("Retry-After") == "3", model
            if model == "openai":
                assert err["message"] == "slow down"
            elif model == "openai-gzip":
                assert err["message"] == "nope"
            else:
                assert err["code"] == "upstream_error", err


# --- an upstream's refusal of a translated request, in the client's own words --------------
# The Anthropic request: its chat body's messages are [system, messages.0, messages.1
# (text + tool_use), tool (messages.2.content.0: the tool_result), messages.2 (its text)].
_CALL = {"type": "tool_use", "id": "call_0", "name": "f", "input": {}}
_TOOLS = [
    {"name": name, "input_schema": {"type": "object", "properties": {}}} for name in ("f", "g")
]
ANTHROPIC_BODY = {
    "model": "stub",
    "max_tokens": 5,
    "system": "be brief",
    "stop_sequences": ["x"],
    "metadata": {"user_id": "u1"},
    "tools": _TOOLS,
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "calling"}, _CALL]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_0", "content": "42"},
                {"type": "text", "text": "go on"},
            ],
        },
    ],
}
# The Gemini request, the same conversation: [system, contents.0, contents.1 (functionCall),
# tool (contents.2.parts.0: the functionResponse), contents.2 (its text)].
_PARAMS = {"type": "OBJECT", "properties": {}}
GEMINI_BODY = {
    "systemInstruction": {"parts": [{"text": "be brief"}]},
    "generationConfig": {"maxOutputTokens": 5, "stopSequences": ["x"]},
    "tools": [
        {
            "functionDeclarations": [
                {"name": "f", "parameters": _PARAMS},
                {"name": "g", "parametersJsonSchema": {"type": "object"}},
            ]
        }
    ],
    "contents": [
        {"role": "user", "parts": [{"text": "hi"}]},
        {"role": "model", "parts": [{"functionCall": {"id": "call_0", "name": "f", "args": {}}}]},
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"id": "call_0", "name": "f", "response": {"a": 1}}},
                {"text": "go on"},
            ],
        },
    ],
}
# (the chat body's field an upstream names, its Anthropic name, its Gemini name)
FIELD_CASES = [
    ("stop", "stop_sequences", "generationConfig.stopSequences"),
    ("max_completion_tokens", "max_tokens", "generationConfig.maxOutputTokens"),
    ("max_tokens", "max_tokens", "generationConfig.maxOutputTokens"),
    (
        "tools[1].function.parameters",
        "tools.1.input_schema",
        "tools.0.functionDeclarations.1.parametersJsonSchema",
    ),
    ("tools.0.function.name", "tools.0.name", "tools.0.functionDeclarations.0.name"),
    ("messages[1].content", "messages.0.content", "contents.0.parts"),
    ("messages.[2].content", "messages.1.content", "contents.1.parts"),  # OpenAI's spelling
    (
        "messages.3.tool_call_id",
        "messages.2.content.0.tool_use_id",
        "contents.2.parts.0.functionResponse",
    ),
    ("messages[4].content", "messages.2.content", "contents.2.parts"),
    ("messages[0].content", "system", "systemInstruction"),
]


@pytest.mark.parametrize("spelt", ["quoted", "leading"])
@pytest.mark.parametrize("dialect", ["anthropic", "gemini"])
@pytest.mark.parametrize(("chat", "anthropic", "gemini"), FIELD_CASES)
def test_a_refusal_of_a_translated_request_names_the_clients_own_field(
    chat, anthropic, gemini, dialect, spelt
):
    """Was: an OpenAI-compatible upstream's 400 about the chat body a Messages request was
    translated into reached the Anthropic client naming the chat body's fields (``stop``
    where it sent ``stop_sequences``, ``tools[1].function.parameters`` for
    ``tools.1.input_schema``, ``messages[2]`` one turn off: the system message, a tool
    result's own message); only the Gemini relay renamed, and only underscored top-level
    words. ``redact.upstream_error`` now rewords every translating relay's refusal with the
    dialect's table (``wire.client_fields``): ``param`` and the paths in the message."""
    from aiohttp import web
    from support.chat_upstream import proxy_over_chat

    said = f"Invalid '{chat}': out of range" if spelt == "quoted" else f"{chat}: out of range"
    seen: list[dict] = []

    async def chat_route(request: web.Request) -> web.Response:
        seen.append(await request.json())
        error = {"message": said, "type": "invalid_request_error", "param": chat, "code": None}
        return web.json_response({"error": error}, status=400)

    with proxy_over_chat(chat_route, models=["stub"]) as http:
        if dialect == "anthropic":
            r = http.post("/v1/messages", json=ANTHROPIC_BODY)
            assert r.status_code == 400, r.text
            err = r.json()["error"]  # Anthropic's error object: type and message only
            want, param = anthropic, None
        else:
            r = http.post("/v1beta/models/stub:generateContent", json=GEMINI_BODY)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            want = gemini
            param = err["details"][0]["fieldViolations"][0]["field"]
        sent = seen[0]
    message = err["message"]
    expected = f"Invalid '{want}': out of range" if spelt == "quoted" else f"{want}: out of range"
    assert message == expected, (sent.get("messages"), message)
    if param is not None:
        assert param == want


def test_in_client_words_renames_paths_and_leaves_prose():
    from prefixgate.gateway.http.errors import APIError
    from prefixgate.gateway.proxy.redact import in_client_words
    from prefixgate.gateway.wire.client_fields import anthropic_fields

    fields = anthropic_fields(["system", "messages.0"], 1, "output_config.format")
    err = APIError(400, "the stop words and messages are too long; see 'stop'", param="stop")
    in_client_words(err, fields)
    assert err.param == "stop_sequences"
    assert err.message == "the stop words and messages are too long; see 'stop_sequences'"
    for said, told in [
        ("stream_options: not taken", "stream_options: not taken"),  # the relay's own field
        ("messages[9]: no such turn", "messages: no such turn"),  # past the chat's messages
        ("response_format.json_schema: bad", "output_config.format: bad"),
        (
            "'parallel_tool_calls' needs tools",
            "'tool_choice.disable_parallel_tool_use' needs tools",
        ),
        ("Invalid value at tools[0].function: x", "Invalid value at tools.0: x"),
    ]:
        assert in_client_words(APIError(400, said), fields).message == told


def test_a_refusal_of_the_clients_own_messages_body_is_not_renamed(tmp_path):
    """An Anthropic deployment is sent the client's Messages body as it is: its refusal
    already names the client's fields and passes unrenamed (``messages.1`` stays)."""
    import httpx
    from aiohttp import web
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from support.anthropic_stub import claude_config

    said = "messages.1.content: bad block; 'stop' and max_completion_tokens are chat words"

    def upstream() -> web.Application:
        async def messages(request: web.Request) -> web.Response:
            error = {"type": "invalid_request_error", "message": said}
            return web.json_response({"type": "error", "error": error}, status=400)

        app = web.Application()
        app.router.add_post("/v1/messages", messages)
        return app

    with BackgroundServer(upstream) as up:
        cfg = claude_config(tmp_path / "proxy.toml", up.url)
        with BackgroundServer(lambda: create_proxy_app(cfg, GatewaySettings())) as gw:
            body = {**ANTHROPIC_BODY, "model": "claude"}
            r = httpx.post(gw.url + "/v1/messages", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == said
