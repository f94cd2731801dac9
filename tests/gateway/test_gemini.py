"""Gemini's dialect on the fake engine: the mapping onto the chat (same prompt ids as a chat
completion), fields taken and refused by name, Gemini's error shape, a stream cut short ending
with an error google-genai raises, cache quotas, and the pure conversions (schemas, TTLs)."""

from __future__ import annotations

import json

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.wire.gemini_models import (
    GenerateContentRequest,
    json_schema,
    life_seconds,
    to_chat,
)

genai = pytest.importorskip("google.genai")
from google.genai import errors as genai_errors  # noqa: E402
from google.genai import types  # noqa: E402

GEN = "/v1beta/models/fake:generateContent"
HELLO = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}


def _post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=10, **kw)


def test_same_prompt_as_the_chat(serve_fake):
    srv, engine = serve_fake()
    body = {
        "systemInstruction": {"parts": [{"text": "be brief"}]},
        "contents": [
            {"role": "user", "parts": [{"text": "hi"}]},
            {"role": "model", "parts": [{"text": "hello"}]},
            {"parts": [{"text": "more"}, {"text": " please"}]},
        ],
        "generationConfig": {"maxOutputTokens": 3, "temperature": 0.5, "topK": 4, "seed": 9},
    }
    r = _post(srv, GEN, body)
    assert r.status_code == 200, r.text
    chat = {
        "model": "fake",
        "max_tokens": 3,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more please"},
        ],
    }
    assert _post(srv, "/v1/chat/completions", chat).status_code == 200
    (_, ids_g, params, _), (_, ids_c, _, _) = engine.requests_seen
    assert ids_g == ids_c
    assert (params.temperature, params.top_k, params.seed, params.max_tokens) == (0.5, 4, 9, 3)
    out = r.json()
    assert out["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert out["candidates"][0]["content"]["role"] == "model"
    u = out["usageMetadata"]
    assert u["promptTokenCount"] == len(ids_g) and u["candidatesTokenCount"] == 3
    assert u["totalTokenCount"] == len(ids_g) + 3
    assert out["modelVersion"] == "fake"


def test_stop_sequence_is_stop(serve_fake):
    srv, engine = serve_fake()
    # the fake writes letters from the prompt's ids: find the first one and stop on it
    first = _post(srv, GEN, {**HELLO, "generationConfig": {"maxOutputTokens": 1}}).json()
    letter = first["candidates"][0]["content"]["parts"][0]["text"]
    r = _post(
        srv, GEN, {**HELLO, "generationConfig": {"maxOutputTokens": 5, "stopSequences": [letter]}}
    )
    assert r.json()["candidates"][0]["finishReason"] == "STOP"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            {**HELLO, "generationConfig": {"thinkingConfig": {"thinkingBudget": 1024}}},
            "thinkingConfig",
        ),
        ({**HELLO, "generationConfig": {"responseModalities": ["TEXT"]}}, "responseModalities"),
        ({**HELLO, "generationConfig": {"responseLogprobs": True}}, "responseLogprobs"),
        ({**HELLO, "tools": [{"googleSearch": {}}]}, "googleSearch"),
        ({**HELLO, "tools": [{"codeExecution": {}}]}, "codeExecution"),
        ({"contents": [{"parts": [{"fileData": {"fileUri": "x"}}]}]}, "fileData"),
        ({"contents": [{"parts": [{"text": "a", "thought": True}]}]}, "thought"),
        ({**HELLO, "labels": {"a": "b"}}, "labels"),
        (
            {**HELLO, "generationConfig": {"responseMimeType": "text/x.enum"}},
            "responseMimeType",
        ),
        (
            {**HELLO, "generationConfig": {"responseSchema": {"type": "STRING"}}},
            "responseSchema",
        ),
        ({"contents": [{"role": "system", "parts": [{"text": "a"}]}]}, "role"),
        ({"contents": []}, "contents"),
        ({"contents": [{"role": "user", "parts": [{}]}]}, "parts.0"),
        ({"contents": [{"role": "model", "parts": [{"text": "a"}]}]}, "contents.0.role"),
        ({**HELLO, "generationConfig": {"candidateCount": 9}}, "candidateCount"),
        ({**HELLO, "model": "models/other"}, "model"),
    ],
)
def test_refused_by_name_in_gemini_shape(serve_fake, body, named):
    srv, _ = serve_fake()
    r = _post(srv, GEN, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"code", "message", "status"}
    assert err["code"] == 400 and err["status"] == "INVALID_ARGUMENT"
    assert named in err["message"], err


def test_safety_settings_taken_not_applied(serve_fake):
    srv, _ = serve_fake()
    body = {
        **HELLO,
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
    }
    assert _post(srv, GEN, body).status_code == 200


def test_bad_json_and_body_limits_in_gemini_shape(serve_fake):
    srv, _ = serve_fake(GatewaySettings(model_name="fake", max_body_bytes=2000))
    r = httpx.post(srv.url + GEN, content=b"{nope", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
    deep = b'{"contents": ' + b"[" * 300 + b"]" * 300 + b"}"
    r = httpx.post(srv.url + GEN, content=deep, timeout=10)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(srv.url + GEN, content=b"x" * 5000, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    r = httpx.get(srv.url + "/v1beta/nothing/here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    assert "GET /v1beta/nothing/here" in r.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_wrong_method_is_a_405_naming_the_allowed(serve_fake, mode):
    """A method asked with GET, or a cache with PUT, is a 405 with ``Allow`` in Gemini's
    shape, as the OpenAI routes answer a wrong method; not a 404 for a model or a route."""
    srv, _ = serve_fake()
    url = srv.url
    if mode == "proxy":
        proxy = BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings()))
        url = proxy.__enter__().url
    try:
        r = httpx.get(url + GEN, timeout=10)
        assert r.status_code == 405 and r.headers["Allow"] == "POST", r.text
        assert r.json()["error"]["status"] == "UNIMPLEMENTED", r.text
        r = httpx.put(url + "/v1beta/cachedContents/x", json={}, timeout=10)
        assert r.status_code == 405 and "PATCH" in r.headers["Allow"], r.text
        assert "PUT" in r.json()["error"]["message"]
    finally:
        if mode == "proxy":
            proxy.close()


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_get_of_a_method_of_a_colon_name_is_a_405_too(serve_fake, mode):
    """An Ollama-style name holds a colon (``llama:latest``): a GET of its method is the 405
    every other name gets, in Gemini's shape, under ``/v1beta`` and (a Google client's key)
    ``/v1``. Was: a 404 ``model_not_found`` for ``llama`` — the method was read after the
    name's first colon (``latest:generateContent``), not its last as the POST reads it."""
    srv, _ = serve_fake(GatewaySettings(model_name="llama:latest"))
    url = srv.url
    if mode == "proxy":
        proxy = BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings()))
        url = proxy.__enter__().url
    try:
        for method in ("generateContent", "streamGenerateContent", "countTokens"):
            for prefix, headers in (("/v1beta", {}), ("/v1", {"x-goog-api-key": "k"})):
                path = f"{prefix}/models/llama:latest:{method}"
                r = httpx.get(url + path, headers=headers, timeout=10)
                assert r.status_code == 405 and r.headers["Allow"] == "POST", (path, r.text)
                err = r.json()["error"]
                assert err["status"] == "UNIMPLEMENTED" and "method GET" in err["message"], err
        r = httpx.get(url + "/v1beta/models/llama:latest", timeout=10)  # the name itself
        assert r.status_code == 200 and r.json()["name"] == "models/llama:latest", r.text
        path = "/v1beta/models/llama:latest:generateContent"
        r = httpx.post(url + path, json=HELLO, timeout=10)
        assert r.status_code == 200, r.text  # the POST of the same path is served
    finally:
        if mode == "proxy":
            proxy.close()


def test_stream_chunks_and_end(serve_fake):
    srv, _ = serve_fake()
    path = "/v1beta/models/fake:streamGenerateContent?alt=sse"
    body = {**HELLO, "generationConfig": {"maxOutputTokens": 4, "candidateCount": 2}}
    with httpx.stream("POST", srv.url + path, json=body, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    chunks = [json.loads(ln[6:]) for ln in lines]
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        for cand in c["candidates"]:
            texts[cand["index"]] += cand["content"]["parts"][0]["text"]
            assert "finishReason" not in cand
    last = chunks[-1]
    assert [c["finishReason"] for c in last["candidates"]] == ["MAX_TOKENS", "MAX_TOKENS"]
    assert last["usageMetadata"]["candidatesTokenCount"] == 8
    assert all(len(t) == 4 for t in texts.values())


def test_stream_cut_ends_with_an_error_the_client_raises(serve_fake):
    srv, engine = serve_fake()
    engine.fail_after(2)
    path = "/v1beta/models/fake:streamGenerateContent?alt=sse"
    body = {**HELLO, "generationConfig": {"maxOutputTokens": 8}}
    with httpx.stream("POST", srv.url + path, json=body, timeout=10) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    last = json.loads(lines[-1][6:])
    assert last["error"]["code"] == 500 and last["error"]["status"] == "INTERNAL"
    assert all("finishReason" not in json.dumps(ln) for ln in lines[:-1])
    client = genai.Client(
        api_key="x", http_options=types.HttpOptions(base_url=srv.url, api_version="v1beta")
    )
    with pytest.raises(genai_errors.ServerError):
        for _ in client.models.generate_content_stream(
            model="fake", contents="hello", config=types.GenerateContentConfig(max_output_tokens=8)
        ):
            pass


def test_count_tokens_forms(serve_fake):
    srv, _ = serve_fake()
    a = _post(srv, "/v1beta/models/fake:countTokens", HELLO).json()
    b = _post(srv, "/v1beta/models/fake:countTokens", {"generateContentRequest": HELLO}).json()
    g = _post(srv, GEN, {**HELLO, "generationConfig": {"maxOutputTokens": 1}}).json()
    assert a["totalTokens"] == b["totalTokens"] == g["usageMetadata"]["promptTokenCount"]
    r = _post(srv, "/v1beta/models/fake:countTokens", {})
    assert r.status_code == 400


def test_cache_quota_and_prefix_api_share_one_pin(serve_fake, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "k1", "name": "one", "max_prefixes": 1}]}))
    srv, engine = serve_fake(GatewaySettings(model_name="fake", keys_file=str(keys)))
    h = {"x-goog-api-key": "k1"}
    body = {
        "model": "models/fake",
        "systemInstruction": {"parts": [{"text": "s" * 40}]},
        "ttl": "60s",
    }
    r = _post(srv, "/v1beta/cachedContents", body, headers=h)
    assert r.status_code == 200, r.text
    name = r.json()["name"]
    r = _post(srv, "/v1beta/cachedContents", body, headers=h)
    assert r.status_code == 429 and r.json()["error"]["status"] == "RESOURCE_EXHAUSTED"
    assert "Retry-After" in r.headers
    # the prefix API sees the same entry, and counts it in the same quota
    pid = name.removeprefix("cachedContents/")
    auth = {"Authorization": "Bearer k1"}
    assert httpx.get(f"{srv.url}/v1/prefixes/{pid}", headers=auth).status_code == 200
    pre = {"model": "fake", "messages": [{"role": "user", "content": "x" * 40}]}
    assert _post(srv, "/v1/prefixes", pre, headers=auth).status_code == 429
    # deleted through the prefix API: gone for Gemini too, and its pin released
    assert httpx.delete(f"{srv.url}/v1/prefixes/{pid}", headers=auth).status_code == 200
    r = httpx.get(f"{srv.url}/v1beta/{name}", headers=h)
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    assert engine.pinned_blocks == 0


def test_cache_bad_fields(serve_fake):
    srv, _ = serve_fake()
    base = {"model": "models/fake", "systemInstruction": {"parts": [{"text": "s" * 40}]}}
    for extra, named in (
        ({"ttl": "5m"}, "ttl"),
        ({"ttl": "0s"}, "ttl"),
        ({"ttl": "10s", "expireTime": "2999-01-01T00:00:00Z"}, "expireTime"),
        ({"expireTime": "2000-01-01T00:00:00Z"}, "expireTime"),
        ({"ttl": "9999999s"}, "ttl"),
        ({"toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}, "toolConfig"),
        ({"kmsKeyName": "x"}, "kmsKeyName"),
    ):
        r = _post(srv, "/v1beta/cachedContents", {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert named in r.json()["error"]["message"], (extra, r.text)
    r = _post(srv, "/v1beta/cachedContents", {**base, "model": "models/other"})
    assert r.status_code == 404
    r = httpx.patch(srv.url + "/v1beta/cachedContents/pfx-nope", json={"ttl": "5s"})
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"


def test_cache_renew_moves_the_expiry(serve_fake):
    srv, engine = serve_fake()
    body = {"model": "models/fake", "contents": [{"parts": [{"text": "c" * 40}]}], "ttl": "30s"}
    made = _post(srv, "/v1beta/cachedContents", body).json()
    url = f"{srv.url}/v1beta/{made['name']}"
    r = httpx.patch(url, params={"updateMask": "ttl"}, json={"ttl": "300s"})
    assert r.status_code == 200, r.text
    assert r.json()["expireTime"] > made["expireTime"]
    assert len(engine._pins) == 1  # the old pin released
    r = httpx.patch(url, params={"updateMask": "displayName"}, json={"ttl": "300s"})
    assert r.status_code == 400 and "updateMask" in r.json()["error"]["message"]
    # a life past --max-prefix-ttl-s names the field sent (it blamed ttl for an expireTime)
    far = {"expireTime": "2099-01-01T00:00:00Z"}
    r = httpx.patch(url, params={"updateMask": "expireTime"}, json=far)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("expireTime:"), r.text
    violation = r.json()["error"]["details"][0]["fieldViolations"][0]
    assert violation["field"] == "expireTime"
    listed = httpx.get(srv.url + "/v1beta/cachedContents", params={"pageSize": 1}).json()
    assert [c["name"] for c in listed["cachedContents"]] == [made["name"]]
    assert httpx.delete(url).json() == {}
    assert engine.pinned_blocks == 0


def test_generate_with_cache_reads_its_messages(serve_fake):
    srv, engine = serve_fake()
    body = {"model": "models/fake", "systemInstruction": {"parts": [{"text": "S" * 40}]}}
    name = _post(srv, "/v1beta/cachedContents", body).json()["name"]
    r = _post(
        srv, GEN, {**HELLO, "cachedContent": name, "generationConfig": {"maxOutputTokens": 1}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usageMetadata"]["cachedContentTokenCount"] >= 32
    inline = {**HELLO, "systemInstruction": {"parts": [{"text": "S" * 40}]}}
    ids_cached = engine.requests_seen[-1][1]
    _post(srv, GEN, {**inline, "generationConfig": {"maxOutputTokens": 1}})
    assert engine.requests_seen[-1][1] == ids_cached
    tools = [{"functionDeclarations": [{"name": "f"}]}]
    for extra in ({"systemInstruction": {"parts": [{"text": "x"}]}}, {"tools": tools}):
        r = _post(srv, GEN, {**HELLO, "cachedContent": name, **extra})
        assert r.status_code == 400 and next(iter(extra)) in r.json()["error"]["message"]
    # empty fields are absent: beside a cache, and an empty cache name
    for extra in ({"tools": []}, {"toolConfig": {}}, {"safetySettings": []}):
        r = _post(srv, GEN, {**HELLO, "cachedContent": name, **extra})
        assert r.status_code == 200, (extra, r.text)
    r = _post(srv, GEN, {**HELLO, "cachedContent": "", "generationConfig": {"maxOutputTokens": 1}})
    assert r.status_code == 200, r.text
    r = _post(srv, GEN, {**HELLO, "cachedContent": "nope"})
    assert r.status_code == 400 and "cachedContent" in r.json()["error"]["message"]


# --- pure conversions ----------------------------------------------------------------------
def test_json_schema_from_gemini_schema():
    schema = {
        "type": "OBJECT",
        "properties": {
            "name": {"type": "STRING", "description": "who"},
            "tags": {"type": "ARRAY", "items": {"type": "STRING"}, "minItems": 1},
            "age": {"type": "INTEGER", "nullable": True},
        },
        "required": ["name"],
        "propertyOrdering": ["name", "tags", "age"],
    }
    assert json_schema(schema, "s") == {
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "who"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "age": {"type": ["integer", "null"]},
        },
        "required": ["name"],
    }
    with pytest.raises(APIError) as e:
        json_schema({"type": "OBJECT", "additionalProperties": False}, "s")
    assert e.value.param == "s.additionalProperties"
    with pytest.raises(APIError):
        json_schema({"type": "TUPLE"}, "s")


def test_life_seconds():
    assert life_seconds("300s", None, 1.0) == 300.0
    assert life_seconds("1.5s", None, 1.0) == 1.5
    assert life_seconds(None, None, 7.0) == 7.0
    assert 3500 < life_seconds(None, _in(3600), 1.0) <= 3600
    for ttl in ("300", "5m", "-1s", "s", "1e3s"):
        with pytest.raises(APIError):
            life_seconds(ttl, None, 1.0)


def _in(seconds: float) -> str:
    import datetime as dt

    return (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)).isoformat()


def test_function_turns_map_to_tool_messages():
    req = GenerateContentRequest.model_validate(
        {
            "contents": [
                {"role": "user", "parts": [{"text": "weather?"}]},
                {
                    "role": "model",
                    "parts": [{"functionCall": {"name": "get", "args": {"city": "Oslo"}}}],
                },
                {
                    "role": "user",
                    "parts": [{"functionResponse": {"name": "get", "response": {"t": 3}}}],
                },
            ],
            "tools": [
                {
                    "functionDeclarations": [
                        {
                            "name": "get",
                            "parameters": {
                                "type": "OBJECT",
                                "properties": {"city": {"type": "STRING"}},
                            },
                        }
                    ]
                }
            ],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY"}},
        }
    )
    chat = to_chat(req)
    assert chat.messages == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": '{"t": 3}'},
    ]
    params = chat.tools[0]["function"]["parameters"]
    assert params == {"type": "object", "properties": {"city": {"type": "string"}}}
    # ANY with one declared function: that function
    assert chat.tool_choice == {"type": "function", "function": {"name": "get"}}


def test_function_response_without_call_refused():
    req = GenerateContentRequest.model_validate(
        {"contents": [{"parts": [{"functionResponse": {"name": "get", "response": {}}}]}]}
    )
    with pytest.raises(APIError) as e:
        to_chat(req)
    assert "functionResponse" in (e.value.param or "")


def test_auto_without_a_parser_names_the_mode(serve_fake):
    srv, _ = serve_fake()
    tools = [{"functionDeclarations": [{"name": "f", "parameters": {"type": "OBJECT"}}]}]
    # the first tools request of a process imports torch (tools.check_tools): minutes on a
    # loaded machine, not the route's own time
    r = httpx.post(srv.url + GEN, json={**HELLO, "tools": tools}, timeout=120)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "functionCallingConfig.mode" in err["message"], err
    assert err["details"][0]["fieldViolations"][0]["field"].startswith("toolConfig")


def test_unreadable_body_in_gemini_shape(serve_fake):
    srv, _ = serve_fake()
    r = httpx.post(
        srv.url + GEN, content=b"not gzip at all", headers={"Content-Encoding": "gzip"}, timeout=10
    )
    assert r.status_code == 400
    assert r.json()["error"]["status"] == "INVALID_ARGUMENT", r.text


def test_contents_counted_before_validation(serve_fake):
    srv, _ = serve_fake()
    many = {"contents": [{"parts": [{"text": "a"}]}] * 4097}
    for path, body in (
        (GEN, many),
        ("/v1beta/models/fake:countTokens", many),
        ("/v1beta/models/fake:countTokens", {"generateContentRequest": many}),
        ("/v1beta/cachedContents", {"model": "models/fake", **many}),
    ):
        r = _post(srv, path, body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert "at most 4096" in err["message"] and err["status"] == "INVALID_ARGUMENT", err
