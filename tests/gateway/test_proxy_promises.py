"""A promise holds across proxy gateways: an engine gateway's 429 whose ``Retry-After`` it
promised a place for (``x-prefixgate-promise-ms``) is relayed to the client at once, not moved
to another upstream, and the client's retry of the same request, through another proxy
gateway on the same shared state (a real ``redis-server``), goes back to the upstream that
promised (``proxy.attempts.each_upstream``, ``UpstreamRouter.pick``'s ``promised``). Without
the header the old behaviour holds: the 429 moves the request to the next upstream.

The upstreams are prefixgate gateways on the fake engine: a predicted first token of 2.3 s
against a budget of 2,000 ms is a promised ``ttft_budget_exceeded`` 429 of about 300 ms
(``admission._check_budget``)."""

from __future__ import annotations

import time

import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.admission_wait import PROMISE_HEADER
from prefixgate.gateway.tenancy.ttft_budget import BUDGET_HEADER
from support.chat_upstream import chat_app

BUDGET = {BUDGET_HEADER: "2000"}

# the same request in each dialect the proxy relays (path, body)
DIALECTS = {
    "chat": ("/v1/chat/completions", lambda text: _chat(text)),
    "completions": (
        "/v1/completions",
        lambda text: {"model": "fake", "prompt": text, "max_tokens": 3},
    ),
    "messages": (
        "/v1/messages",
        lambda text: {
            "model": "fake",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": text}],
        },
    ),
    "gemini": (
        "/v1beta/models/fake:generateContent",
        lambda text: {
            "contents": [{"role": "user", "parts": [{"text": text}]}],
            "generationConfig": {"maxOutputTokens": 3},
        },
    ),
}


def _chat(text: str) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": 3}


def _fleet(serve_fake, servers, redis_url: str | None):
    """Two fake-engine gateways (upstreams) and two round-robin proxy gateways over both,
    sharing ``redis_url`` (None: each its own in-process state)."""
    ups = [serve_fake(GatewaySettings(model_name="fake")) for _ in range(2)]
    urls = [srv.url for srv, _ in ups]
    settings = GatewaySettings(routing="round_robin", redis_url=redis_url)
    proxies = [servers(lambda: create_proxy_app(urls, settings)) for _ in range(2)]
    return ups, proxies


def _seen(ups) -> list[int]:
    return [len(engine.requests_seen) for _, engine in ups]


def _whole(proxies) -> None:
    """Every upstream's in-flight count and slots are back to zero on both proxies."""
    for p in proxies:
        for up in p.app[PROXY].router.upstreams:
            assert up.in_flight == 0, up


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_promised_429_through_one_proxy_is_kept_by_the_retry_through_another(
    serve_fake, servers, gw, redis_server, dialect
):
    ups, (a, b) = _fleet(serve_fake, servers, redis_server.url)
    path, body = DIALECTS[dialect]
    promisers = []
    with gw.client(a) as ca, gw.client(b) as cb:
        for i in range(4):  # B's round robin alternates: without the pins, half go elsewhere
            for _, engine in ups:
                engine.predicted_ttft = 2.3  # both upstreams over the budget: 300 ms promised
            before = _seen(ups)
            r = ca.post(path, json=body(f"request {i}"), headers=BUDGET)
            assert r.status_code == 429, r.text
            assert PROMISE_HEADER in r.headers and "retry-after-ms" in r.headers
            # relayed at once: one upstream asked, its promise not broken by a second one
            keys = redis_server.client().keys("pg:prom:*")
            assert len(keys) == 1, keys
            promiser = redis_server.client().get(keys[0])
            promisers.append(promiser)
            for _, engine in ups:
                engine.predicted_ttft = 0.01  # both would admit it now
            time.sleep(int(r.headers["retry-after-ms"]) / 1000)
            r = cb.post(path, json=body(f"request {i}"), headers=BUDGET)
            assert r.status_code == 200, r.text
            served = [n - m for n, m in zip(_seen(ups), before, strict=True)]
            assert served == [int(srv.url == promiser) for srv, _ in ups], (served, promiser)
            assert redis_server.client().keys("pg:prom:*") == []  # dropped once admitted
    assert len(set(promisers)) == 2  # A's round robin: both upstreams promised, in turn
    _whole((a, b))


@pytest.mark.parametrize("promise", [None, "soon", "0", "-5", "inf", "nan"])
def test_a_429_without_a_promise_moves_on_to_the_next_upstream(
    serve_fake, servers, gw, redis_server, promise
):
    """The old behaviour: a 429 without the header, or with one that is no positive finite
    number of milliseconds, goes to the next upstream, and no pin is recorded."""
    from aiohttp import web

    asked: list[str] = []

    async def refuse(request: web.Request) -> web.Response:
        asked.append(request.path)
        err = {"message": "busy", "type": "rate_limit_error", "param": None, "code": None}
        headers = {"Retry-After": "1"}
        if promise is not None:
            headers[PROMISE_HEADER] = promise
        return web.json_response({"error": err}, status=429, headers=headers)

    refuser = servers(chat_app(refuse, ["fake"]))
    fine, engine = serve_fake(GatewaySettings(model_name="fake"))
    settings = GatewaySettings(routing="round_robin", redis_url=redis_server.url)
    a = servers(lambda: create_proxy_app([refuser.url, fine.url], settings))
    with gw.client(a) as c:
        for i in range(2):  # round robin: one of them starts at the refuser
            r = c.post("/v1/chat/completions", json=_chat(f"x{i}"))
            assert r.status_code == 200, r.text
            assert PROMISE_HEADER not in r.headers
    assert asked and len(engine.requests_seen) == 2
    assert redis_server.client().keys("pg:prom:*") == []
    _whole((a,))


def test_the_pin_is_kept_in_process_state_too(serve_fake, servers, gw):
    """One proxy gateway on its own in-process state (``LocalState``): its own retry goes
    back to the promising upstream even while that upstream's 429 rests it for others."""
    ups, (a, _) = _fleet(serve_fake, servers, None)
    for _, engine in ups:
        engine.predicted_ttft = 2.3
    with gw.client(a) as c:
        r = c.post("/v1/chat/completions", json=_chat("again"), headers=BUDGET)
        assert r.status_code == 429, r.text
        now = time.monotonic()  # the promising upstream is the one its 429 rests
        first = [u.limited_until > now for u in a.app[PROXY].router.upstreams]
        assert sum(first) == 1
        for _, engine in ups:
            engine.predicted_ttft = 0.01
        for i in range(3):  # other requests go to the other upstream (the 429 rests this one)
            assert c.post("/v1/chat/completions", json=_chat(f"new {i}")).status_code == 200
        time.sleep(int(r.headers["retry-after-ms"]) / 1000)
        before = _seen(ups)
        r = c.post("/v1/chat/completions", json=_chat("again"), headers=BUDGET)
        assert r.status_code == 200, r.text
        served = [n - m for n, m in zip(_seen(ups), before, strict=True)]
        assert served == [int(f) for f in first]
        assert sum(_seen(ups)) == 4
    _whole((a,))


def _counting(monkeypatch, owner, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (still calling it); the list's length is the count."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_proxied_request_is_authenticated_once(serve_fake, servers, gw, monkeypatch, dialect):
    """The route's principal goes to the attempt loop: a promise's fingerprint does not
    authenticate the request a second time, nor does the route after the middleware."""
    from prefixgate.gateway.tenancy import keys

    up, _ = serve_fake(GatewaySettings(model_name="fake"))
    settings = GatewaySettings(api_keys=["sk-one"])
    proxy = servers(lambda: create_proxy_app([up.url], settings))
    shared = proxy.app[STATE].shared
    monkeypatch.setattr(shared, "may_hold_promises", lambda: True)  # fingerprinted
    calls = _counting(monkeypatch, keys, "_digest")  # the key's lookup
    path, body = DIALECTS[dialect]
    with gw.client(proxy) as c:
        r = c.post(path, json=body("once"), headers={"Authorization": "Bearer sk-one"})
    assert r.status_code == 200, r.text
    assert len(calls) == 1


def _quiet(proxies, seconds: float = 5.0) -> None:
    """Wait until each proxy's shared state knows no promise is outstanding."""
    deadline = time.monotonic() + seconds
    while any(p.app[STATE].shared.may_hold_promises() for p in proxies):
        assert time.monotonic() < deadline, "the promises' view never settled"
        time.sleep(0.02)


@pytest.mark.parametrize("shared", ["local", "redis"])
def test_no_fingerprint_nor_lookup_while_no_promise_is_outstanding(
    serve_fake, servers, gw, monkeypatch, request, shared
):
    """While no promise is held on any gateway, a proxied request is neither hashed nor
    looked up (no Redis GET); once one gateway records a promise, every gateway on that
    state looks its requests up again (the retry through another one finds its promise:
    ``test_a_promised_429_through_one_proxy_is_kept_by_the_retry_through_another``)."""
    from prefixgate.gateway.proxy import attempts

    redis = request.getfixturevalue("redis_server") if shared == "redis" else None
    ups, (a, b) = _fleet(serve_fake, servers, redis.url if redis else None)
    hashed = _counting(monkeypatch, attempts, "request_fingerprint")
    _quiet((a, b))
    if redis is not None:
        redis.client().config_resetstat()
    with gw.client(a) as ca, gw.client(b) as cb:
        for dialect, (path, body) in sorted(DIALECTS.items()):
            for c in (ca, cb):
                r = c.post(path, json=body(f"plain {dialect}"), headers=BUDGET)
                assert r.status_code == 200, r.text
        assert hashed == []
        if redis is not None:
            stats = redis.client().info("commandstats")
            assert "cmdstat_get" not in stats, stats
        for _, engine in ups:
            engine.predicted_ttft = 2.3  # a promised 429 through A
        r = ca.post("/v1/chat/completions", json=_chat("held"), headers=BUDGET)
        assert r.status_code == 429 and PROMISE_HEADER in r.headers, r.text
        deadline = time.monotonic() + 5
        proxies = (a, b) if redis is not None else (a,)
        while not all(p.app[STATE].shared.may_hold_promises() for p in proxies):
            assert time.monotonic() < deadline  # heard before the 429 left, in practice
            time.sleep(0.01)
        for _, engine in ups:
            engine.predicted_ttft = 0.01
        time.sleep(int(r.headers["retry-after-ms"]) / 1000)
        retry = cb if redis is not None else ca  # through the other gateway, sharing Redis
        r = retry.post("/v1/chat/completions", json=_chat("held"), headers=BUDGET)
        assert r.status_code == 200, r.text
    _whole((a, b))


def test_an_early_retry_is_relayed_the_time_left_on_its_promise(serve_fake, servers, gw):
    """A client back before its promised time (one that capped the Retry-After it was told)
    is told, through the proxy, the time left on the promise it holds: the promising
    upstream's 429 relayed as it is, with no second promise made there (it made one, and a
    second slot, taking the early retry for a new request)."""
    ups, (a, _) = _fleet(serve_fake, servers, None)
    for _, engine in ups:
        engine.predicted_ttft = 2.3
    with gw.client(a) as c:
        r = c.post("/v1/chat/completions", json=_chat("early"), headers=BUDGET)
        assert r.status_code == 429, r.text
        first = int(r.headers["retry-after-ms"])
        again = c.post("/v1/chat/completions", json=_chat("early"), headers=BUDGET)
        assert again.status_code == 429, again.text
        assert again.json()["error"]["code"] == "ttft_budget_exceeded"
        assert PROMISE_HEADER in again.headers
        assert int(again.headers["retry-after-ms"]) <= first
        held = sorted(len(srv.app[STATE].admission.promises) for srv, _ in ups)
        assert held == [0, 1]
        for _, engine in ups:
            engine.predicted_ttft = 0.01
        time.sleep(int(again.headers["retry-after-ms"]) / 1000)
        r = c.post("/v1/chat/completions", json=_chat("early"), headers=BUDGET)
        assert r.status_code == 200, r.text
    _whole((a,))


def test_a_far_promise_rests_its_upstream_no_longer_than_a_prediction(serve_fake, servers, gw):
    """A budget slot is kept and stated up to 600 s now, promised to that one request. The
    proxy rested the promising upstream for the whole hint, so one request with a tight budget
    sent every other request of the proxy elsewhere for up to ten minutes (the SDK's adaptive
    hold had the same flaw: capped at ``max_retry_after`` since). The rest is capped at the
    longest predicted wait (``MAX_RETRY_AFTER_S``); the promised request's retry still goes
    back to it (its pin)."""
    from prefixgate.gateway.tenancy.admission import MAX_RETRY_AFTER_S

    ups, (a, _) = _fleet(serve_fake, servers, None)
    for _, engine in ups:
        engine.predicted_ttft = 302.0  # a slot ~300 s away, promised
    with gw.client(a) as c:
        r = c.post("/v1/chat/completions", json=_chat("far"), headers=BUDGET)
        assert r.status_code == 429, r.text
        assert PROMISE_HEADER in r.headers and int(r.headers["retry-after"]) > MAX_RETRY_AFTER_S
        now = time.monotonic()
        rests = [u.limited_until - now for u in a.app[PROXY].router.upstreams]
        assert max(rests) <= MAX_RETRY_AFTER_S + 1, rests
    _whole((a,))
