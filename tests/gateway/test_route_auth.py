"""Every registered route checks the key first, in both modes: without a valid key the answer
is 401 ``invalid_api_key`` (Anthropic's shape on the Messages routes), before any other answer
— 503 while the model loads, 501 of a local-mode route in upstream mode, 400 of a bad body,
404 of an unknown model or prefix. Only ``app.OPEN_ROUTES`` (probes, dashboard, fallback)
answer without one."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prefixgate.gateway.app import OPEN_ROUTES, create_app, create_proxy_app
from prefixgate.gateway.http.errors import is_gemini_path
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

KEY = "sk-route-auth"
NO_KEYS = (
    {},
    {"Authorization": "Bearer wrong"},
    {"x-api-key": "wrong"},
    {"Authorization": "Basic x"},
    {"x-goog-api-key": "wrong"},
)


def _keys(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": KEY, "name": "team"}]}))
    return str(path)


def _routes(app) -> list[tuple[str, str]]:
    """``(method, path)`` of every registered route but the open ones, path parameters
    filled in."""
    out = []
    for resource in app.router.resources():
        if resource.canonical in OPEN_ROUTES:
            continue
        for route in resource:
            if route.method in ("HEAD", "*"):
                continue
            path = re.sub(r"\{model\}", "fake", resource.canonical)
            path = re.sub(r"\{target\}", "fake:generateContent", path)
            path = re.sub(r"\{cache_id\}", "pfx-nope", path)
            path = path.replace("{tail}", "nothing")
            out.append((route.method, re.sub(r"\{prefix_id\}", "pfx-nope", path)))
    return sorted(set(out))


def _check_refused(url: str, routes: list[tuple[str, str]]) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        for method, path in routes:
            for headers in NO_KEYS:
                body = b"{not json" if method == "POST" else None
                r = http.request(method, path, content=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                message = r.json()["error"]["message"]
                # Gemini's shape (/v1beta, /v1/models/x:method; the models to a Google client)
                google = path.startswith("/v1/models") and "x-goog-api-key" in headers
                if is_gemini_path(path) or google:
                    assert r.json()["error"]["status"] == "UNAUTHENTICATED", r.text
                    # the header Google's clients send
                    if "incorrect" not in message:
                        assert "'x-goog-api-key: <key>'" in message, message
                elif path.startswith("/v1/messages"):
                    assert r.json()["type"] == "error", r.text
                    assert r.json()["error"]["type"] == "authentication_error", r.text
                    # the header Anthropic's clients send, not only OpenAI's
                    if "incorrect" not in message:
                        assert "'x-api-key: <key>'" in message, message
                else:
                    assert r.json()["error"]["code"] == "invalid_api_key", r.text
                    assert "x-api-key" not in message, message
            ok = http.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code != 401, (method, path, ok.text)


EXPECTED_LOCAL = {
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize", "/v1/models",
    "/v1/models/fake", "/v1/prefixes", "/v1/prefixes/pfx-nope",
    "/v1beta/models", "/v1beta/models/fake:generateContent", "/v1beta/cachedContents",
    "/v1beta/cachedContents/pfx-nope", "/v1/models/fake:generateContent",
}  # fmt: skip


@pytest.mark.parametrize("loaded", [True, False])
def test_every_local_route_checks_the_key_first(serve_fake, tmp_path, loaded):
    settings = GatewaySettings(model_name="fake", keys_file=_keys(tmp_path))
    if loaded:
        srv, _ = serve_fake(settings)
        app = srv.app
        _check_refused(srv.url, _routes(app))
    else:  # the model loading: 401 before 503 model_not_ready
        with BackgroundServer(lambda: create_app(None, settings)) as srv:
            _check_refused(srv.url, _routes(srv.app))
            app = srv.app
    assert {p for _, p in _routes(app)} == EXPECTED_LOCAL


def test_every_proxy_route_checks_the_key_first(serve_fake, tmp_path):
    """The relayed routes (``/v1/responses``, ``/tokenize``, ...) too."""
    upstream, _ = serve_fake(GatewaySettings(model_name="fake"))
    settings = GatewaySettings(keys_file=_keys(tmp_path))
    with BackgroundServer(lambda: create_proxy_app([upstream.url], settings)) as gw:
        routes = _routes(gw.app)
        assert {p for _, p in routes} == EXPECTED_LOCAL
        _check_refused(gw.url, routes)
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(gw.url + "/v1/responses", json={}, headers=auth)  # relayed as a chat
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        r = httpx.post(gw.url + "/tokenize", json={}, headers=auth)  # relayed: the upstream's
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_open_routes_answer_without_a_key(serve_fake, tmp_path):
    srv, _ = serve_fake(GatewaySettings(model_name="fake", keys_file=_keys(tmp_path)))
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        for path in ("/health", "/ready", "/metrics"):
            assert http.get(path).status_code == 200, path
        assert http.get("/no/such/route").status_code == 404
        # a method the route does not serve: 405 before the key, as docs/serving.md says
        r = http.get("/tokenize")
        assert r.status_code == 405 and "POST" in r.headers["Allow"], r.text


def _check_query_key(url: str) -> None:
    """``?key=`` authenticates Gemini's model methods under ``/v1`` as under ``/v1beta``
    (google-genai's default API version is ``v1``); other routes do not read it."""
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    with httpx.Client(base_url=url, timeout=10) as http:
        for version in ("v1beta", "v1"):
            path = f"/{version}/models/fake:generateContent"
            r = http.post(path, params={"key": KEY}, json=body)
            assert r.status_code == 200, (path, r.text)  # was 401 under /v1
            r = http.post(path, params={"key": "wrong"}, json=body)
            assert r.status_code == 401, (path, r.text)
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        r = http.post("/v1/chat/completions", params={"key": KEY}, json=chat)
        assert r.status_code == 401, r.text


def test_query_key_on_gemini_v1_methods_local(serve_fake, tmp_path):
    srv, _ = serve_fake(GatewaySettings(model_name="fake", keys_file=_keys(tmp_path)))
    _check_query_key(srv.url)


def test_query_key_on_gemini_v1_methods_proxy(serve_fake, tmp_path):
    upstream, _ = serve_fake(GatewaySettings(model_name="fake"))
    settings = GatewaySettings(keys_file=_keys(tmp_path))
    with BackgroundServer(lambda: create_proxy_app([upstream.url], settings)) as gw:
        _check_query_key(gw.url)


def test_version_answers_every_caller_in_both_modes(serve_fake, tmp_path):
    """``GET /version`` as vLLM's: ``{"version": ...}`` (the installed prefixgate), open to a
    caller without a key like the other probes, and not counted as an API request."""
    from prefixgate.gateway.cli import version

    settings = GatewaySettings(model_name="fake", keys_file=_keys(tmp_path))
    local, _ = serve_fake(settings)
    proxy_settings = GatewaySettings(keys_file=_keys(tmp_path))
    with BackgroundServer(lambda: create_proxy_app([local.url], proxy_settings)) as gw:
        for url in (local.url, gw.url):
            with httpx.Client(base_url=url, timeout=10) as http:
                r = http.get("/version")
                assert r.status_code == 200, r.text
                assert r.json() == {"version": version()}
                metrics = http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
                assert 'route="other"' not in metrics.text
                assert http.post("/version").status_code == 405
