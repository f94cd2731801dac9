"""``/tokenize``, ``/detokenize`` and ``/v1/embeddings`` in upstream mode
(``proxy/token_relay.py``): relayed to the upstream serving the body's model, its answer as
it came; the same answers as local mode's for the same body, the key checked first, an
unknown model the gateway's own 404, an upstream without the route a 501 naming it, a
garbage answer a 502."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.config import load_config
from prefixgate.gateway.proxy.routes import lacks_route
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.state import STATE
from support.chat_stub import ChatStub
from support.fake_engine import FakeEngine, assert_idle_and_whole
from support.http import assert_openai_error

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]

# (route, body): answered alike in both modes, 200s and 400s
BODIES: list[tuple[str, dict]] = [
    ("/tokenize", {"model": "fake", "prompt": "the fox"}),
    ("/tokenize", {"prompt": "no model named"}),
    ("/tokenize", {"model": "fake", "prompt": "bare", "add_special_tokens": False}),
    ("/tokenize", {"model": "fake", "messages": CHAT}),
    ("/tokenize", {"model": "fake", "messages": CHAT, "add_generation_prompt": False}),
    ("/tokenize", {"model": "fake", "messages": CHAT, "prompt": "both"}),  # 400
    ("/tokenize", {"model": "fake", "prompt": "x", "add_generation_prompt": True}),  # 400
    ("/tokenize", {"model": "fake", "prompt": "x", "cache_salt": "s"}),  # 400, unknown field
    ("/tokenize", {"model": 5, "prompt": "x"}),  # 400 naming model
    ("/detokenize", {"model": "fake", "tokens": [1, 107, 104, 104]}),
    ("/detokenize", {"tokens": [75, 76]}),
    ("/detokenize", {"model": "fake", "tokens": [1, 99999]}),  # 400 naming tokens.1
    ("/v1/embeddings", {"model": "fake", "input": "hi"}),  # 400: a generation model
]


def _same(local: httpx.Response, proxied: httpx.Response) -> None:
    """The proxy's answer is local mode's: status and JSON body (an error: its object)."""
    assert proxied.status_code == local.status_code, (local.text, proxied.text)
    assert proxied.headers["content-type"].startswith("application/json")
    assert proxied.json() == local.json(), (local.text, proxied.text)


def _proxy(upstreams, settings: GatewaySettings | None = None) -> BackgroundServer:
    make = lambda: create_proxy_app(upstreams, settings or GatewaySettings())  # noqa: E731
    return BackgroundServer(make).__enter__()


def test_tokenize_and_detokenize_through_the_proxy_answer_as_local_mode(serve_fake):
    local, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    gw = _proxy([local.url])
    try:
        with httpx.Client(timeout=10) as http:
            for path, body in BODIES:
                _same(http.post(local.url + path, json=body), http.post(gw.url + path, json=body))
            # the round trip: the proxy's tokens, detokenized through the proxy, are the text
            ids = http.post(gw.url + "/tokenize", json={"prompt": "round trip"}).json()["tokens"]
            r = http.post(gw.url + "/detokenize", json={"model": "fake", "tokens": ids})
            assert r.json() == {"prompt": "round trip"}
        assert gw.app[STATE].admission.in_flight == 0
        assert all(u.in_flight == 0 and u.healthy for u in gw.app[PROXY].router.upstreams)
    finally:
        gw.close()


class _Embedder(FakeEngine):
    """The fake engine served as a pooling model: a vector of two numbers per input."""

    async def embed_async(self, inputs: list[list[int]]) -> list[list[float]]:
        await asyncio.sleep(0)
        return [[len(x) / 8, sum(x) / 1024] for x in inputs]


def _prompt_tokens_counted(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.search(r"^prefixgate_prompt_tokens_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_embeddings_through_the_proxy_equal_local_modes_and_are_charged():
    engine = _Embedder()
    local = BackgroundServer(
        lambda: create_app(engine, GatewaySettings(model_name="emb"))
    ).__enter__()
    gw = _proxy([local.url])
    try:
        bodies = [
            {"model": "emb", "input": "hello there"},
            {"model": "emb", "input": ["a", "bcd"], "encoding_format": "base64"},
            {"model": "emb", "input": [[5, 6, 7]]},
            {"model": "emb", "input": "x", "dimensions": 8},  # 400 naming dimensions
            {"input": "no model"},  # 400: model is required, in both modes
            {"model": "emb", "input": []},  # 400: empty
        ]
        with httpx.Client(timeout=10) as http:
            for body in bodies:
                _same(
                    http.post(local.url + "/v1/embeddings", json=body),
                    http.post(gw.url + "/v1/embeddings", json=body),
                )
            before = _prompt_tokens_counted(gw.url)
            r = http.post(gw.url + "/v1/embeddings", json={"model": "emb", "input": "hello"})
            assert r.json()["usage"]["prompt_tokens"] == 6  # <s> + 5 bytes
        # charged the input tokens the answer reports, as local mode charges them
        assert _prompt_tokens_counted(gw.url) - before == 6
        assert gw.app[STATE].admission.in_flight == 0
    finally:
        gw.close()
        assert_idle_and_whole(local, engine)
        local.close()


def test_a_config_alias_reaches_the_upstream_as_its_model_and_no_fallback_answers(
    tmp_path: Path, servers
):
    served, spare = ChatStub(name="llama-3-8b"), ChatStub(name="other")
    up, other = servers(served.app), servers(spare.app)
    cfg = tmp_path / "proxy.toml"
    cfg.write_text(
        f"""
[[models]]
name = "llama"
aliases = ["small"]
fallbacks = ["spare"]
[[models.deployments]]
url = "{up.url}"
model = "llama-3-8b"
[[models]]
name = "spare"
[[models.deployments]]
url = "{other.url}"
"""
    )
    gw = servers(lambda: create_proxy_app(load_config(cfg), GatewaySettings()))
    r = httpx.post(gw.url + "/tokenize", json={"model": "small", "messages": CHAT})
    assert r.status_code == 200 and r.json()["count"] == len("be brief") + len("héllo")
    assert served.seen[-1]["model"] == "llama-3-8b"
    r = httpx.post(gw.url + "/tokenize", json={"messages": CHAT})
    assert_openai_error(r, 400, param="model")  # two models served: name one
    served.tokenize = False  # its /tokenize gone: the fallback model's tokenizer is no answer
    r = httpx.post(gw.url + "/tokenize", json={"model": "llama", "messages": CHAT})
    err = assert_openai_error(r, 501, code="unsupported_for_model")
    assert "/tokenize" in err["message"] and "'llama'" in err["message"]
    assert spare.seen == []


def test_an_unknown_model_is_404_and_a_missing_key_401(serve_fake):
    local, _ = serve_fake(GatewaySettings(model_name="fake", api_keys=["up-key"]))
    gw = _proxy([local.url], GatewaySettings(api_keys=["gk"], upstream_api_key="up-key"))
    try:
        with httpx.Client(base_url=gw.url, timeout=10) as http:
            for path in ("/tokenize", "/detokenize", "/v1/embeddings"):
                body = {"model": "fake", "prompt": "x", "tokens": [5], "input": "x"}
                assert_openai_error(http.post(path, json=body), 401, code="invalid_api_key")
                bad = {"Authorization": "Bearer nope"}
                r = http.post(path, json=body, headers=bad)
                assert_openai_error(r, 401, code="invalid_api_key")
            key = {"Authorization": "Bearer gk"}
            for path, body in (
                ("/tokenize", {"model": "gone", "prompt": "x"}),
                ("/detokenize", {"model": "gone", "tokens": [5]}),
                ("/v1/embeddings", {"model": "gone", "input": "x"}),
            ):
                r = http.post(path, json=body, headers=key)
                assert_openai_error(r, 404, code="model_not_found", param="model")
                # a malformed body beside it: local mode's 400 first, as on chat
                r = http.post(path, json={**body, "extra": 1}, headers=key)
                assert_openai_error(r, 400, param="extra")
            # the upstream credential goes with it: the upstream's own keys let it through
            r = http.post("/tokenize", json={"model": "fake", "prompt": "ok"}, headers=key)
            assert r.status_code == 200, r.text
    finally:
        gw.close()


def test_an_upstream_without_the_route_is_501_and_another_of_the_model_answers(servers):
    bare = ChatStub(tokenize=False)  # an OpenAI-compatible server with no /tokenize
    gw = servers(lambda: create_proxy_app([servers(bare.app).url], GatewaySettings()))
    for path, body in (
        ("/tokenize", {"model": "llama", "messages": CHAT}),
        ("/detokenize", {"model": "llama", "tokens": [5]}),
        ("/v1/embeddings", {"model": "llama", "input": "x"}),
    ):
        err = assert_openai_error(httpx.post(gw.url + path, json=body), 501)
        assert err["code"] == "unsupported_for_model" and path in err["message"], err
    assert gw.app[PROXY].router.upstreams[0].healthy  # no route is no fault
    full = ChatStub()
    urls = [servers(bare.app).url, servers(full.app).url]
    gw = servers(lambda: create_proxy_app(urls, GatewaySettings()))
    for _ in range(4):
        r = httpx.post(gw.url + "/tokenize", json={"model": "llama", "messages": CHAT})
        assert r.status_code == 200 and r.json()["count"] == 13, r.text


def _garbage_app(answer: bytes, ctype: str, status: int = 200) -> web.Application:
    async def route(request: web.Request) -> web.Response:
        return web.Response(body=answer, status=status, content_type=ctype)

    async def models(request: web.Request) -> web.Response:
        card = {"id": "m", "object": "model", "created": 0, "owned_by": "vllm"}
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    for path in ("/tokenize", "/detokenize", "/v1/embeddings"):
        app.router.add_post(path, route)
    app.router.add_get("/v1/models", models)
    return app


@pytest.mark.parametrize(
    "answer, ctype",
    [
        (b"<html><body>gateway</body></html>", "text/html"),
        (b'{"count": "many", "tokens": "all"', "application/json"),
        (b"[1, 2, 3]", "application/json"),
        (json.dumps({"ok": True}).encode(), "application/json"),  # no answer of the route
    ],
)
def test_a_garbage_answer_is_502_never_a_crash(servers, answer, ctype):
    up = servers(lambda: _garbage_app(answer, ctype))
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings()))
    for path, body in (
        ("/tokenize", {"model": "m", "prompt": "x"}),
        ("/detokenize", {"model": "m", "tokens": [5]}),
        ("/v1/embeddings", {"model": "m", "input": "x"}),
    ):
        r = httpx.post(gw.url + path, json=body)
        err = assert_openai_error(r, 502)
        assert "gateway</body>" not in err["message"]
    assert httpx.get(gw.url + "/health").status_code == 200
    assert gw.app[STATE].admission.in_flight == 0


def test_an_upstream_error_is_relayed_reworded(servers):
    vllm_404 = {
        "error": {
            "message": "The model `m` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    up = servers(lambda: _garbage_app(json.dumps(vllm_404).encode(), "application/json", 404))
    gw = servers(lambda: create_proxy_app([up.url], GatewaySettings()))
    r = httpx.post(gw.url + "/tokenize", json={"model": "m", "prompt": "x"})
    err = assert_openai_error(r, 404)  # the upstream's own 404, not "no such route"
    assert err["message"] == "The model `m` does not exist."


@pytest.mark.parametrize(
    "status, body, lacks",
    [
        (404, b"404: Not Found", True),  # aiohttp's
        (404, b'{"detail": "Not Found"}', True),  # FastAPI's
        (404, b"", True),
        (404, b'{"error": {"message": "unknown route POST /tokenize", "code": "not_found"}}', True),
        (405, b"", True),
        (501, b'{"error": {"message": "x", "code": "unsupported_in_upstream_mode"}}', True),
        (404, b'{"error": {"message": "The model `m` does not exist.", "code": 404}}', False),
        (404, b'{"object": "error", "message": "no model", "type": "NotFoundError"}', False),
        (400, b"bad", False),
        (500, b"", False),
    ],
)
def test_lacks_route_tells_a_missing_route_from_a_refused_request(status, body, lacks):
    assert lacks_route(status, body) is lacks


def test_an_anthropic_deployment_has_no_such_route(servers, tmp_path: Path):
    from support.anthropic_stub import AnthropicStub, claude_config

    claude = AnthropicStub()
    cfg = claude_config(tmp_path / "proxy.toml", servers(claude.app).url)
    gw = servers(lambda: create_proxy_app(cfg, GatewaySettings()))
    r = httpx.post(gw.url + "/tokenize", json={"model": "claude", "prompt": "x"})
    err = assert_openai_error(r, 501, code="unsupported_for_model")
    assert "Anthropic deployment" in err["message"]
    assert claude.seen == []


def test_a_malformed_body_without_a_model_is_named_before_the_model(servers):
    """Several models served and none named, in a body malformed too: the body's 400 first
    (naming its field, local mode's words), as beside an unknown model; the model's 400
    only for a well-formed body."""
    gw = servers(
        lambda: create_proxy_app(
            [servers(ChatStub(name="a").app).url, servers(ChatStub(name="b").app).url],
            GatewaySettings(),
        )
    )
    for path, body, param in (
        ("/tokenize", {"prompt": "x", "cache_salt": "s"}, "cache_salt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": ["x"]}, "tokens.0"),
        ("/detokenize", {"model": "", "tokens": [1], "extra": 1}, "extra"),
    ):
        assert_openai_error(httpx.post(gw.url + path, json=body), 400, param=param)
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert_openai_error(httpx.post(gw.url + path, json=body), 400, param="model")
