"""Gemini's dialect in proxy mode against stub upstreams: a relayed stream cut short (the
upstream closes mid-stream, or sends garbage) ends with Gemini's error event, never as a
success; an upstream's error is reworded in Gemini's shape; a translated request carries the
key's salt, the generation config and the usage request."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.http import counts_both_modes

genai = pytest.importorskip("google.genai")
from google.genai import errors as genai_errors  # noqa: E402
from google.genai import types  # noqa: E402

STREAM = "/v1beta/models/stub:streamGenerateContent?alt=sse"
GEN = "/v1beta/models/stub:generateContent"
BODY = {
    "contents": [{"parts": [{"text": "hi"}]}],
    "generationConfig": {"maxOutputTokens": 3, "temperature": 0.5, "stopSequences": ["x"]},
}


def _chunk(text: str | None, finish: str | None = None) -> bytes:
    delta = {"content": text} if text is not None else {}
    obj = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "stub",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _stub(mode: str, seen: list) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if mode == "error":
            return web.json_response(
                {"error": {"message": "secret detail", "type": "invalid_request_error"}},
                status=400,
            )
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "stub",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hey"},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk("he"))
        if mode == "cut":
            request.transport.close()  # the connection dies mid-stream
            return resp
        if mode == "garbage":
            await resp.write(b"data: {not json\n\n")
            return resp
        if mode == "no_finish":
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if mode == "stall":  # silent past the gateway's idle timeout
            await asyncio.sleep(30)
        if mode == "pause":  # silent for a while (within the idle timeout), then the rest
            await asyncio.sleep(0.7)
        await resp.write(_chunk("y", "length"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"count": 5})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    if mode == "tokenize":
        app.router.add_post("/tokenize", tokenize)
    return app


@pytest.fixture
def proxied():
    made: list[BackgroundServer] = []

    def start(mode: str, **settings_kw: object) -> tuple[BackgroundServer, list]:
        seen: list = []
        up = BackgroundServer(lambda: _stub(mode, seen)).__enter__()
        settings = GatewaySettings(api_keys=["k1"], **settings_kw)  # type: ignore[arg-type]
        gw = BackgroundServer(lambda: create_proxy_app([up.url], settings)).__enter__()
        made.extend([gw, up])
        return gw, seen

    yield start
    for srv in made:
        srv.close()


def _events(url: str) -> list[dict]:
    with httpx.stream(
        "POST", url + STREAM, json=BODY, headers={"x-goog-api-key": "k1"}, timeout=10
    ) as r:
        assert r.status_code == 200
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]


@pytest.mark.parametrize("mode", ["cut", "garbage", "no_finish"])
def test_a_cut_relayed_stream_ends_with_an_error(proxied, mode):
    gw, _ = proxied(mode)
    events = _events(gw.url)  # "he" may come first (or not: read with the broken end)
    last = events[-1]
    assert last["error"]["code"] == 502 and last["error"]["status"] == "UNAVAILABLE", last
    assert not any("finishReason" in c for e in events for c in e.get("candidates", []))
    client = genai.Client(
        api_key="k1", http_options=types.HttpOptions(base_url=gw.url, api_version="v1beta")
    )
    with pytest.raises(genai_errors.ServerError):
        list(client.models.generate_content_stream(model="stub", contents="hi"))


def _raw(url: str) -> bytes:
    with httpx.stream(
        "POST", url + STREAM, json=BODY, headers={"x-goog-api-key": "k1"}, timeout=10
    ) as r:
        assert r.status_code == 200
        return r.read()


def test_a_silent_upstream_gets_gemini_keepalives_then_the_rest(proxied):
    """An upstream silent mid-stream for longer than ``--keepalive-s``: the client gets
    Gemini's keep-alive (an empty line, as local mode's Gemini stream sends; never a ``:``
    comment, which google-genai reads as a JSON chunk), then the rest of the stream; the
    google-genai client reads it whole."""
    gw, _ = proxied("pause", keepalive_s=0.2)
    raw = _raw(gw.url)
    head, sep, rest = raw.partition(b"}\n\n\n")  # the first event, then a keep-alive line
    assert sep and head.startswith(b"data: ") and b'"he"' in head, raw
    assert rest.lstrip(b"\n").startswith(b"data: "), raw  # the rest came after the pause
    assert b"MAX_TOKENS" in rest and not any(ln.startswith(b":") for ln in raw.split(b"\n"))
    client = genai.Client(
        api_key="k1", http_options=types.HttpOptions(base_url=gw.url, api_version="v1beta")
    )
    chunks = list(client.models.generate_content_stream(model="stub", contents="hi"))
    assert "".join(c.text or "" for c in chunks) == "hey"
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.MAX_TOKENS


def test_a_stream_whose_upstream_goes_silent_ends_with_a_timeout_as_on_chat(proxied):
    """An upstream silent mid-stream past ``--upstream-timeout-s``: Gemini's stream ends with a
    504 DEADLINE_EXCEEDED event saying how long it waited, as the chat and Messages relays
    say it (was a 502 UNAVAILABLE "connection broke mid-stream: SocketTimeoutError"); the
    keep-alives sent meanwhile do not push the limit back."""
    gw, _ = proxied("stall", upstream_timeout_s=0.5, keepalive_s=0.1)
    t0 = time.monotonic()
    raw = _raw(gw.url)
    assert time.monotonic() - t0 < 3, "the silence limit holds with keep-alives going out"
    assert b"}\n\n\n" in raw, raw  # keep-alives went out while the upstream was silent
    last = _events(gw.url)[-1]
    assert last["error"]["code"] == 504 and last["error"]["status"] == "DEADLINE_EXCEEDED", last
    assert "sent nothing for 0.5 s" in last["error"]["message"], last
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers={"Authorization": "Bearer k1"},
        timeout=10,
    )
    assert "sent nothing for 0.5 s" in r.text.splitlines()[-2], r.text  # the chat relay's words


def test_a_whole_relayed_stream_and_the_translated_body(proxied):
    gw, seen = proxied("ok")
    events = _events(gw.url)
    assert events[-1]["candidates"][0]["finishReason"] == "MAX_TOKENS"
    body = seen[-1]
    assert body["max_tokens"] == 3 and body["temperature"] == 0.5 and body["stop"] == ["x"]
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    r = httpx.post(gw.url + GEN, json=BODY, headers={"x-goog-api-key": "k1"}, timeout=10)
    out = r.json()
    assert out["candidates"][0]["content"]["parts"] == [{"text": "hey"}]
    # the stub reports no cached tokens: none are claimed
    assert out["usageMetadata"] == {
        "promptTokenCount": 4,
        "candidatesTokenCount": 3,
        "totalTokenCount": 7,
    }


@pytest.mark.parametrize("mode", ["tokenize", "ok"])
def test_count_tokens_asks_the_upstream_tokenize_or_is_501_naming_the_method(proxied, mode):
    gw, seen = proxied(mode)
    r = httpx.post(
        gw.url + "/v1beta/models/stub:countTokens",
        json={"contents": BODY["contents"]},
        headers={"x-goog-api-key": "k1"},
        timeout=10,
    )
    if mode == "tokenize":
        assert r.status_code == 200 and r.json() == {"totalTokens": 5}
        assert seen[-1]["add_generation_prompt"] is True
        assert seen[-1]["messages"] == [{"role": "user", "content": "hi"}]
    else:  # the upstream has no /tokenize
        assert r.status_code == 501
        assert "countTokens is not available for models/stub" in r.json()["error"]["message"]


def test_an_upstream_error_is_reworded_in_gemini_shape(proxied):
    gw, _ = proxied("error")
    r = httpx.post(gw.url + GEN, json=BODY, headers={"x-goog-api-key": "k1"}, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["status"] == "INVALID_ARGUMENT" and err["message"] == "secret detail"  # a 4xx's


def test_proxy_caches_say_what_they_cannot_do(proxied):
    gw, seen = proxied("ok")
    h = {"x-goog-api-key": "k1"}
    base = {"model": "models/stub", "systemInstruction": {"parts": [{"text": "be brief"}]}}
    for extra, named in (
        ({"tools": [{"functionDeclarations": [{"name": "f"}]}]}, "tools"),
        ({"displayName": "x"}, "displayName"),
    ):
        r = httpx.post(gw.url + "/v1beta/cachedContents", json={**base, **extra}, headers=h)
        # a field not implemented: a 400 naming it (was a 501, which the fuzzer counted as a
        # server fault and google-genai's client retries)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["status"] == "INVALID_ARGUMENT" and named in err["message"]
    # an OpenAI-compatible upstream: the cache's text is kept here and sent in full
    made = httpx.post(gw.url + "/v1beta/cachedContents", json=base, headers=h).json()
    url = f"{gw.url}/v1beta/{made['name']}"
    r = httpx.patch(url, json={"ttl": "60s"}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert "ttl" in r.json()["error"]["message"]
    r = httpx.patch(gw.url + "/v1beta/cachedContents/pfx-nope", json={"ttl": "60s"}, headers=h)
    assert r.status_code == 404
    body = {"contents": [{"parts": [{"text": "hi"}]}], "cachedContent": made["name"]}
    assert httpx.post(gw.url + GEN, json=body, headers=h).status_code == 200
    assert seen[-1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert httpx.delete(url, headers=h).json() == {}
    assert httpx.get(url, headers=h).status_code == 404


def test_an_upstream_refusal_names_the_gemini_field_the_client_sent(serve_fake):
    """Over the context with its ``maxOutputTokens``: the upstream (a gateway speaking chat
    completions) refuses ``max_tokens``; the client sent ``generationConfig.maxOutputTokens``
    and reads that name, as local mode's refusal has it."""
    local, _ = serve_fake(max_model_len=128)
    body = {
        "contents": [{"parts": [{"text": "hi"}]}],
        "generationConfig": {"maxOutputTokens": 1000},
    }
    with BackgroundServer(lambda: create_proxy_app([local.url], GatewaySettings())) as proxy:
        via_proxy = httpx.post(proxy.url + "/v1beta/models/fake:generateContent", json=body).json()
    direct = httpx.post(local.url + "/v1beta/models/fake:generateContent", json=body).json()
    for err in (via_proxy["error"], direct["error"]):
        assert err["code"] == 400, err
        assert "generationConfig.maxOutputTokens" in err["message"], err
        assert "max_tokens" not in err["message"], err


def test_count_tokens_counts_what_generation_would_refuse_in_both_modes(serve_fake):
    """countTokens generates nothing: stop sequences beside a forced call (a 400 on
    generateContent, where they would cut the constrained text) are counted, in local mode and
    through a proxy (which refused them, unlike local mode; found by test_edge_combinations.py)."""
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings

    local, _ = serve_fake()
    inner = {
        "model": "models/fake",
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "generationConfig": {"stopSequences": ["\n"]},
        "tools": [{"functionDeclarations": [{"name": "f", "parameters": {"type": "object"}}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY"}},
    }
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    with BackgroundServer(lambda: create_proxy_app([local.url], slow)) as proxy:
        counts = []
        for base in (local.url, proxy.url):
            r = httpx.post(
                base + "/v1beta/models/fake:countTokens",
                json={"generateContentRequest": inner},
                timeout=120,
            )
            assert r.status_code == 200, (base, r.text)
            counts.append(r.json()["totalTokens"])
            r = httpx.post(base + "/v1beta/models/fake:generateContent", json=inner, timeout=120)
            assert r.status_code == 400, (base, r.text)
        assert counts[0] == counts[1]


COUNT_TOKENS = "/v1beta/models/fake:countTokens"


def test_count_tokens_under_mode_none_counts_no_tool_declarations_in_both_modes(
    serve_fake, tools_in_prompt
):
    """``functionCallingConfig.mode: NONE``: local mode renders the prompt without the tool
    declarations (``tool_choice`` ``"none"``: no tools in the plan), as generation does; the
    proxy sent ``tools`` to its upstream's ``/tokenize`` anyway and counted them. Both modes
    now give the count of the same body without its tools."""
    local, _ = serve_fake()
    tools = [{"functionDeclarations": [{"name": "weather", "parameters": {"type": "object"}}]}]
    bare = {"model": "models/fake", "contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    none = {**bare, "tools": tools, "toolConfig": {"functionCallingConfig": {"mode": "NONE"}}}
    forced = {**none, "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    with BackgroundServer(lambda: create_proxy_app([local.url], slow)) as proxy:
        bodies = {"bare": bare, "none": none, "forced": forced}
        counts = counts_both_modes(
            local.url,
            proxy.url,
            COUNT_TOKENS,
            bodies,
            "totalTokens",
            wrap_in="generateContentRequest",
        )
    assert counts["local", "forced"] > counts["local", "none"], counts  # tools are rendered
    assert counts["local", "none"] == counts["local", "bare"], counts
    for name in ("bare", "none", "forced"):
        assert counts["proxy", name] == counts["local", name], (name, counts)


@pytest.mark.parametrize("config", [None, {"functionCallingConfig": {"mode": "AUTO"}}])
def test_count_tokens_counts_auto_tools_without_a_tool_call_parser_in_both_modes(
    serve_fake, tools_in_prompt, config
):
    """A server started without ``--tool-call-parser`` counts a body with tools under mode
    AUTO (the default with tools): the parser only parses a generated answer, the prompt
    declares the tools all the same. Local mode answered 400 "needs --tool-call-parser" where
    the proxy's count through its upstream's ``/tokenize`` answered 200; both modes now give
    the same count, the tools' declarations in it, and generation keeps its 400."""
    local, _ = serve_fake()  # GatewaySettings(model_name="fake"): no tool-call parser
    tools = [{"functionDeclarations": [{"name": "weather", "parameters": {"type": "object"}}]}]
    bare = {"model": "models/fake", "contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    auto: dict = {**bare, "tools": tools}
    if config is not None:
        auto["toolConfig"] = config
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    with BackgroundServer(lambda: create_proxy_app([local.url], slow)) as proxy:
        bodies = {"bare": bare, "auto": auto}
        counts = counts_both_modes(
            local.url,
            proxy.url,
            COUNT_TOKENS,
            bodies,
            "totalTokens",
            wrap_in="generateContentRequest",
        )
    assert counts["local", "auto"] > counts["local", "bare"], counts  # tools are rendered
    assert counts["proxy", "auto"] == counts["local", "auto"], counts
    r = httpx.post(local.url + "/v1beta/models/fake:generateContent", json=auto, timeout=120)
    assert r.status_code == 400 and "--tool-call-parser" in r.text, r.text
    assert r.json()["error"]["status"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    "config",
    [
        {"responseMimeType": "application/json", "responseSchema": {"type": "OBJECT"}},
        {"responseMimeType": "application/json"},
    ],
)
def test_a_json_response_beside_callable_tools_is_the_same_400_in_both_modes(serve_fake, config):
    """A JSON response beside tools the model may call: local mode refused it (400 naming
    ``generationConfig.responseMimeType``) while a proxy relayed it to its upstream as a chat
    with ``response_format`` and ``tools``, which served it. Now one check
    (``gemini_models.refuse_constraint_beside_tools``) gives both modes the same error object;
    with ``mode: NONE`` (no tool can be called) both serve it."""
    local, _ = serve_fake(GatewaySettings(model_name="fake", tool_call_parser="hermes"))
    tools = [{"functionDeclarations": [{"name": "f", "parameters": {"type": "object"}}]}]
    body = {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "generationConfig": config,
        "tools": tools,
    }
    none = {**body, "toolConfig": {"functionCallingConfig": {"mode": "NONE"}}}
    slow = GatewaySettings(health_check_timeout_s=60.0)  # the first tools import xgrammar
    with BackgroundServer(lambda: create_proxy_app([local.url], slow)) as proxy:
        errors = []
        for base in (local.url, proxy.url):
            r = httpx.post(base + "/v1beta/models/fake:generateContent", json=body, timeout=120)
            assert r.status_code == 400, (base, r.text)
            errors.append(r.json()["error"])
            assert "generationConfig.responseMimeType" in r.json()["error"]["message"]
            r = httpx.post(base + "/v1beta/models/fake:generateContent", json=none, timeout=120)
            assert r.status_code == 200, (base, r.text)
        assert errors[0] == errors[1]


KEY = "sk-upstream-key-1234"
LLAMA = "/v1beta/models/llama:"


def _stubbed(servers, **stub_kw: object) -> BackgroundServer:
    from support.chat_stub import ChatStub

    up = servers(ChatStub(**stub_kw).app)  # type: ignore[arg-type]
    return servers(lambda: create_proxy_app([up.url], GatewaySettings(upstream_api_key=KEY)))


def _lines(gw: BackgroundServer) -> list[dict]:
    path = LLAMA + "streamGenerateContent?alt=sse"
    with httpx.stream("POST", gw.url + path, json=BODY, timeout=10) as r:
        assert r.status_code == 200
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]


def test_an_upstream_abort_is_an_error_never_a_finish_reason(servers):
    """vLLM's ``finish_reason: "abort"``: Gemini's error (502 ``request_aborted``'s words),
    whole and streamed, never a candidate with ``finishReason: OTHER`` — as local mode ends
    an answer its engine aborted."""
    gw = _stubbed(servers, finish_reason="abort")
    r = httpx.post(gw.url + LLAMA + "generateContent", json=BODY, timeout=10)
    assert r.status_code == 502 and "aborted the request" in r.json()["error"]["message"]
    events = _lines(gw)
    assert events[-1]["error"]["code"] == 502 and "aborted" in events[-1]["error"]["message"]
    assert not any("finishReason" in c for e in events for c in e.get("candidates", []))


@pytest.mark.parametrize(
    "error, said",
    [  # a 4xx: its message, the key scrubbed; a 5xx: the gateway's words, never its message
        ({"message": f"bad logit_bias for {KEY}", "type": "BadRequestError", "code": 400},
         "bad logit_bias for [redacted]"),
        ({"message": "gpu-7 OOM at /srv/x", "type": "InternalServerError", "code": 500},
         "the upstream ended its stream with an error (InternalServerError)"),
    ],
)  # fmt: skip
def test_an_upstream_error_event_mid_stream_keeps_its_message_as_the_chat_relay(
    servers, error, said
):
    after = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    events = _lines(_stubbed(servers, after_first=after))
    assert events[-1]["error"]["message"] == said, events[-1]
    assert KEY not in json.dumps(events) and "/srv/x" not in json.dumps(events)
