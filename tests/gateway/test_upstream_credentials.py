"""No upstream credential ever reaches a client (``gateway/proxy/redact.py``): an upstream's
401/403 to the gateway's own credential is a 502 ``upstream_auth_failed`` naming the upstream,
never its body; every other relayed error body (and stream error event) is rebuilt from its
four OpenAI fields with the credential scrubbed, in every spelling the gateway sent it."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.redact import REDACTED, secrets_of
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error

from examples.benchmarks.fault_upstream import FaultUpstream

KEY = "sk-upstream-secret-0123456789"
USER, PASSWORD = "svc", "hunter2-password"
BODY = {"model": "fault", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _spellings() -> list[str]:
    basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    return [KEY, PASSWORD, basic, f"{USER}:{PASSWORD}"]


def _assert_clean(text: str) -> None:
    for secret in _spellings():
        assert secret not in text, text


def _with_credential(url: str, how: str) -> tuple[str, GatewaySettings]:
    """The upstream URL and gateway settings that carry the credential ``how``: the
    ``upstream_api_key`` setting, or the URL's userinfo."""
    if how == "userinfo":
        return url.replace("http://", f"http://{USER}:{PASSWORD}@"), GatewaySettings()
    return url, GatewaySettings(upstream_api_key=KEY)


@pytest.mark.parametrize("mode", ["auth401", "auth403"])
@pytest.mark.parametrize("how", ["api_key", "userinfo"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_auth_refusal_is_a_502_naming_it_never_its_body(mode, how, stream):
    with FaultUpstream(mode) as up:
        url, settings = _with_credential(up.url, how)
        with BackgroundServer(lambda: create_proxy_app([url], settings)) as gw:
            r = httpx.post(
                gw.url + "/v1/chat/completions", json={**BODY, "stream": stream}, timeout=10
            )
            err = assert_openai_error(r, 502, "upstream_auth_failed")
            assert up.url in err["message"]  # names the upstream (its URL without userinfo)
            assert "Incorrect API key" not in r.text  # the upstream's body is never shown
            _assert_clean(r.text)
            assert up.auth is not None and (KEY in up.auth or "Basic" in up.auth)  # was sent
            _assert_clean(httpx.get(gw.url + "/ready", timeout=5).text)
            _assert_clean(httpx.get(gw.url + "/metrics", timeout=5).text)


def test_the_clients_own_key_refused_stays_a_401_without_the_body():
    with FaultUpstream("auth401") as up:
        with BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw:
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json=BODY,
                headers={"Authorization": "Bearer client-key-abc"},
                timeout=10,
            )
            err = assert_openai_error(r, 401, "invalid_api_key")
            assert up.url in err["message"] and "client-key-abc" not in r.text


def _quoting_upstream() -> web.Application:
    """Answers 400 (JSON) or, to a stream, an error event, each quoting the Authorization it
    got in its message, its code and an extra field."""

    async def chat(request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        error = {
            "message": f"bad request made with {auth} ({json.dumps(auth)})",
            "type": "invalid_request_error",
            "param": None,
            "code": f"code-{auth}",
            "debug": {"headers": dict(request.headers)},
        }
        if not (await request.json()).get("stream"):
            return web.json_response({"error": error}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda r: web.json_response({}))
    return app


@pytest.mark.parametrize("how", ["api_key", "userinfo"])
def test_every_relayed_error_is_scrubbed_of_the_credential(how):
    with BackgroundServer(_quoting_upstream) as up:
        url, settings = _with_credential(up.url, how)
        with BackgroundServer(lambda: create_proxy_app([url], settings)) as gw:
            r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
            err = assert_openai_error(r, 400)
            assert REDACTED in err["message"] and REDACTED in err["code"], err
            assert "debug" not in r.text  # only the four fields are kept
            _assert_clean(r.text)
            with httpx.stream(
                "POST", gw.url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=10
            ) as s:
                text = s.read().decode()
            assert REDACTED in text
            _assert_clean(text)


def test_secrets_of_every_spelling():
    basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    found = secrets_of(KEY, basic)
    for s in (KEY, "Bearer " + KEY, basic, basic[6:], f"{USER}:{PASSWORD}", PASSWORD):
        assert s in found
    assert secrets_of(None, None) == ()
    assert "ab" not in secrets_of("ab", None)  # too short to scrub without garbling messages
