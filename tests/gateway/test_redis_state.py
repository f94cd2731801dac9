"""Gateway replicas sharing state in a real Redis (``--redis-url``, ``gateway.redis_state``):
one per-key limit across replicas, concurrency leases freed after a replica's ``kill -9``,
prefixes created on one replica used on another, and serving on local limits while Redis
is down. Each test starts its own ``redis-server`` (``redis_server`` fixture).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import httpx
from prefixgate.gateway.settings import GatewaySettings
from support.http import wait_ready
from support.net import free_port
from support.serve_process import SERVE
from support.stub_upstream import StubServer


def _keys(tmp_path, **limits: int) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "k1", "name": "team", **limits}]}))
    return str(path)


AUTH = {"Authorization": "Bearer k1"}
SYSTEM = [{"role": "system", "content": "You are a careful assistant. " * 3}]  # a prefix


async def _burst(urls: list[str], n: int, body: dict) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=400)) as c:
        return await asyncio.gather(
            *(
                c.post(urls[i % len(urls)] + "/v1/chat/completions", json=body, headers=AUTH)
                for i in range(n)
            )
        )


def _post_until_admitted(c, gw, pause_s: float, deadline: float | None = None) -> None:
    """POST a one-token chat as ``k1`` with ``c`` every ``pause_s`` seconds until one is admitted
    (200); every answer before it must be a 429, and come before ``deadline`` (a
    ``time.monotonic()`` value; else the slots were not freed within the TTL)."""
    while True:
        resp = c.post("/v1/chat/completions", json=gw.chat_body("x", max_tokens=1), headers=AUTH)
        if resp.status_code == 200:
            break
        assert resp.status_code == 429, resp.text
        if deadline is not None:
            assert time.monotonic() < deadline, "slots not freed within the TTL"
        time.sleep(pause_s)


def _create_prefix(c, ttl_s: int) -> httpx.Response:
    """Create a prefix of ``SYSTEM`` living ``ttl_s`` seconds through ``c``; assert it is 200."""
    created = c.post(
        "/v1/prefixes", json={"model": "fake", "messages": SYSTEM, "ttl_seconds": ttl_s}
    )
    assert created.status_code == 200, created.text
    return created


def _hold_stream(held: contextlib.ExitStack, srv, body: dict) -> None:
    """Open a streamed chat ``body`` as ``k1`` on ``srv``, kept open until ``held`` closes;
    assert it is answered 200."""
    http = held.enter_context(httpx.Client(timeout=60))
    resp = held.enter_context(
        http.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=AUTH)
    )
    assert resp.status_code == 200


def _two_replicas_at_60_rpm(serve_fake, redis_server, tmp_path):
    """Two fake-engine gateways sharing ``redis_server``, one key of 60 requests per minute."""
    settings = GatewaySettings(
        model_name="fake",
        keys_file=_keys(tmp_path, requests_per_minute=60),
        redis_url=redis_server.url,
        max_queued_requests=512,
    )
    a, _ = serve_fake(settings)
    b, _ = serve_fake(settings)
    return a, b


def test_two_replicas_share_one_requests_per_minute_limit(serve_fake, gw, redis_server, tmp_path):
    a, b = _two_replicas_at_60_rpm(serve_fake, redis_server, tmp_path)
    t0 = time.monotonic()
    responses = asyncio.run(_burst([a.url, b.url], 200, gw.chat_body("hi", max_tokens=1)))
    elapsed = time.monotonic() - t0
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 200, sorted({r.status_code for r in responses})
    # The shared bucket holds 60 and refills 1 per second while the burst runs.
    assert 60 <= len(ok) <= 60 + int(elapsed), (len(ok), elapsed)
    for r in refused:
        assert float(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    # Both replicas served some (the limit is shared, not split).
    _until_written(a, b)
    usage = redis_server.client().hgetall(_usage_key("k1"))
    assert int(usage["requests"]) == len(ok)


def _usage_key(key: str) -> str:
    import hashlib

    return "pg:usage:" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _conc_key(key: str) -> str:
    return "pg:conc:" + _usage_key(key).removeprefix("pg:usage:")


def test_killed_replica_frees_its_concurrency_slots_within_the_lease_ttl(
    serve_fake, gw, redis_server, tmp_path
):
    """Replica 1 (a ``prefixgate serve`` process) holds both slots of a key with
    ``max_concurrent=2`` on a slow upstream and is killed with SIGKILL: replica 2 refuses the
    key until the leases expire, then serves it again within the TTL."""
    ttl = 2.0
    keys = _keys(tmp_path, max_concurrent=2)
    slow = StubServer(ttft_s=60, models=("fake",)).start()  # serves the chats' model
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            *SERVE,
            "--upstream",
            slow.base_url,
            "--keys-file",
            keys,
            "--redis-url",
            redis_server.url,
            "--redis-lease-ttl-s",
            str(ttl),
            "--port",
            str(port),
            "--no-access-log",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "replica1.log", "wb"),  # noqa: SIM115
    )
    try:
        replica1 = f"http://127.0.0.1:{port}"
        wait_ready(replica1, 60, proc, request_timeout_s=1)

        def hold() -> None:
            try:
                httpx.post(
                    replica1 + "/v1/chat/completions",
                    json=gw.chat_body("hold", max_tokens=1, stream=True),  # held for ttft_s
                    headers=AUTH,
                    timeout=90,
                )
            except httpx.TransportError:
                pass  # replica 1 killed under it

        holders = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
        for t in holders:
            t.start()
        r = redis_server.client()
        deadline = time.monotonic() + 30
        while r.zcard(_conc_key("k1")) < 2:
            assert time.monotonic() < deadline, (
                "replica 1 never took the two slots: "
                + (tmp_path / "replica1.log").read_text()[-3000:]
            )
            time.sleep(0.05)

        b, _ = serve_fake(
            GatewaySettings(
                model_name="fake", keys_file=keys, redis_url=redis_server.url, redis_lease_ttl_s=ttl
            )
        )
        with gw.client(b) as c:
            refused = c.post("/v1/chat/completions", json=gw.chat_body("x"), headers=AUTH)
            assert refused.status_code == 429, refused.text
            assert "max_concurrent=2" in refused.json()["error"]["message"]
            # Past one renewal (ttl / 3): the live replica keeps its leases.
            time.sleep(ttl * 0.7)
            assert (
                c.post("/v1/chat/completions", json=gw.chat_body("x"), headers=AUTH).status_code
                == 429
            )

            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            killed_at = time.monotonic()
            _post_until_admitted(c, gw, 0.1, deadline=killed_at + ttl + 1.0)
        freed_after = time.monotonic() - killed_at
        assert freed_after <= ttl + 1.0, freed_after
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        slow.stop()


def test_redis_stopped_mid_run_no_5xx_limits_fall_back_to_local(
    serve_fake, gw, redis_server, tmp_path, caplog
):
    settings = GatewaySettings(
        model_name="fake",
        keys_file=_keys(tmp_path, requests_per_minute=10),
        redis_url=redis_server.url,
    )
    a, _ = serve_fake(settings)
    b, _ = serve_fake(settings)
    body = gw.chat_body("hi", max_tokens=1)
    with gw.client(a) as ca, gw.client(b) as cb:
        assert ca.get("/ready").json()["state"] == {
            "backend": "redis",
            "shared": True,
            "fallbacks": 0,
        }
        # Shared: 6 on A and 6 on B take the one bucket of 10.
        codes = [
            c.post("/v1/chat/completions", json=body, headers=AUTH).status_code
            for c in (ca, cb)
            for _ in range(6)
        ]
        assert codes.count(200) == 10 and codes.count(429) == 2, codes

        redis_server.stop()
        # Redis gone: each replica admits on its own full bucket of 10, no 5xx.
        for c in (ca, cb):
            codes = [
                c.post("/v1/chat/completions", json=body, headers=AUTH).status_code
                for _ in range(12)
            ]
            assert codes.count(200) == 10 and codes.count(429) == 2, codes
            ready = c.get("/ready")
            assert ready.status_code == 200
            assert ready.json()["state"]["shared"] is False
            metrics = c.get("/metrics").text
            assert "prefixgate_state_backend_up 0.0" in metrics
            assert "prefixgate_state_fallback_requests 12.0" in metrics
    warnings = [r for r in caplog.records if "redis unreachable" in r.getMessage()]
    assert len(warnings) == 2  # once per replica


def test_prefix_created_on_replica_1_serves_a_chat_on_replica_2(
    serve_fake, gw, redis_server, tmp_path
):
    settings = GatewaySettings(
        model_name="fake", keys_file=_keys(tmp_path), redis_url=redis_server.url
    )
    a, engine_a = serve_fake(settings)
    b, engine_b = serve_fake(settings)
    with gw.client(a, headers=AUTH) as ca, gw.client(b, headers=AUTH) as cb:
        created = _create_prefix(ca, 60)
        pid = created.json()["id"]
        assert (
            cb.get(f"/v1/prefixes/{pid}").json()["prompt_tokens"] == created.json()["prompt_tokens"]
        )
        chat = {
            "model": "fake",
            "prefix_id": pid,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        }
        r = cb.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        # Replica 2's engine saw the whole conversation: prefix messages + the new one.
        whole = engine_b.tokenizer.encode_chat(SYSTEM + chat["messages"])
        assert engine_b.requests_seen[-1][1] == whole
        # A deletion on replica 2 holds on replica 1 too.
        assert cb.delete(f"/v1/prefixes/{pid}").status_code == 200
        for c in (ca, cb):
            gone = c.post("/v1/chat/completions", json=chat)
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "prefix_not_found"
    assert engine_a.pinned_blocks == 0  # replica 1 released its pin


def test_two_replicas_share_one_max_prefixes_per_key(serve_fake, gw, redis_server, tmp_path):
    settings = GatewaySettings(
        model_name="fake", keys_file=_keys(tmp_path, max_prefixes=2), redis_url=redis_server.url
    )
    a, _ = serve_fake(settings)
    b, _ = serve_fake(settings)
    body = {"model": "fake", "messages": SYSTEM, "ttl_seconds": 60}
    with gw.client(a, headers=AUTH) as ca, gw.client(b, headers=AUTH) as cb:
        first = ca.post("/v1/prefixes", json=body)
        assert first.status_code == 200, first.text
        assert cb.post("/v1/prefixes", json=body).status_code == 200
        for c in (ca, cb):
            r = c.post("/v1/prefixes", json=body)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "prefix_limit_exceeded"
            assert float(r.headers["Retry-After"]) >= 1
        # Deleted on replica 2: replica 1 may create again at once.
        assert cb.delete(f"/v1/prefixes/{first.json()['id']}").status_code == 200
        again = ca.post("/v1/prefixes", json=body)
        assert again.status_code == 200, again.text
        assert cb.post("/v1/prefixes", json=body).status_code == 429


def test_prefix_deleted_through_another_replica_is_unpinned_without_a_lookup(
    serve_fake, gw, redis_server, tmp_path
):
    """Replica 1 made the prefix (its engine pins the blocks); replica 2 deletes it. With no
    further request on replica 1, its periodic sweep (every third of the lease TTL) unpins
    the blocks: they are not held until the prefix's TTL."""
    settings = GatewaySettings(
        model_name="fake",
        keys_file=_keys(tmp_path),
        redis_url=redis_server.url,
        redis_lease_ttl_s=0.6,
    )
    a, engine_a = serve_fake(settings)
    b, _ = serve_fake(settings)
    with gw.client(a, headers=AUTH) as ca, gw.client(b, headers=AUTH) as cb:
        created = _create_prefix(ca, 600)
        assert engine_a.pinned_blocks > 0
        assert cb.delete(f"/v1/prefixes/{created.json()['id']}").status_code == 200
    deadline = time.monotonic() + 20  # many sweeps' worth; the TTL is 600 s
    while engine_a.pinned_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_a.pinned_blocks == 0


def test_a_stranded_lease_s_retry_after_is_its_expiry(serve_fake, gw, redis_server, tmp_path):
    """A lease stranded in Redis (its replica died, or a Redis stall cut its renewals) holds a
    ``max_concurrent=1`` key until it expires: the refusal's ``Retry-After`` says when (it was
    always 1 s, so a client obeying it was refused again and again), measured against the
    actual wait."""
    keys = _keys(tmp_path, max_concurrent=1)
    srv, _ = serve_fake(
        GatewaySettings(
            model_name="fake", keys_file=keys, redis_url=redis_server.url, redis_lease_ttl_s=10
        )
    )
    r = redis_server.client()
    seconds, micros = r.time()
    r.zadd(_conc_key("k1"), {"stranded": seconds + micros / 1e6 + 4.0})
    with gw.client(srv) as c:
        refused = c.post("/v1/chat/completions", json=gw.chat_body("x"), headers=AUTH)
        t_refused = time.monotonic()
        assert refused.status_code == 429, refused.text
        advice = int(refused.headers["Retry-After"])
        _post_until_admitted(c, gw, 0.05)
        waited = time.monotonic() - t_refused
    print(f"stranded lease: Retry-After {advice} s, actual wait {waited:.2f} s")
    assert waited > 2.0
    assert abs(advice - waited) <= 1.5, (advice, waited)


def _backend(srv):
    from prefixgate.gateway.state import STATE

    return srv.app[STATE].shared


def _until_written(*servers) -> None:
    """Poll (a failure guard of 60 s) until no replica has a Redis write still in flight:
    a request's release (its usage counted, its bucket charged) is written after its answer
    went out, so a client can read Redis before the last ones land (CI read 28 of 60 right
    after a restart, the other 32 waiting on their stale connections' retry)."""
    t0 = time.monotonic()
    while any(_backend(s)._tasks for s in servers):
        assert time.monotonic() - t0 < 60, [len(_backend(s)._tasks) for s in servers]
        time.sleep(0.02)


def _restart(redis_server) -> None:
    """Kill ``redis-server`` and start it again on the same port, empty (no persistence)."""
    redis_server.proc.kill()
    redis_server.proc.wait(10)
    redis_server.proc = None
    redis_server.start()


def _until_rebuilt(*servers) -> float:
    """Poll (a failure guard of 60 s, not a timed assertion) until every replica's backend is
    up again and has noticed that Redis lost its state (its leases published again);
    returns the seconds that took."""
    t0 = time.monotonic()
    while not all(_backend(s).up and _backend(s).rebuilds >= 1 for s in servers):
        assert time.monotonic() - t0 < 60, [vars(_backend(s)) for s in servers]
        time.sleep(0.02)
    return time.monotonic() - t0


def test_max_concurrent_holds_across_a_redis_restart(serve_fake, gw, redis_server, tmp_path):
    """Replica A holds both slots of a ``max_concurrent=2`` key; Redis is killed and started
    again empty. Once the replicas report Redis back (A's leases published again), the key
    is never admitted a third time, on either replica; once A's requests end, two are
    admitted again, not three."""
    settings = GatewaySettings(
        model_name="fake", keys_file=_keys(tmp_path, max_concurrent=2), redis_url=redis_server.url
    )
    a, _ = serve_fake(settings, token_delay_s=0.2)
    b, _ = serve_fake(settings, token_delay_s=0.2)
    hold = gw.chat_body("hold", max_tokens=100, stream=True)
    quick = gw.chat_body("x", max_tokens=1)
    r = redis_server.client()
    with contextlib.ExitStack() as held:
        for _ in range(2):
            _hold_stream(held, a, hold)
        with gw.client(b) as cb:
            assert cb.post("/v1/chat/completions", json=quick, headers=AUTH).status_code == 429
        r.set("test:before-restart", 1)
        _restart(redis_server)
        # Redis came back empty (a key of the test's own: the replicas may already have
        # published their leases again by the time the test reads theirs; the whole suite on
        # a loaded host read 2 here once)
        assert r.get("test:before-restart") is None
        took = _until_rebuilt(a, b)
        print(f"redis restart: leases rebuilt and both replicas up {took:.3f} s after the start")
        assert r.zcard(_conc_key("k1")) == 2
        for srv in (b, a, b):
            with gw.client(srv) as c:
                refused = c.post("/v1/chat/completions", json=quick, headers=AUTH)
            assert refused.status_code == 429, refused.text
            assert "max_concurrent=2" in refused.json()["error"]["message"]
    # A's two streams closed: their leases go (a background release each), then two fit.
    deadline = time.monotonic() + 60
    while r.zcard(_conc_key("k1")):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with contextlib.ExitStack() as held:
        for srv in (b, a):
            _hold_stream(held, srv, hold)
        with gw.client(b) as cb:
            assert cb.post("/v1/chat/completions", json=quick, headers=AUTH).status_code == 429
    assert _backend(a).fallbacks == 0 and _backend(b).fallbacks == 0


def test_requests_per_minute_shared_by_two_replicas_holds_after_a_redis_restart(
    serve_fake, gw, redis_server, tmp_path
):
    """Both replicas' pools hold connections to the old Redis; after it is killed and
    started again empty, the stale connections are replaced (health check, one retry)
    without a fallback episode, and one shared bucket of 60 requests per minute holds
    across the two replicas again (restarted full: Redis lost the old level)."""
    a, b = _two_replicas_at_60_rpm(serve_fake, redis_server, tmp_path)
    body = gw.chat_body("hi", max_tokens=1)
    warm = asyncio.run(_burst([a.url, b.url], 40, body))  # many pooled connections on each
    assert sorted({x.status_code for x in warm}) == [200]
    _until_written(a, b)  # the warm-up's releases land on the old Redis, not the new one
    _restart(redis_server)
    took = _until_rebuilt(a, b)
    print(f"redis restart: both replicas back on the new Redis {took:.3f} s after its start")
    t0 = time.monotonic()
    responses = asyncio.run(_burst([a.url, b.url], 200, body))
    elapsed = time.monotonic() - t0
    ok = [x for x in responses if x.status_code == 200]
    refused = [x for x in responses if x.status_code == 429]
    assert len(ok) + len(refused) == 200, sorted({x.status_code for x in responses})
    assert 60 <= len(ok) <= 60 + int(elapsed), (len(ok), elapsed)
    assert _backend(a).fallbacks == 0 and _backend(b).fallbacks == 0
    _until_written(a, b)  # releases on the pool's stale connections retry after a backoff
    assert int(redis_server.client().hgetall(_usage_key("k1"))["requests"]) == len(ok)


def test_a_key_over_two_shared_limits_is_told_the_longer_wait(
    serve_fake, gw, redis_server, tmp_path
):
    """A ``max_concurrent=1``, 1-request-per-minute key whose slot is held by a lease expiring
    in 4 s: the refusal names both bounds and states the bucket's 60 s (it said the lease's
    4 s, and the client came back to meet the empty bucket); the bucket gave nothing."""
    keys = _keys(tmp_path, max_concurrent=1, requests_per_minute=1)
    srv, _ = serve_fake(
        GatewaySettings(
            model_name="fake", keys_file=keys, redis_url=redis_server.url, redis_lease_ttl_s=10
        )
    )
    with gw.client(srv) as c:
        first = c.post("/v1/chat/completions", json=gw.chat_body("x", max_tokens=1), headers=AUTH)
        assert first.status_code == 200, first.text  # the minute's one request
        r = redis_server.client()
        seconds, micros = r.time()
        r.zadd(_conc_key("k1"), {"stranded": seconds + micros / 1e6 + 4.0})
        refused = c.post("/v1/chat/completions", json=gw.chat_body("x"), headers=AUTH)
    assert refused.status_code == 429, refused.text
    message = refused.json()["error"]["message"]
    assert "max_concurrent=1" in message and "1 requests per minute" in message, message
    assert 58 <= int(refused.headers["Retry-After"]) <= 60, refused.headers


def test_a_promise_recorded_through_one_replica_is_read_through_another(redis_server):
    # a retry after a 429 goes back to the upstream that promised it a place, through any
    # gateway replica (docs/sim.md, 6 December, later section)
    from prefixgate.gateway.tenancy.redis_state import RedisState

    async def scenario() -> None:
        one, two = RedisState(redis_server.url), RedisState(redis_server.url)
        await one.start()
        await two.start()
        try:
            await one.put_promise("key:abc/3/123", "http://replica-2:8000", 0.3)
            assert await two.promised_upstream("key:abc/3/123") == "http://replica-2:8000"
            assert await two.promised_upstream("key:abc/3/124") is None
            await two.drop_promise("key:abc/3/123")  # claimed
            assert await one.promised_upstream("key:abc/3/123") is None
            await one.put_promise("lapses", "http://replica-1:8000", 0.2)
            await asyncio.sleep(0.4)
            assert await two.promised_upstream("lapses") is None
        finally:
            await one.close()
            await two.close()

    asyncio.run(scenario())


def test_every_replica_hears_of_a_promise_made_through_another(redis_server):
    # a replica skips the promise lookup only while it knows none is outstanding anywhere:
    # a listening replica hears each new promise; one that (re)subscribes reads the marker
    from prefixgate.gateway.tenancy.redis_state import RedisState

    async def until(predicate, seconds: float = 3.0) -> None:
        deadline = time.monotonic() + seconds
        while not predicate():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        one, two = RedisState(redis_server.url), RedisState(redis_server.url)
        assert one.may_hold_promises()  # not listening yet: not known, looked up
        await one.start()
        await two.start()
        late = RedisState(redis_server.url)
        try:
            await until(lambda: not one.may_hold_promises() and not two.may_hold_promises())
            await one.put_promise("fp", "http://replica-2:8000", 0.6)
            await until(two.may_hold_promises, 1.0)
            await late.start()  # subscribes after the promise: the marker tells it
            await until(lambda: late._promises_known)
            assert late.may_hold_promises()
            await until(lambda: not two.may_hold_promises() and not late.may_hold_promises())
            # the listeners' connections cut: a promise made meanwhile is still known to all
            redis_server.client().client_kill_filter(_type="pubsub")
            await one.put_promise("fp2", "http://replica-1:8000", 2.0)
            await until(lambda: two._promises_known and late._promises_known)  # subscribed anew
            assert two.may_hold_promises() and late.may_hold_promises()
        finally:
            for state in (one, two, late):
                await state.close()

    asyncio.run(scenario())


def test_no_client_setinfo_handshake_on_any_connection():
    """Redis before 7.2 answers redis-py's ``CLIENT SETINFO`` with an error; the suite on the
    lowest versions (redis-py 5.0.1) once read that error as a command's own just after a Redis
    restart and fell back to local limits (121 requests served of a shared 60 a minute). No
    connection of the state sends the handshake."""
    from prefixgate.gateway.tenancy.redis_state import RedisState

    async def main() -> None:
        state = RedisState("redis://127.0.0.1:9")  # never connected: the options alone
        for client in (state._client, state._listen_client):
            kwargs = client.connection_pool.connection_kwargs
            assert kwargs.get("lib_name") is None and kwargs.get("lib_version") is None

    asyncio.run(main())
