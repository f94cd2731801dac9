"""Adversarial input found by QA: each case gets the documented OpenAI error (or is served),
the server keeps serving, and nothing leaks (fake engine, fast)."""

from __future__ import annotations

from prefixgate.gateway.admission import AdmissionConfig, AdmissionController
from prefixgate.gateway.errors import APIError
from prefixgate.gateway.prompts import choice_seeds
from prefixgate.gateway.state import GatewaySettings


def _error(r, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def _raw(body: str) -> dict:
    """Send JSON text as is (NaN / Infinity literals that json.dumps would also write)."""
    return {"content": body.encode(), "headers": {"content-type": "application/json"}}


def test_non_finite_numbers_are_refused(serve_fake, gw):
    # Infinity passed `repetition_penalty > 0` and reached the sampler; NaN / Infinity are
    # never valid sampling values (nor a prefix TTL).
    srv, engine = serve_fake()
    base = '{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
    with gw.client(srv) as http:
        for field in (
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
        ):
            for literal in ("Infinity", "-Infinity", "NaN"):
                r = http.post("/v1/chat/completions", **_raw(f'{base}, "{field}": {literal}}}'))
                _error(r, 400, param=field)
        r = http.post(
            "/v1/prefixes",
            **_raw(
                '{"model": "fake", "messages": [{"role": "system", "content": "x"}], '
                '"ttl_seconds": Infinity}'
            ),
        )
        _error(r, 400, param="ttl_seconds")
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
    assert engine.requests_seen and len(engine.requests_seen) == 1
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_seed_out_of_range_names_the_field(serve_fake, gw):
    # 2**64 reached torch's Generator.manual_seed: "Overflow when unpacking long long", param null.
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        for seed in (2**64, 10**30, -(2**63) - 1):
            err = _error(
                http.post("/v1/chat/completions", json=gw.chat_body(seed=seed)), 400, param="seed"
            )
            assert "long long" not in err["message"]
            _error(
                http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "seed": seed}),
                400,
                param="seed",
            )
        # the int64 edges are served, also with n > 1 (seed + i must stay a valid seed)
        for seed in (2**63 - 1, -(2**63)):
            r = http.post("/v1/chat/completions", json=gw.chat_body(seed=seed, n=3, max_tokens=2))
            assert r.status_code == 200, r.text
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_choice_seeds_stay_int64():
    lo, hi = -(2**63), 2**63 - 1
    for seed in (hi, hi - 1, lo, 0, 7):
        seeds = choice_seeds(seed, 16)
        assert all(lo <= s <= hi for s in seeds), seeds
        assert len(set(seeds)) == 16 and seeds[0] == seed
    assert choice_seeds(5, 3) == [5, 6, 7]  # ordinary seeds unchanged


def test_union_errors_name_the_real_fault(serve_fake, gw):
    # `stop` with 100 strings said "Input should be a valid string"; an image part said the
    # content "should be a valid string": the message must describe the branch that was sent.
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        err = _error(
            http.post(
                "/v1/chat/completions", json=gw.chat_body(stop=[f"s{i}" for i in range(100)])
            ),
            400,
            param="stop",
        )
        assert "at most 4" in err["message"], err
        body = {
            "model": "fake",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        }
        err = _error(http.post("/v1/chat/completions", json=body), 400)
        assert err["param"] == "messages.0.content.0.type", err
        assert "valid string" not in err["message"], err
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_batch_cannot_bypass_the_admission_queue(serve_fake, gw):
    # One completions request with 3000 prompts x n=16 became 48,000 engine requests past a
    # queue bounded at 256 requests (a normal request then waited 53 s behind it).
    settings = GatewaySettings(model_name="fake", max_queued_requests=8)
    srv, engine = serve_fake(settings)
    with gw.client(srv) as http:
        body = {"model": "fake", "prompt": ["hi"] * 3, "n": 3, "max_tokens": 2}  # 9 > 8
        err = _error(http.post("/v1/completions", json=body), 400)
        assert "8" in err["message"], err
        _error(http.post("/v1/chat/completions", json=gw.chat_body(n=9)), 400, param="n")
        assert not engine.requests_seen
        r = http.post("/v1/completions", json=dict(body, prompt=["hi"] * 2, n=4))  # 8 fits
        assert r.status_code == 200 and len(r.json()["choices"]) == 8, r.text
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0
    assert len(engine.requests_seen) == 8


def test_admission_counts_engine_requests():
    ctl = AdmissionController(AdmissionConfig(max_queued_requests=10, max_running=12))
    a = ctl.admit(5, requests=6)
    assert (ctl.queued_requests, ctl.in_flight) == (6, 6)
    try:
        ctl.admit(5, requests=5)  # 6 + 5 > 10 queued
        raise AssertionError("admitted over the queue bound")
    except APIError as exc:
        assert exc.status == 429 and exc.code == "server_overloaded"
    a.started()
    b = ctl.admit(5, requests=5)
    assert (ctl.queued_requests, ctl.in_flight) == (5, 11)
    try:
        ctl.admit(1, requests=2)  # 11 + 2 > 12 running
        raise AssertionError("admitted over max_running")
    except APIError as exc:
        assert exc.status == 429
    for t in (a, b):
        t.done()
        t.done()
    assert (ctl.queued_requests, ctl.queued_tokens, ctl.in_flight) == (0, 0, 0)
    try:
        ctl.admit(1, requests=11)  # more than the queue can ever hold: not a 429 to retry
        raise AssertionError("admitted a request larger than the queue")
    except APIError as exc:
        assert exc.status == 400
    assert (ctl.queued_requests, ctl.in_flight) == (0, 0)


def test_undecodable_body_is_400_not_500(serve_fake, gw):
    # `Content-Encoding: gzip` over bytes that are not gzip: aiohttp's RequestPayloadError
    # reached the catch-all and was answered 500 "internal server error" (traceback logged).
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        for encoding in ("gzip", "deflate"):
            r = http.post(
                "/v1/chat/completions",
                content=b"0123456789",
                headers={"content-type": "application/json", "content-encoding": encoding},
            )
            err = _error(r, 400, code="invalid_body")
            assert encoding in err["message"], err
        r = http.post(
            "/v1/prefixes", content=b"not gzip at all", headers={"content-encoding": "gzip"}
        )
        _error(r, 400, code="invalid_body")
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200
    assert len(engine.requests_seen) == 1
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_retry_after_not_inflated_by_idle_time(monkeypatch):
    # The drain-rate EWMA decayed through idle periods (no queue, so no departures): after a
    # minute idle, the first overload told every client to wait 60 s although the queue then
    # drained in ~3 s (500 concurrent requests on aidreams-260k).
    now = [1000.0]
    monkeypatch.setattr("prefixgate.gateway.admission.time.monotonic", lambda: now[0])
    ctl = AdmissionController(AdmissionConfig(max_queued_requests=10))
    for _ in range(10):  # a busy second: 10 requests leave the queue
        ctl.admit(1).done()
        now[0] += 0.1
    busy = ctl.retry_after()
    now[0] += 120.0  # idle for two minutes
    tickets = [ctl.admit(1) for _ in range(10)]
    try:
        ctl.admit(1)
        raise AssertionError("admitted over the queue bound")
    except APIError as exc:
        assert exc.status == 429
        assert exc.retry_after <= 10.0, exc.retry_after  # ~10 queued at ~2/s, not 60
    assert busy >= 1.0
    for t in tickets:
        t.done()


def test_keys_file_entries_are_validated(tmp_path):
    # A non-string salt was loaded and then failed every request of that key at the engine
    # ("cache_salt must be a string"); a duplicate key silently replaced the first's limits;
    # a key with surrounding spaces could never match (the header's key is stripped).
    import json

    import pytest
    from prefixgate.gateway.auth import KeyRing

    bad = [
        [{"key": "k1", "salt": 5}],
        [{"key": "k1", "salt": ""}],
        [{"key": "k1", "name": 7}],
        [{"key": "k1"}, {"key": "k1", "max_concurrent": 1}],
        [{"key": " k1 "}],
    ]
    for i, entries in enumerate(bad):
        path = tmp_path / f"keys{i}.json"
        path.write_text(json.dumps({"keys": entries}))
        with pytest.raises(ValueError, match="keys"):
            KeyRing.from_options(None, str(path))
    assert not KeyRing.from_options(["k1", "k1"]).open  # the same key twice, same settings
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"keys": [{"key": "k1", "salt": "t"}, {"key": "k2", "salt": "t"}]}))
    ring = KeyRing.from_options(["k3"], str(path))
    assert not ring.open


def test_upstream_errors_without_an_openai_body_are_wrapped():
    # Upstream mode passed an upstream's error body through verbatim: an HTML 404 page, an
    # empty 500, even a Python traceback reached the client (the rule: OpenAI error objects,
    # never a stack trace on the wire). OpenAI error bodies still pass as they are.
    import gzip
    import json

    import httpx
    from aiohttp import web
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.server import BackgroundServer

    answers = {
        "traceback": (
            500,
            b"Traceback (most recent call last):\n  File \"x\"\nKeyError: 'k'",
            "text/plain",
            None,
        ),
        "html": (404, b"<h1>Not Found</h1>", "text/html", None),
        "empty": (500, b"", "application/json", None),
        "list": (400, b"[1, 2]", "application/json", None),
        "gzip-garbage": (
            500,
            gzip.compress(b"Traceback (most recent call last):"),
            "text/plain",
            "gzip",
        ),
        "openai": (
            429,
            json.dumps(
                {
                    "error": {
                        "message": "slow down",
                        "type": "rate_limit_error",
                        "param": None,
                        "code": "x",
                    }
                }
            ).encode(),
            "application/json",
            None,
        ),
        "openai-gzip": (
            400,
            gzip.compress(
                json.dumps(
                    {
                        "error": {
                            "message": "nope",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": None,
                        }
                    }
                ).encode()
            ),
            "application/json",
            "gzip",
        ),
    }

    def upstream() -> web.Application:
        async def chat(request: web.Request) -> web.Response:
            status, body, ctype, enc = answers[(await request.json())["model"]]
            headers = {"Content-Type": ctype, "Retry-After": "3"}
            if enc:
                headers["Content-Encoding"] = enc
            return web.Response(status=status, body=body, headers=headers)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        return app

    with (
        BackgroundServer(upstream) as up,
        BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw,
        httpx.Client(base_url=gw.url, timeout=10) as http,
    ):
        for model, (status, _, _, _) in answers.items():
            r = http.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "x"}]},
            )
            assert r.status_code == status, (model, r.text)
            err = _error(r, status)
            assert "Traceback" not in r.text and "<h1>" not in r.text
            assert r.headers.get("Retry-After") == "3", model
            if model == "openai":
                assert err["message"] == "slow down"
            elif model == "openai-gzip":
                assert err["message"] == "nope"
            else:
                assert err["code"] == "upstream_error", err


def test_tokenizing_a_huge_prompt_does_not_stall_other_clients(serve_fake, gw):
    # Tokenization ran on the event loop: one 3.6 MB prompt (2.4 M tokens, refused anyway as
    # over the context) froze every client, /health included, for ~3 s.
    import threading
    import time

    srv, engine = serve_fake()
    tok = engine.tokenizer
    plain = tok.encode

    def slow_encode(text, add_special_tokens=True):
        if len(text) > 1000:
            time.sleep(1.5)  # a long encode (the real tokenizer releases the GIL)
        return plain(text, add_special_tokens)

    tok.encode = slow_encode
    results = {}

    def big(path, body):
        with gw.client(srv) as http:
            results[path] = http.post(path, json=body).status_code

    threads = [
        threading.Thread(target=big, args=("/v1/chat/completions", gw.chat_body("x" * 5000))),
        threading.Thread(
            target=big, args=("/v1/completions", {"model": "fake", "prompt": "x" * 5000})
        ),
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)
    with gw.client(srv) as http:
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        stalled = time.monotonic() - t0
        r = http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2))
        assert r.status_code == 200
    for t in threads:
        t.join()
    assert stalled < 0.5, f"/health waited {stalled:.2f} s behind a tokenization"
    assert results == {"/v1/chat/completions": 400, "/v1/completions": 400}
    assert gw.wait_idle(srv, engine)["kv_blocks_used"] == 0


def test_options_without_their_switch_are_refused(serve_fake, gw):
    # top_logprobs without logprobs=true, and stream_options without stream=true, were
    # silently ignored (OpenAI and vLLM answer 400: the client expects logprobs / a usage chunk).
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        _error(
            http.post("/v1/chat/completions", json=gw.chat_body(top_logprobs=3)),
            400,
            param="top_logprobs",
        )
        _error(
            http.post("/v1/chat/completions", json=gw.chat_body(logprobs=False, top_logprobs=3)),
            400,
            param="top_logprobs",
        )
        _error(
            http.post(
                "/v1/chat/completions", json=gw.chat_body(stream_options={"include_usage": True})
            ),
            400,
            param="stream_options",
        )
        _error(
            http.post(
                "/v1/completions",
                json={"model": "fake", "prompt": "x", "stream_options": {"include_usage": True}},
            ),
            400,
            param="stream_options",
        )
        for body in (
            gw.chat_body(logprobs=True, top_logprobs=2, max_tokens=2),
            gw.chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=2),
            gw.chat_body(stream=False, stream_options=None, max_tokens=2),
        ):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert len(engine.requests_seen) == 3


def _slow_pins(engine, delay_s: float = 0.3) -> None:
    """Make ``engine.pin_prefix`` behave like the AsyncEngine's: the pin job runs on its own
    (the engine thread) and the caller only awaits its result, so a cancelled caller does not
    stop the pin from landing."""
    import asyncio

    plain = engine.pin_prefix
    jobs = set()

    async def pin_prefix(token_ids, ttl_s, cache_salt=None):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        async def job():
            await asyncio.sleep(delay_s)
            try:
                pin = await plain(token_ids, ttl_s, cache_salt)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                if not fut.done():
                    fut.set_exception(exc)
                return
            if not fut.done():
                fut.set_result(pin)
            else:  # the caller was cancelled: released on landing, as AsyncEngine.pin_prefix does
                engine.unpin_prefix(pin.id)

        task = loop.create_task(job())
        jobs.add(task)
        task.add_done_callback(jobs.discard)
        return await fut

    engine.pin_prefix = pin_prefix


def _prefix_body(i: int = 0, ttl: float = 600) -> dict:
    return {
        "model": "fake",
        "ttl_seconds": ttl,
        "messages": [{"role": "system", "content": f"system prompt number {i} " * 4}],
    }


def test_client_gone_while_pinning_leaks_no_pin(serve_fake, gw):
    # A client that gave up during POST /v1/prefixes left its pin in the engine, known to no
    # one, holding KV blocks for the whole TTL (an hour here; up to a day).
    import time

    import httpx

    srv, engine = serve_fake()
    _slow_pins(engine)
    with gw.client(srv) as http:
        for i in range(3):
            try:
                http.post("/v1/prefixes", json=_prefix_body(i, 3600), timeout=0.05)
            except httpx.TimeoutException:
                pass
        time.sleep(0.8)
        assert engine.pinned_blocks == 0, engine.stats()
        r = http.post("/v1/prefixes", json=_prefix_body(9))
        assert r.status_code == 200 and engine.pinned_blocks > 0
        assert http.delete(f"/v1/prefixes/{r.json()['id']}").status_code == 200
    assert engine.pinned_blocks == 0


def test_prefix_limits_hold_under_concurrency_and_retry_after_is_the_next_expiry(serve_fake, gw):
    # max_prefixes was checked before the pin was awaited: 6 concurrent creates all passed a
    # bound of 2. Retry-After was a fixed 60 s (pinned space full) or the *new* prefix's TTL
    # (too many prefixes), not the time until a live prefix expires.
    import threading

    srv, engine = serve_fake(GatewaySettings(model_name="fake", max_prefixes=2))
    _slow_pins(engine, 0.2)
    codes = []

    def create(i):
        with gw.client(srv) as http:
            codes.append(http.post("/v1/prefixes", json=_prefix_body(i, 5)).status_code)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200, 200, 429, 429, 429, 429], codes
    with gw.client(srv) as http:
        r = http.post("/v1/prefixes", json=_prefix_body(7, 600))
        _error(r, 429, code="prefix_limit_exceeded")
        assert 1 <= int(r.headers["Retry-After"]) <= 5, r.headers
    srv2, engine2 = serve_fake(num_blocks=16, max_pinned_fraction=0.5)  # 8 pinnable blocks
    with gw.client(srv2) as http:
        body = {
            "model": "fake",
            "ttl_seconds": 4,
            "messages": [{"role": "system", "content": "y" * 90}],
        }  # 5 full blocks
        assert http.post("/v1/prefixes", json=body).status_code == 200
        r = http.post(
            "/v1/prefixes",
            json=dict(body, ttl_seconds=600, messages=[{"role": "system", "content": "z" * 90}]),
        )
        _error(r, 429, code="prefix_limit_exceeded")
        assert 1 <= int(r.headers["Retry-After"]) <= 4, r.headers


def test_errors_do_not_echo_megabytes_of_input(serve_fake, gw):
    # A 1 MB model name came back whole inside the 404 message.
    srv, engine = serve_fake()
    with gw.client(srv) as http:
        name = "m" * 1_000_000
        err = _error(
            http.post("/v1/chat/completions", json=gw.chat_body(model=name)),
            404,
            code="model_not_found",
        )
        assert len(err["message"]) < 400 and "fake" in err["message"], len(err["message"])
        err = _error(
            http.post("/v1/chat/completions", json=gw.chat_body(prefix_id="p" * 100_000)),
            404,
            code="prefix_not_found",
        )
        assert len(err["message"]) < 400
        assert http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=2)).status_code == 200


def test_retry_after_right_on_the_first_burst_after_start(monkeypatch):
    # The drain-rate EWMA starts at 0: two busy seconds after start-up at a steady 10
    # departures/s it read ~3.3/s, so 60 queued requests were told to wait 18 s (and a shorter
    # history hit the 60 s cap). Bias-corrected, the wait is the ~6 s the queue needs.
    now = [1000.0]
    monkeypatch.setattr("prefixgate.gateway.admission.time.monotonic", lambda: now[0])
    ctl = AdmissionController(AdmissionConfig(max_queued_requests=60))
    tickets = [ctl.admit(1) for _ in range(60)]
    for t in tickets[:20]:  # 20 leave over 2 s, 20 new ones arrive: the queue stays full
        now[0] += 0.1
        t.done()
        tickets.append(ctl.admit(1))
    try:
        ctl.admit(1)
        raise AssertionError("admitted over the queue bound")
    except APIError as exc:
        assert exc.status == 429
        assert 4.0 <= exc.retry_after <= 8.0, exc.retry_after  # 60 queued at 10/s
    for t in tickets:
        t.done()
