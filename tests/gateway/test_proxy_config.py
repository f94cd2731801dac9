"""The proxy's config file (``--config``, ``proxy.config``): checked at start-up with one-line
errors; a model list with deployments, aliases and fallbacks, credentials from the
environment or a file, and TLS with a private CA on every route and the health probe."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.config import load_config
from prefixgate.gateway.proxy.upstream import FAILURE_THRESHOLD
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error
from support.net import free_port
from support.stub_upstream import StubServer
from support.tls import TLSServer, make_ca_and_server_cert


def _write(tmp_path: Path, text: str, name: str = "proxy.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _chat(model: str, text: str = "hi", **kw: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **kw}


@pytest.fixture
def stubs():
    started: list[StubServer] = []

    def start(**kw: object) -> StubServer:
        stub = StubServer(ttft_s=0.0, token_delay_s=0.0, **kw).start()  # type: ignore[arg-type]
        started.append(stub)
        return stub

    yield start
    for s in started:
        s.stop()


_GOOD = """
[[models]]
name = "chat"
[[models.deployments]]
url = "http://127.0.0.1:9/v1"
"""


@pytest.mark.parametrize(
    "text, message",
    [
        ("models = []", "models must be a non-empty list"),
        ("[x]\n", "unknown top-level field 'x'"),
        ('[[models]]\nname = "a"\n', "models[0].deployments must be a non-empty list"),
        (_GOOD + 'colour = "red"\n', "models[0].deployments[0]: unknown field 'colour'"),
        (_GOOD.replace("http://127.0.0.1:9/v1", "ftp://x"), "deployments[0].url: upstream URL"),
        (_GOOD + 'dialect = "grpc"\n', "dialect: 'grpc' is not served"),
        (_GOOD + "weight = 0\n", "weight: must be a number > 0"),
        (_GOOD + "max_in_flight = -1\n", "max_in_flight: must be an integer >= 0"),
        (_GOOD + 'api_key_env = "PG_TEST_UNSET_VAR"\n', "PG_TEST_UNSET_VAR is not set"),
        (_GOOD + 'api_key_file = "nope.txt"\n', "api_key_file: no such file"),
        (_GOOD + 'tls = { verify = "no" }\n', "tls.verify: must be true or false"),
        (_GOOD + 'tls = { ca_bundle = "missing.pem" }\n', "tls.ca_bundle: no such file"),
        (_GOOD + 'tls = { ca_bundle = "proxy.toml" }\n', "tls.ca_bundle: not a CA bundle"),
        (_GOOD.replace('name = "chat"', 'name = "chat"\nfallbacks = ["gone"]'), "'gone' is not"),
        (_GOOD.replace('name = "chat"', 'name = "chat"\naliases = ["chat"]'), "given twice"),
        (_GOOD + _GOOD, "'chat' is given twice"),
        ("models = [", "not TOML"),
    ],
)
def test_config_errors_are_one_line_naming_the_field(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match="config .*proxy.toml: ") as err:
        load_config(path, env={})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_config_file_kinds(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.toml, \.yaml or \.yml"):
        load_config(_write(tmp_path, _GOOD, "proxy.json"))
    with pytest.raises(ValueError, match="cannot read it"):
        load_config(tmp_path / "absent.toml")
    yaml_text = "models:\n  - name: chat\n    deployments:\n      - url: http://127.0.0.1:9\n"
    config = load_config(_write(tmp_path, yaml_text, "proxy.yaml"))
    assert [u.url for u in config.upstreams()] == ["http://127.0.0.1:9"]


def test_fallback_alias_credentials_and_model_names(tmp_path, stubs):
    """A failing deployment (dead, then 503) costs no request: the next deployment serves it;
    a model whose only deployment answers 500 falls back to another model; an alias reaches
    its model's deployment under the upstream's own model id; each deployment gets its own
    credential (environment variable, file)."""
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    failing = stubs(name="failing", status=503)
    good = stubs(name="good", models=("llama-3-8b",))
    broken = stubs(name="broken", status=500)
    small = stubs(name="small", models=("qwen-small",))
    (tmp_path / "key.txt").write_text("file-key\n")
    path = _write(
        tmp_path,
        f"""
[[models]]
name = "chat"
aliases = ["gpt-4o-mini"]
[[models.deployments]]
url = "{down}"
[[models.deployments]]
url = "{failing.base_url}"
[[models.deployments]]
url = "{good.base_url}/v1"
model = "llama-3-8b"
api_key_env = "GOOD_KEY"
"""
        + _with_fallback(
            broken.base_url,
            small.base_url,
            names=("big", "small"),
            second_fields='model = "qwen-small"\napi_key_file = "key.txt"\n',
        ),
    )
    config = load_config(path, env={"GOOD_KEY": "env-key"})
    with (
        BackgroundServer(lambda: create_proxy_app(config, GatewaySettings())) as gw,
        httpx.Client(base_url=gw.url, timeout=10) as http,
    ):
        ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert ids == ["chat", "big", "small", "gpt-4o-mini"]
        failed = 0
        for i in range(10):
            model = "chat" if i % 2 else "gpt-4o-mini"
            r = http.post("/v1/chat/completions", json=_chat(model, f"q{i}", stream=i % 3 == 0))
            failed += r.status_code != 200
        assert failed == 0
        assert len(good.seen) == 10
        assert {b["model"] for b in good.seen} == {"llama-3-8b"}  # the upstream's own id
        assert {r["auth"] for r in good.records} == {"Bearer env-key"}
        assert len(failing.seen) <= FAILURE_THRESHOLD  # ejected at its third 503 in a row
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        for _ in range(3):
            out = client.chat.completions.create(
                model="big", messages=[{"role": "user", "content": "x"}]
            )
            assert out.choices[0].message.content == "ok"
        assert len(broken.seen) == 3 and len(small.seen) == 3  # tried, then the fallback
        assert {b["model"] for b in small.seen} == {"qwen-small"}
        assert {r["auth"] for r in small.records} == {"Bearer file-key"}
        r = http.post("/v1/chat/completions", json=_chat("llama-3-8b"))  # not a public name
        assert_openai_error(r, 404, code="model_not_found")
        for model in (None, 3):
            r = http.post("/v1/chat/completions", json=_chat(model))  # type: ignore[arg-type]
            assert_openai_error(r, 400, param="model")


def test_max_in_flight_sends_the_rest_to_other_deployments(tmp_path, stubs):
    slow = stubs(name="slow")
    slow.ttft_s = 0.5
    other = stubs(name="other")
    path = _write(
        tmp_path,
        f"""
[[models]]
name = "m"
[[models.deployments]]
url = "{slow.base_url}"
max_in_flight = 1
[[models.deployments]]
url = "{other.base_url}"
weight = 0.001
""",
    )
    config = load_config(path)
    with BackgroundServer(lambda: create_proxy_app(config, GatewaySettings())) as gw:
        done: list[int] = []

        def hold() -> None:
            done.append(
                httpx.post(
                    gw.url + "/v1/chat/completions", json=_chat("m", stream=True), timeout=10
                ).status_code
            )

        t = threading.Thread(target=hold)
        t.start()
        deadline = time.monotonic() + 10
        while slow._in_flight == 0:
            assert time.monotonic() < deadline, "the held stream never reached slow"
            time.sleep(0.01)
        for i in range(3):  # slow is full: all to the other one, light as it is
            r = httpx.post(gw.url + "/v1/chat/completions", json=_chat("m", f"x{i}"), timeout=10)
            assert r.json()["upstream"] == "other"
        t.join()
        assert done == [200] and slow.max_in_flight == 1


def _tls_config(tmp_path: Path, url: str, tls: str) -> Path:
    return _write(
        tmp_path,
        f"""
[[models]]
name = "secure"
[[models.deployments]]
url = "{url}"
{tls}
""",
    )


def test_tls_with_a_private_ca_on_every_route_and_the_probe(tmp_path):
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    stub = StubServer(name="tls-stub", models=("secure",), ttft_s=0.0, token_delay_s=0.0)
    with TLSServer(stub.app, cert, key) as up:
        trusted = load_config(_tls_config(tmp_path, up.url, 'tls = { ca_bundle = "ca.pem" }'))
        with (
            BackgroundServer(lambda: create_proxy_app(trusted, GatewaySettings())) as gw,
            httpx.Client(base_url=gw.url, timeout=10) as http,
        ):
            ready = http.get("/ready")
            assert ready.status_code == 200, ready.text  # the probe trusted the CA
            (u,) = ready.json()["upstreams"]
            assert u["healthy"] and u["cache_salt"] is False  # /v1/models read over TLS
            assert http.get("/v1/models").json()["data"][0]["id"] == "secure"
            assert http.post("/v1/chat/completions", json=_chat("secure")).status_code == 200
            r = http.post("/v1/chat/completions", json=_chat("secure", stream=True))
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            r = http.post("/v1/completions", json={"model": "secure", "prompt": "x"})
            assert r.status_code == 200
        assert len(stub.seen) == 3
        # The system's CAs do not know it: the probe fails, the upstream is down, no request
        # reaches it.
        default = load_config(_tls_config(tmp_path, up.url, ""))
        with (
            BackgroundServer(lambda: create_proxy_app(default, GatewaySettings())) as gw,
            httpx.Client(base_url=gw.url, timeout=10) as http,
        ):
            assert http.get("/ready").status_code == 503
            r = http.post("/v1/chat/completions", json=_chat("secure"))
            assert_openai_error(r, 503, code="upstream_unavailable")
        assert len(stub.seen) == 3
        # Verification off: only by the explicit flag.
        off = load_config(_tls_config(tmp_path, up.url, "tls = { verify = false }"))
        with (
            BackgroundServer(lambda: create_proxy_app(off, GatewaySettings())) as gw,
            httpx.Client(base_url=gw.url, timeout=10) as http,
        ):
            assert http.post("/v1/chat/completions", json=_chat("secure")).status_code == 200
        assert len(stub.seen) == 4
    assert json.loads(json.dumps(stub.seen[-1]))["model"] == "secure"


def _answering(status: int = 200, delay_s: float = 0.0, error: dict | None = None):
    """A minimal upstream: every chat waits ``delay_s`` before its answer (``error`` with
    ``status``, else a completion naming the model)."""
    import asyncio

    from aiohttp import web

    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        await asyncio.sleep(delay_s)
        if error is not None:
            return web.json_response({"error": error}, status=status)
        message = {"role": "assistant", "content": "from " + body["model"]}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [choice]})

    def make() -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        return app

    return make, seen


def _with_fallback(
    first_url: str,
    second_url: str,
    names: tuple[str, str] = ("primary", "secondary"),
    second_fields: str = "",
) -> str:
    """The TOML of two models (``names``) on one deployment each, the first falling back to
    the second; ``second_fields``: more lines of the second's deployment."""
    first, second = names
    return f"""
[[models]]
name = "{first}"
fallbacks = ["{second}"]
[[models.deployments]]
url = "{first_url}"
[[models]]
name = "{second}"
[[models.deployments]]
url = "{second_url}"
{second_fields}"""


def _two_models(tmp_path: Path, first: str, second: str) -> Path:
    return _write(tmp_path, _with_fallback(first, second))


def test_fallback_on_timeout_and_on_a_too_long_prompt(tmp_path):
    slow, slow_seen = _answering(delay_s=5.0)
    error = {"message": "too long", "type": "invalid_request_error", "param": "messages"}
    long, long_seen = _answering(400, error={**error, "code": "context_length_exceeded"})
    spare, spare_seen = _answering()
    settings = GatewaySettings(upstream_timeout_s=0.3)
    with BackgroundServer(slow) as a, BackgroundServer(long) as b, BackgroundServer(spare) as c:
        for first, seen in ((a, slow_seen), (b, long_seen)):
            config = load_config(_two_models(tmp_path, first.url, c.url))
            with (
                BackgroundServer(lambda: create_proxy_app(config, settings)) as gw,  # noqa: B023
                httpx.Client(base_url=gw.url, timeout=10) as http,
            ):
                r = http.post("/v1/chat/completions", json=_chat("primary"))
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == "from secondary"
                assert len(seen) == 1
        assert len(spare_seen) == 2
        # Without a fallback a too-long prompt is the upstream's own 400.
        solo = _write(
            tmp_path, f'[[models]]\nname = "solo"\n[[models.deployments]]\nurl = "{b.url}"\n'
        )
        config = load_config(solo)
        with (
            BackgroundServer(lambda: create_proxy_app(config, settings)) as gw,
            httpx.Client(base_url=gw.url, timeout=10) as http,
        ):
            r = http.post("/v1/chat/completions", json=_chat("solo"))
            assert_openai_error(r, 400, code="context_length_exceeded")
            assert len(long_seen) == 2 and len(spare_seen) == 2


def test_a_429_back_soon_is_not_worth_a_fallback(tmp_path, stubs):
    soon = stubs(name="soon", fail_every=1, retry_after="1")
    later = stubs(name="later", fail_every=1, retry_after="120")
    spare = stubs(name="spare", models=("secondary",))
    for limited, answered in ((soon, 429), (later, 200)):
        config = load_config(_two_models(tmp_path, limited.base_url, spare.base_url))
        with (
            BackgroundServer(lambda: create_proxy_app(config, GatewaySettings())) as gw,  # noqa: B023
            httpx.Client(base_url=gw.url, timeout=10) as http,
        ):
            r = http.post("/v1/chat/completions", json=_chat("primary"))
            assert r.status_code == answered, r.text
            if answered == 429:
                assert r.headers["Retry-After"] == "1"
    assert len(spare.seen) == 1


def test_prefixgate_serve_refuses_a_bad_config_in_one_line(tmp_path):
    import subprocess
    import sys

    bad = _write(tmp_path, _GOOD + 'dialect = "smoke-signals"\n')
    argv = [sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--port", "0"]
    cases = [
        (["--config", str(bad)], "deployments[0].dialect: 'smoke-signals' is not served"),
        (["--config", str(bad), "--upstream", "http://x:1"], "give --config or --upstream"),
    ]
    for extra, message in cases:
        done = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        (line,) = [ln for ln in done.stderr.splitlines() if "bad option" in ln]
        assert message in line


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", _chat("primary")),
        (
            "/v1/messages",
            {"model": "primary", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        ),
        (
            "/v1beta/models/primary:generateContent",
            {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
        ),
    ],
)
def test_every_dialect_takes_the_fallback_of_a_dead_model(tmp_path, path, body):
    """The config's fallbacks hold for every dialect's relay (one attempt loop): Gemini's
    routes answered 503 'no healthy upstream' where chat and Messages fell back (a new user's
    trial)."""
    spare, spare_seen = _answering()
    with BackgroundServer(spare) as c:
        dead = f"http://127.0.0.1:{free_port()}"
        config = load_config(_two_models(tmp_path, dead, c.url))
        with (
            BackgroundServer(lambda: create_proxy_app(config, GatewaySettings())) as gw,
            httpx.Client(base_url=gw.url, timeout=20) as http,
        ):
            r = http.post(path, json=body)
            assert r.status_code == 200, r.text
            assert len(spare_seen) == 1
