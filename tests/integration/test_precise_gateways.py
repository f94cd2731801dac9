"""``--routing precise`` with two gateway replicas, and a gateway whose event consumer stops.

Two aidreams-260k engines (``create_app`` + ``BackgroundServer``, small KV pools that evict)
publish KV events on loopback ports.

- two gateways: each follows every engine's events. After a round-robin client's requests
  through both (several prefixes, evicting), both gateways' indexes equal each engine's block
  set, and the same prefix sent through either gateway goes to the same replica (and is
  predicted there exactly);
- two gateways see the same load on each replica (the engines' load reports): a request sent
  through one gateway, held in its engine after its first token, shows as one request on
  that replica in the other gateway too, and both see the fleet idle after it;
- a consumer stopped while the engines keep storing and evicting (requests straight to the
  engines): on resuming, the gap is found (one replica closes it by replay, the other, whose
  replay buffer is smaller than the gap, by a snapshot) and the index equals each engine's
  block set again; the gateway then predicts exactly.

The waits poll the index's state with a deadline (no timed assertion).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import httpx
import pytest
from prefixgate.engine.block_hash import block_key_bytes
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.settings import GatewaySettings
from support.kv_replicas import kv_feeds, random_text, serve_kv_replicas

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "aidreams-260k"
BS = 8
REPLAY_STEPS = (10_000, 4)  # the second engine replays only its last 4 batches


@pytest.fixture(scope="module")
def engines(aidreams_path):
    extras = [{"kv_events_buffer_steps": steps} for steps in REPLAY_STEPS]
    yield from serve_kv_replicas(aidreams_path, MODEL, BS, 48, extras)


def _llm(srv):
    return srv.app[LOCAL].engine.engine


def _gateway(engines, aidreams_path) -> BackgroundServer:
    feeds = kv_feeds(engines)
    s = GatewaySettings(routing="precise", tokenizer=aidreams_path, upstream_kv_events=feeds)
    return BackgroundServer(lambda: create_proxy_app([e.url for e in engines], s)).__enter__()


def _settle(engines) -> None:
    for srv in engines:
        deadline = time.monotonic() + 30
        while srv.app[LOCAL].engine.stats()["num_running"] and time.monotonic() < deadline:
            time.sleep(0.01)


def _engine_blocks(srv) -> Counter:
    """The engine's cached blocks as the index counts them (read while it is idle)."""
    pool = _llm(srv).kv_cache_manager.pool
    return Counter(block_key_bytes(c.key) for c in pool.cached_contents())


def _index(gw):
    return gw.app[PROXY].router.policy.exact.index


def _wait_caught_up(gw, engines, timeout_s: float = 60.0) -> None:
    """Until ``gw``'s index is synced with each engine's last batch (a deadline for the wait,
    not a timing assertion)."""
    index = _index(gw)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = index.stats()["replicas"]
        if all(
            st[e.url]["synced"] and index.applied_seq(e.url) == _llm(e).kv_events.collector.last_seq
            for e in engines
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"index never caught up: {index.stats()}")


def _assert_index_equals_engines(gw, engines) -> None:
    index = _index(gw)
    for srv in engines:
        assert index.blocks(srv.url) == _engine_blocks(srv), srv.url


def _served_by(gw, prompt: str, salt: str) -> int:
    """Which upstream (its position) served ``prompt`` sent through ``gw``."""
    ups = gw.app[PROXY].router.upstreams
    before = [u.served for u in ups]
    r = _complete(gw.url, prompt, salt)
    assert r.status_code == 200, r.text
    return next(i for i, u in enumerate(ups) if u.served > before[i])


def _complete(url: str, prompt: str, salt: str | None = None) -> httpx.Response:
    body: dict = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_two_gateways_follow_every_engine_and_agree(engines, aidreams_path, pool_whole):
    gws = [_gateway(engines, aidreams_path) for _ in range(2)]
    try:
        for gw in gws:
            _wait_caught_up(gw, engines)
        rng = random.Random(5)
        systems = [random_text(rng, 20) for _ in range(8)]  # ~3x one engine's 48 blocks in all
        for i in range(48):  # a round-robin client over the two gateways
            gw = gws[i % 2]
            r = _complete(gw.url, rng.choice(systems) + " " + random_text(rng, 3), f"t{i % 3}")
            assert r.status_code == 200, r.text
            _settle(engines)
            for g in gws:
                _wait_caught_up(g, engines)
        assert sum(e.app[LOCAL].engine.stats()["prefix_cache_evictions"] for e in engines) > 0
        for gw in gws:
            _assert_index_equals_engines(gw, engines)
        # the same prefix through either gateway: the same replica, predicted exactly
        for j, system in enumerate(systems):
            first, second = gws[j % 2], gws[(j + 1) % 2]
            a = _served_by(first, system + " one", "t9")
            _settle(engines)
            for g in gws:
                _wait_caught_up(g, engines)
            b = _served_by(second, system + " two", "t9")
            _settle(engines)
            for g in gws:
                _wait_caught_up(g, engines)
            assert a == b, (j, a, b)
        for gw in gws:
            pred = gw.app[PROXY].router.policy.exact.predictions
            assert pred and all(result == "exact" for (_, result) in pred), pred
            _assert_index_equals_engines(gw, engines)
    finally:
        for gw in gws:
            gw.close()
    _settle(engines)
    for srv in engines:
        pool_whole(srv.app[LOCAL].engine)


def _wait_load(gws, expect: dict[str, tuple[int, int]], timeout_s: float = 60.0) -> None:
    """Until every gateway's ``load`` of each upstream is ``expect[url]`` (a deadline for the
    wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    seen: list = []
    while time.monotonic() < deadline:
        seen = [
            {
                u.url: gw.app[PROXY].router.policy.exact.load(u)
                for u in gw.app[PROXY].router.upstreams
            }
            for gw in gws
        ]
        if all(view == expect for view in seen):
            return
        time.sleep(0.01)
    raise AssertionError(f"gateways' loads {seen} never became {expect}")


def test_two_gateways_see_the_same_load(engines, aidreams_path, pool_whole):
    gws = [_gateway(engines, aidreams_path) for _ in range(2)]
    gate = threading.Event()
    saved = []
    try:
        for srv in engines:  # each engine reports once (a request straight to it)
            assert _complete(srv.url, "the cat sat", "warm").status_code == 200
        _settle(engines)
        for gw in gws:
            _wait_caught_up(gw, engines)
        idle = {e.url: (0, 0) for e in engines}
        _wait_load(gws, idle)
        for srv in engines:  # from now on an engine's second step waits for the gate
            llm = _llm(srv)
            calls = [0]

            def execute(out, orig=llm.runner.execute, calls=calls):
                calls[0] += 1
                if calls[0] > 1:
                    gate.wait(60)
                return orig(out)

            saved.append((llm, llm.runner.execute))
            llm.runner.execute = execute
        first = threading.Event()

        def client() -> None:
            body = {"model": MODEL, "prompt": "a warm mat " * 4, "max_tokens": 4, "stream": True}
            with httpx.stream("POST", gws[0].url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first.set()

        t = threading.Thread(target=client)
        t.start()
        assert first.wait(60)  # its first token came: its engine now waits in its next step
        ups = gws[0].app[PROXY].router.upstreams
        busy = next(u.url for u in ups if u.in_flight == 1)
        assert all(u.in_flight == 0 for u in gws[1].app[PROXY].router.upstreams)
        # one request decoding there (no prefill left), in both gateways' view
        _wait_load(gws, {**idle, busy: (1, 0)})
        text = httpx.get(gws[1].url + "/metrics", timeout=10).text  # and in its /metrics
        assert f'prefixgate_kv_index_load_requests{{replica="{busy}"}} 1.0' in text
        assert f'prefixgate_kv_index_load_queued_prefill_tokens{{replica="{busy}"}} 0.0' in text
        gate.set()
        t.join(60)
        _settle(engines)
        _wait_load(gws, idle)
    finally:
        gate.set()
        for llm, orig in saved:
            llm.runner.execute = orig
        for gw in gws:
            gw.close()
    _settle(engines)
    for srv in engines:
        pool_whole(srv.app[LOCAL].engine)


def test_stopped_consumer_resyncs_to_each_engines_blocks(engines, aidreams_path, pool_whole):
    gw = _gateway(engines, aidreams_path)
    try:
        _wait_caught_up(gw, engines)
        index = _index(gw)
        before = {e.url: dict(index.stats()["replicas"][e.url]) for e in engines}
        seq_before = {e.url: _llm(e).kv_events.collector.last_seq for e in engines}
        index.stop()  # the gateway's consumer: its thread and sockets gone
        rng = random.Random(9)
        systems = [random_text(rng, 20) for _ in range(8)]
        for i in range(24):  # the engines keep storing and evicting meanwhile
            for srv in engines:
                r = _complete(srv.url, rng.choice(systems) + " " + random_text(rng, 3), f"s{i % 2}")
                assert r.status_code == 200, r.text
        _settle(engines)
        for srv in engines:  # more batches than the small replay buffer holds
            assert _llm(srv).kv_events.collector.last_seq - seq_before[srv.url] > REPLAY_STEPS[1]
            assert index.blocks(srv.url) != _engine_blocks(srv)  # the index is behind
        index.start()
        _wait_caught_up(gw, engines)
        after = {e.url: index.stats()["replicas"][e.url] for e in engines}
        for srv in engines:
            b, a = before[srv.url], after[srv.url]
            assert a["gaps"] > b["gaps"] and a["resyncs"] > b["resyncs"], (b, a)
        big, small = (after[e.url] for e in engines)
        assert big["replays"] > before[engines[0].url]["replays"]  # the buffer covered the gap
        assert small["snapshots"] > before[engines[1].url]["snapshots"]  # it could not
        _assert_index_equals_engines(gw, engines)
        # and the gateway predicts exactly again
        for system in systems[:4]:
            r = _complete(gw.url, system + " again", "s0")
            assert r.status_code == 200, r.text
            _settle(engines)
            _wait_caught_up(gw, engines)
        pred = gw.app[PROXY].router.policy.exact.predictions
        assert pred and all(result == "exact" for (_, result) in pred), pred
    finally:
        gw.close()
    _settle(engines)
    for srv in engines:
        pool_whole(srv.app[LOCAL].engine)
