"""``GET /v1/models`` to an Anthropic client (it sends ``anthropic-version``): Anthropic's
``ModelInfo`` objects and list page, in both modes, read by the real ``anthropic`` client
(``wire.models_dialect``). Before, the OpenAI shape came back and the client read ``type``,
``display_name`` and ``created_at`` as None."""

from __future__ import annotations

import datetime as dt

import anthropic
import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.stub_upstream import StubServer


def _check_client(url: str, ids: list[str]) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    page = client.models.list()
    assert [m.id for m in page.data] == ids
    for m in page.data:
        assert m.type == "model" and m.display_name == m.id, m
        assert isinstance(m.created_at, dt.datetime), m
    assert page.has_more is False and page.first_id == ids[0] and page.last_id == ids[-1]
    got = client.models.retrieve(ids[-1])
    assert (got.type, got.id, got.display_name) == ("model", ids[-1], ids[-1])
    # the context length the OpenAI card says (max_model_len), not left None
    with httpx.Client(base_url=url, timeout=10) as http:
        card = http.get(f"/v1/models/{ids[-1]}").json()
    if "max_model_len" in card:
        assert got.max_input_tokens == card["max_model_len"], got
    else:
        assert got.max_input_tokens is None, got
    assert isinstance(got.created_at, dt.datetime)
    with pytest.raises(anthropic.NotFoundError) as info:  # Anthropic's error object
        client.models.retrieve("no-such-model")
    assert info.value.body["type"] == "error", info.value.body  # type: ignore[index]
    with httpx.Client(base_url=url, timeout=10) as http:
        headers = {"anthropic-version": "2023-06-01"}
        r = http.get("/v1/models", params={"limit": 1}, headers=headers)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [m["id"] for m in body["data"]] == ids[:1]
        assert body["has_more"] is (len(ids) > 1)
        r = http.get("/v1/models", params={"limit": 0}, headers=headers)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        # an OpenAI client still gets OpenAI's shape
        assert http.get("/v1/models").json()["object"] == "list"


def test_anthropic_client_lists_and_retrieves_models_local(serve_fake):
    srv, _ = serve_fake(GatewaySettings(model_name="fake"))
    _check_client(srv.url, ["fake"])


def test_anthropic_client_lists_and_retrieves_models_proxy():
    stub = StubServer(ttft_s=0.0, token_delay_s=0.0, models=("alpha", "beta")).start()
    try:
        app = lambda: create_proxy_app([stub.base_url], GatewaySettings())  # noqa: E731
        with BackgroundServer(app) as gw:
            _check_client(gw.url, ["alpha", "beta"])
    finally:
        stub.stop()


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_refused_key_on_the_models_routes_is_told_in_the_clients_dialect(serve_fake, mode):
    """The key is checked before the route's handler (``app.require_key``): its 401 took the
    OpenAI shape to an Anthropic and a Google client whatever the mode (the anthropic
    client's ``AuthenticationError.body`` had no ``type: error``)."""
    keyed = GatewaySettings(model_name="fake", api_keys=["sk-good"])
    stub = StubServer(ttft_s=0.0, token_delay_s=0.0, models=("fake",)).start()
    try:
        if mode == "local":
            url = serve_fake(keyed)[0].url
            _check_refusals(url)
        else:
            with BackgroundServer(lambda: create_proxy_app([stub.base_url], keyed)) as gw:
                _check_refusals(gw.url)
    finally:
        stub.stop()


def _check_refusals(url: str) -> None:
    for path in ("/v1/models", "/v1/models/fake"):
        r = httpx.get(url + path, headers={"x-api-key": "sk-bad", "anthropic-version": "1"})
        assert r.status_code == 401, r.text
        assert r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "authentication_error", r.text
        r = httpx.get(url + path, headers={"x-goog-api-key": "sk-bad"})
        assert r.status_code == 401, r.text
        assert r.json()["error"]["status"] == "UNAUTHENTICATED", r.text
        r = httpx.get(url + path, headers={"Authorization": "Bearer sk-bad"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.get(url + path, headers={"x-api-key": "sk-good", "anthropic-version": "1"})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("created", [1700000000000, 1e20, "2024-01-01", -1e12, float("nan"), None])
def test_a_card_whose_created_is_not_unix_seconds_is_listed_not_a_500(created):
    """An upstream's card with ``created`` in milliseconds, a string or out of range made an
    Anthropic client's model list a 500 ('year 55840 is out of range'); an OpenAI client got
    the card. Its ``created_at`` is the epoch then."""
    from prefixgate.gateway.wire.models_dialect import model_info

    info = model_info({"id": "m1", "object": "model", "created": created})
    assert info["created_at"].startswith("1970-01-01T00:00:00")
    assert model_info({"id": "m1", "created": 1700000000})["created_at"].startswith("2023-11-14")
