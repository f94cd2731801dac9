"""What a proxy names as its models: an unknown model's 404 lists the served ones, as local
mode's does, in every dialect; with discovered upstreams and with a config's model list."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.config import load_config
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import FakeEngine

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
def local():
    with BackgroundServer(
        lambda: create_app(FakeEngine(), GatewaySettings(model_name="fake"))
    ) as a:
        yield a.url


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
    if dialect != "gemini":  # Gemini's words name models/<id> in local mode
        assert _message(proxy) == _message(direct)


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
