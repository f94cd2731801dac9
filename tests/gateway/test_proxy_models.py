"""Upstream mode in front of several models: each upstream's ``GET /v1/models`` decides which
requests it gets, ``/v1/models`` lists the union, an unknown model is the gateway's own 404,
an upstream whose models change is followed, and an upstream's 429 with ``Retry-After``
takes it out of rotation for that long (``proxy.upstream``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error
from support.stub_upstream import StubServer


@pytest.fixture
def stubs() -> Iterator[list[StubServer]]:
    started: list[StubServer] = []
    yield started
    for s in started:
        s.stop()


def _start(stubs: list[StubServer], **kw: object) -> StubServer:
    stub = StubServer(ttft_s=0.0, token_delay_s=0.0, **kw).start()  # type: ignore[arg-type]
    stubs.append(stub)
    return stub


def _chat(model: str, text: str = "hi", **kw: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **kw}


def _wait(cond, what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_two_upstreams_with_different_models_each_get_only_their_model(stubs):
    a = _start(stubs, name="a", models=("alpha",))
    b = _start(stubs, name="b", models=("beta", "beta-large"))
    app = lambda: create_proxy_app([a.base_url, b.base_url], GatewaySettings())  # noqa: E731
    with BackgroundServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as http:
        listed = http.get("/v1/models").json()
        assert [m["id"] for m in listed["data"]] == ["alpha", "beta", "beta-large"]
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        assert {m.id for m in client.models.list()} == {"alpha", "beta", "beta-large"}
        assert client.models.retrieve("beta").id == "beta"
        for i in range(12):
            model = ("alpha", "beta", "beta-large")[i % 3]
            stream = i % 2 == 0
            r = http.post("/v1/chat/completions", json=_chat(model, f"q{i}", stream=stream))
            assert r.status_code == 200, r.text
        assert len(a.seen) == 4 and len(b.seen) == 8
        assert {s["model"] for s in a.seen} == {"alpha"}
        assert {s["model"] for s in b.seen} == {"beta", "beta-large"}
        # A model nobody serves: the gateway's own 404, sent to no upstream.
        r = http.post("/v1/chat/completions", json=_chat("gamma"))
        assert_openai_error(r, 404, param="model", code="model_not_found")
        r = http.post("/v1/completions", json={"model": "gamma", "prompt": "x"})
        assert_openai_error(r, 404, param="model", code="model_not_found")
        assert_openai_error(http.get("/v1/models/gamma"), 404, code="model_not_found")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="gamma", messages=[{"role": "user", "content": "x"}]
            )
        assert len(a.seen) + len(b.seen) == 12
        ready = http.get("/ready").json()["upstreams"]
        assert [u["models"] for u in ready] == [["alpha"], ["beta", "beta-large"]]


def test_an_upstream_whose_models_change_is_followed(stubs):
    a = _start(stubs, name="a", models=("alpha",))
    b = _start(stubs, name="b", models=("beta",))
    settings = GatewaySettings(health_interval_s=0.05)
    with (
        BackgroundServer(lambda: create_proxy_app([a.base_url, b.base_url], settings)) as gw,
        httpx.Client(base_url=gw.url, timeout=10) as http,
    ):
        assert http.post("/v1/chat/completions", json=_chat("gamma")).status_code == 404
        b.models = ("beta", "gamma")  # b loads another model
        a.models = ("delta",)  # a serves another one instead of its own
        _wait(
            lambda: (
                {m["id"] for m in http.get("/v1/models").json()["data"]}
                == {"beta", "gamma", "delta"}
            ),
            "the gateway never saw the new models",
        )
        assert http.post("/v1/chat/completions", json=_chat("gamma")).status_code == 200
        assert b.seen[-1]["model"] == "gamma"
        r = http.post("/v1/chat/completions", json=_chat("alpha"))
        assert_openai_error(r, 404, code="model_not_found")
        assert a.seen == []


def test_cache_aware_affinity_holds_per_model(stubs):
    """Two upstreams per model: a system prompt keeps to one upstream of its model, and the
    same prompt on the other model keeps to one of that model's."""
    pool = [_start(stubs, name=f"{m}{i}", models=(m,)) for m in ("alpha", "beta") for i in (0, 1)]
    app = lambda: create_proxy_app([s.base_url for s in pool], GatewaySettings())  # noqa: E731
    with BackgroundServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as http:
        system = "You are a careful assistant answering about tides. " * 4
        for model in ("alpha", "beta"):
            homes = set()
            for i in range(4):
                body = {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"q{i}"},
                    ],
                }
                homes.add(http.post("/v1/chat/completions", json=body).json()["upstream"])
            assert len(homes) == 1 and homes.pop().startswith(model)


def test_a_429_with_retry_after_takes_the_upstream_out_for_that_long(stubs):
    limited = _start(stubs, name="limited", models=("alpha",), fail_every=1, retry_after="30")
    other = _start(stubs, name="other", models=("alpha",))
    app = lambda: create_proxy_app([limited.base_url, other.base_url], GatewaySettings())  # noqa: E731
    with BackgroundServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as http:
        for i in range(8):  # round robin would send half to `limited`
            r = http.post("/v1/chat/completions", json=_chat("alpha", f"question {i} " * 20))
            assert r.status_code == 200, r.text  # 0 failed requests
            assert r.json()["upstream"] == "other"
        assert len(limited.seen) <= 1  # asked once at most, then left out for 30 s
        ups = {u.url: u for u in gw.app[PROXY].router.upstreams}
        assert ups[limited.base_url].healthy  # rate limited is not down
        ready = {u["url"]: u for u in http.get("/ready").json()["upstreams"]}
        assert 25 < ready[limited.base_url]["rate_limited_s"] <= 30
        # Now the other one is limited too (7 s): none can serve, the client is told when
        # the first of them can (the soonest), not the upstream's own 30 s.
        other.fail_every, other.retry_after = 1, "7"
        r = http.post("/v1/chat/completions", json=_chat("alpha", "again"))
        assert_openai_error(r, 429)
        assert r.headers["Retry-After"] == "7"


def test_prefixgate_serve_with_two_upstream_flags(stubs, tmp_path):
    """As a new user runs it: ``prefixgate serve --upstream A --upstream B`` with different
    models: the union listed, every request answered by a server of its model, unknown 404."""
    import os
    import subprocess
    import sys

    from support.net import free_port

    a = _start(stubs, name="a", models=("alpha",))
    b = _start(stubs, name="b", models=("beta",))
    port = free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--upstream", a.base_url, "--upstream", b.base_url + "/v1", "--no-access-log"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        _wait(ready, "the gateway did not start", limit_s=60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == ["alpha", "beta"]
        for i in range(6):
            model = ("alpha", "beta")[i % 2]
            out = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"q{i}"}]
            )
            assert out.model == model
        assert {s["model"] for s in a.seen} == {"alpha"} and len(a.seen) == 3
        assert {s["model"] for s in b.seen} == {"beta"} and len(b.seen) == 3
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(
                model="gamma", messages=[{"role": "user", "content": "x"}]
            )
        assert err.value.code == "model_not_found"
        assert "serve different models" in log.read_text()  # said at start-up
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_empty_model_is_answered_as_a_missing_one_in_both_modes(serve_fake):
    """``model: ""`` is the field's absence (empty is absent): a 400 naming ``model`` from the
    local gateway and through the proxy in front of it, not a proxy's 404 for a model ''."""
    import httpx
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings

    local, _ = serve_fake()
    body = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with BackgroundServer(lambda: create_proxy_app([local.url], GatewaySettings())) as proxy:
        answers = [
            httpx.post(u + "/v1/chat/completions", json=body) for u in (local.url, proxy.url)
        ]
    for r in answers:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model", r.text
