"""What a proxy names as its models: an unknown model's 404 lists the served ones, as local
mode's does, in every dialect; with discovered upstreams and with a config's model list. And
every dialect's answer names the model as the client sent it (a config's alias or name),
never the deployment's own id."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.config import load_config
from prefixgate.gateway.settings import GatewaySettings
from support.anthropic_stub import AnthropicStub
from support.fake_engine import FakeEngine, assert_idle_and_whole

HI = [{"role": "user", "content": "hi"}]


def _ask(dialect: str, model: str) -> tuple[str, dict]:
    """The route and body of a request for ``model`` in ``dialect``."""
    return {
        "chat": ("/v1/chat/completions", {"model": model, "messages": HI, "max_tokens": 2}),
        "completions": ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}),
        "messages": ("/v1/messages", {"model": model, "messages": HI, "max_tokens": 2}),
        "gemini": (
            f"/v1beta/models/{model}:generateContent",
            {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
        ),
    }[dialect]


def _message(r: httpx.Response) -> str:
    error = r.json()["error"]
    return error["message"]


@pytest.fixture(scope="module")
def _local():
    engine = FakeEngine()
    with BackgroundServer(lambda: create_app(engine, GatewaySettings(model_name="fake"))) as a:
        yield a, engine


@pytest.fixture
def local(_local):
    """A local-mode gateway's URL (model ``fake``); each test ends with its engine idle and
    its pool whole."""
    srv, engine = _local
    yield srv.url
    assert_idle_and_whole(srv, engine)


@pytest.mark.parametrize("dialect", ["chat", "completions", "messages", "gemini"])
def test_an_unknown_models_404_lists_the_served_models_in_both_modes(local, dialect):
    """Was: the proxy's ``model_not_found`` said only "the model 'nope' does not exist";
    local mode's names what it serves."""
    path, body = _ask(dialect, "nope")
    with BackgroundServer(lambda: create_proxy_app([local], GatewaySettings())) as p:
        proxy = httpx.post(p.url + path, json=body, timeout=10)
    direct = httpx.post(local + path, json=body, timeout=10)
    assert proxy.status_code == direct.status_code == 404, (proxy.text, direct.text)
    assert "this server serves" in _message(direct) and "fake" in _message(direct)
    assert "this server serves" in _message(proxy) and "fake" in _message(proxy), proxy.text
    assert _message(proxy) == _message(direct)  # Gemini's words name models/<id> in both


def test_a_configs_unknown_model_lists_its_names_and_aliases(local, tmp_path: Path):
    path = tmp_path / "proxy.toml"
    path.write_text(
        '[[models]]\nname = "chat"\naliases = ["gpt-4o-mini"]\n'
        f'[[models.deployments]]\nurl = "{local}"\nmodel = "fake"\n'
    )
    cfg = load_config(path, env={})
    with BackgroundServer(lambda: create_proxy_app(cfg, GatewaySettings())) as p:
        r = httpx.post(p.url + "/v1/chat/completions", json=_ask("chat", "nope")[1], timeout=10)
    assert r.status_code == 404
    assert (
        _message(r) == "the model 'nope' does not exist; this server serves 'chat', 'gpt-4o-mini'"
    )


def _answered_model(dialect: str, r: httpx.Response, stream: bool) -> set[str]:
    """Every model name an answer (its events, for a stream) says."""
    key = "modelVersion" if dialect == "gemini" else "model"
    if not stream:
        return {r.json()[key]}
    names = set()
    for line in r.text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            obj = json.loads(line[5:])
            obj = obj.get("message", obj) if dialect == "messages" else obj
            if key in obj:
                names.add(obj[key])
    return names


@pytest.mark.parametrize("sent", ["chat", "gpt-4o-mini"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dialect", ["chat", "completions", "messages", "gemini"])
def test_every_dialect_answers_with_the_model_name_the_client_sent(
    local, tmp_path: Path, dialect, stream, sent
):
    """Was: chat answers said the deployment's id (``fake``), /v1/messages the name sent.
    As LiteLLM's proxy (since its PR #19943): the answer names the model the client asked
    for, alias or name, whatever id the deployment has."""
    path = tmp_path / "proxy.toml"
    path.write_text(
        '[[models]]\nname = "chat"\naliases = ["gpt-4o-mini"]\n'
        f'[[models.deployments]]\nurl = "{local}"\nmodel = "fake"\n'
    )
    cfg = load_config(path, env={})
    route, body = _ask(dialect, sent)
    if stream:
        if dialect == "gemini":
            route = route.replace(":generateContent", ":streamGenerateContent?alt=sse")
        else:
            body = {**body, "stream": True}
    with BackgroundServer(lambda: create_proxy_app(cfg, GatewaySettings())) as p:
        r = httpx.post(p.url + route, json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert _answered_model(dialect, r, stream) == {sent}, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_on_an_anthropic_deployment_answers_with_the_alias_sent(tmp_path: Path, stream):
    claude = AnthropicStub()
    with BackgroundServer(claude.app) as up:
        path = tmp_path / "proxy.toml"
        path.write_text(
            '[[models]]\nname = "claude"\naliases = ["sonnet"]\n'
            f'[[models.deployments]]\nurl = "{up.url}"\ndialect = "anthropic"\n'
            'model = "claude-sonnet-4-5"\n'
        )
        cfg = load_config(path, env={})
        with BackgroundServer(lambda: create_proxy_app(cfg, GatewaySettings())) as p:
            _, body = _ask("chat", "sonnet")
            r = httpx.post(
                p.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=10
            )
    assert r.status_code == 200, r.text
    assert _answered_model("chat", r, stream) == {"sonnet"}, r.text
