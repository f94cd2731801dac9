"""An open proxy forwards the client's credential, whichever header or parameter the client's
dialect sends it in, to the upstream in the upstream's dialect's header (``Authorization:
Bearer`` to an OpenAI-compatible upstream, ``x-api-key`` to an Anthropic deployment); a
``?key=`` never travels in the upstream's URL (``proxy.routes.upstream_credential``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.config import load_config
from prefixgate.gateway.settings import GatewaySettings
from support.anthropic_stub import AnthropicStub
from support.chat_stub import ChatStub
from support.fake_engine import FakeEngine, assert_idle_and_whole
from support.net import free_port

KEY = "sk-good"
HI = [{"role": "user", "content": "hi"}]
HI_BLOCKS = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
# the route of each client dialect, its body for model ``m``
ROUTES = {
    "openai": lambda m: ("/v1/chat/completions", {"model": m, "messages": HI, "max_tokens": 4}),
    "anthropic": lambda m: ("/v1/messages", {"model": m, "messages": HI_BLOCKS, "max_tokens": 4}),
    "gemini": lambda m: (
        f"/v1beta/models/{m}:generateContent",
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
    ),
    "gemini_v1": lambda m: (  # google-genai's default API version
        f"/v1/models/{m}:generateContent",
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
    ),
}
# how each dialect's clients send a key (``?key=`` is Gemini's REST form only)
SENDS = [
    (dialect, how)
    for dialect in ROUTES
    for how in ("authorization", "x-api-key", "x-goog-api-key", "query")
    if how != "query" or dialect.startswith("gemini")
]


def _send(how: str) -> tuple[dict[str, str], dict[str, str]]:
    """The headers and query parameters carrying ``KEY`` as ``how``."""
    if how == "authorization":
        return {"Authorization": f"Bearer {KEY}"}, {}
    if how == "query":
        return {}, {"key": KEY}
    return {how: KEY}, {}


@pytest.fixture(scope="module")
def _keyed():
    seen: list[str] = []
    engine = FakeEngine()

    async def note(request: web.Request, response: web.StreamResponse) -> None:
        seen.append(request.path_qs)

    def make() -> web.Application:
        app = create_app(engine, GatewaySettings(model_name="fake", api_keys=[KEY]))
        app.on_response_prepare.append(note)
        return app

    with BackgroundServer(make) as up:
        with BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw:
            yield up, engine, gw, seen


@pytest.fixture
def keyed_upstream(_keyed):
    """A proxy before a local-mode gateway keyed ``sk-good`` (model ``fake``); ``seen``: the
    path and query of every request that gateway got. Each test ends with its engine idle
    and its pool whole."""
    up, engine, gw, seen = _keyed
    yield gw, seen
    assert_idle_and_whole(up, engine)


@pytest.mark.parametrize(("dialect", "how"), SENDS)
def test_an_open_proxy_forwards_the_clients_key_from_every_dialects_header(
    keyed_upstream, dialect, how
):
    """Was: only ``Authorization`` (every route) and ``x-api-key`` (``/v1/messages``) reached
    the upstream; ``x-goog-api-key``, ``?key=`` and ``x-api-key`` on chat or Gemini's routes
    were 401 "upstream refused the request's credentials"."""
    gw, seen = keyed_upstream
    path, body = ROUTES[dialect]("fake")
    headers, params = _send(how)
    seen.clear()
    r = httpx.post(gw.url + path, json=body, headers=headers, params=params, timeout=10)
    assert r.status_code == 200, r.text
    assert seen and all(KEY not in p for p in seen), seen  # never in the upstream's URL
    # and a wrong key is still the upstream's refusal, told as the client's
    if how == "query":
        params = {"key": "sk-bad"}
    else:
        headers = {k: v.replace(KEY, "sk-bad") for k, v in headers.items()}
    r = httpx.post(gw.url + path, json=body, headers=headers, params=params, timeout=10)
    assert r.status_code == 401, r.text


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize("how", ["authorization", "x-api-key", "x-goog-api-key"])
def test_an_open_proxy_gives_an_anthropic_deployment_the_clients_key_as_x_api_key(
    tmp_path: Path, dialect, how
):
    claude = AnthropicStub()
    with BackgroundServer(claude.app) as up:
        path = tmp_path / "proxy.toml"
        path.write_text(
            f'[[models]]\nname = "claude"\n[[models.deployments]]\nurl = "{up.url}"\n'
            'dialect = "anthropic"\nmodel = "claude-sonnet-4-5"\n'
        )
        cfg = load_config(path, env={})
        with BackgroundServer(lambda: create_proxy_app(cfg, GatewaySettings())) as gw:
            route, body = ROUTES[dialect]("claude")
            headers, _ = _send(how)
            r = httpx.post(gw.url + route, json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    sent = claude.headers[-1]
    assert sent["x-api-key"] == KEY and "Authorization" not in sent, sent


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_read_in_any_case_everywhere(tmp_path: Path, scheme):
    """RFC 7235: the auth scheme is case-insensitive. Was: the key ring took ``bearer <key>``,
    but an open proxy sent an Anthropic deployment ``x-api-key: bearer <key>`` and an
    OpenAI-compatible one the header as sent (vLLM compares ``Bearer <key>`` exactly)."""
    claude = AnthropicStub()
    openai = ChatStub(name="fake")

    sent = {"Authorization": f"{scheme} {KEY}"}
    with (
        BackgroundServer(claude.app) as anthropic_up,
        BackgroundServer(openai.app) as openai_up,
    ):
        path = tmp_path / "proxy.toml"
        path.write_text(
            f'[[models]]\nname = "claude"\n[[models.deployments]]\nurl = "{anthropic_up.url}"\n'
            'dialect = "anthropic"\nmodel = "claude-sonnet-4-5"\n'
            f'[[models]]\nname = "fake"\n[[models.deployments]]\nurl = "{openai_up.url}"\n'
        )
        cfg = load_config(path, env={})
        with BackgroundServer(lambda: create_proxy_app(cfg, GatewaySettings())) as gw:
            for model in ("claude", "fake"):
                route, body = ROUTES["openai"](model)
                r = httpx.post(gw.url + route, json=body, headers=sent, timeout=10)
                assert r.status_code == 200, r.text
        keyed = GatewaySettings(api_keys=[KEY])
        with BackgroundServer(lambda: create_proxy_app([openai_up.url], keyed)) as gw:
            route, body = ROUTES["openai"]("fake")
            r = httpx.post(gw.url + route, json=body, headers=sent, timeout=10)
            assert r.status_code == 200, r.text  # the gateway's own keys: the same reading
    assert claude.headers[-1]["x-api-key"] == KEY, claude.headers[-1]
    assert openai.headers[0]["Authorization"] == f"Bearer {KEY}", openai.headers


@pytest.mark.parametrize(
    ("path", "how"),
    [
        ("/v1beta/models", "x-goog-api-key"),
        ("/v1beta/models", "query"),
        ("/v1/models", "x-goog-api-key"),  # google-genai's default API version
        ("/v1/models", "query"),  # Google's REST examples
    ],
)
def test_an_open_proxy_lists_a_keyed_upstreams_models_to_a_google_client(keyed_upstream, path, how):
    """An open proxy knows no model of an upstream that wants the client's key to list them:
    Gemini's list and get ask that upstream with the client's key, as the OpenAI list does.
    Was: ``{"models": []}`` with a 200 (google-genai's ``models.list()`` == []), any name a
    served ``Model`` with a 200, and a wrong key a 200 too."""
    gw, seen = keyed_upstream
    headers, params = _send(how)
    seen.clear()
    r = httpx.get(gw.url + path, headers=headers, params=params, timeout=10)
    assert r.status_code == 200, r.text
    assert [m["name"] for m in r.json()["models"]] == ["models/fake"], r.text
    assert isinstance(r.json()["models"][0]["inputTokenLimit"], int), r.text  # the upstream's
    assert seen and all(KEY not in p for p in seen), seen  # never in the upstream's URL
    r = httpx.get(f"{gw.url}{path}/fake", headers=headers, params=params, timeout=10)
    assert r.status_code == 200 and r.json()["name"] == "models/fake", r.text
    r = httpx.get(f"{gw.url}{path}/no-such-model", headers=headers, params=params, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND", r.text
    bad_headers = {k: "sk-bad" for k in headers}
    bad_params = {k: "sk-bad" for k in params}
    for url in (gw.url + path, f"{gw.url}{path}/fake"):
        r = httpx.get(url, headers=bad_headers, params=bad_params, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["status"] == "UNAUTHENTICATED", r.text


def test_a_proxy_with_no_upstream_up_says_so_to_a_google_client():
    """Was: ``{"models": []}`` and any name a served ``Model``, with a 200, while the OpenAI
    list said 503 "no healthy upstream"."""
    down = f"http://127.0.0.1:{free_port()}"
    with BackgroundServer(lambda: create_proxy_app([down], GatewaySettings())) as gw:
        for path in ("/v1beta/models", "/v1beta/models/fake", "/v1/models"):
            r = httpx.get(gw.url + path, headers={"x-goog-api-key": KEY}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["status"] == "UNAVAILABLE", r.text
