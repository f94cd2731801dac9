"""``--routing precise`` on real engines: two aidreams-260k replicas (``create_app`` +
``BackgroundServer``) publishing KV events on loopback ports, behind a proxy that follows them.

- over a mixed workload (chat and completions, text and token-id prompts, two keys with their
  salts, requests with their own ``cache_salt``, shared system prompts, small KV pools that
  evict), the cached tokens predicted on the chosen upstream equal the ones it reports in
  >= 99 % of requests (counted by the policy and shown in ``/metrics``);
- a repeat of a long prompt goes to the replica holding it (and is predicted exactly);
- a proxy whose upstream has no event feed falls back to ``cache_aware`` (counted);
- each replica's pool is whole afterwards.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.settings import GatewaySettings
from support.kv_replicas import WORDS, kv_feeds, random_text, serve_kv_replicas

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "aidreams-260k"
BS = 8


@pytest.fixture(scope="module")
def replicas(aidreams_path):
    yield from serve_kv_replicas(aidreams_path, MODEL, BS, 64, ({}, {}))


def _engine(srv):
    return srv.app[LOCAL].engine


def _proxy(replicas, aidreams_path, tmp_path, feeds, access_log=False) -> BackgroundServer:
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"key": "sk-a", "name": "a", "salt": "tenant-a"},
                    {"key": "sk-b", "name": "b", "salt": "tenant-b"},
                    {"key": "sk-op", "name": "op", "role": "operator"},  # reads /metrics
                ]
            }
        )
    )
    s = GatewaySettings(
        routing="precise",
        tokenizer=aidreams_path,
        upstream_kv_events=feeds,
        keys_file=str(keys),
    )
    return BackgroundServer(
        lambda: create_proxy_app([r.url for r in replicas], s), access_log=access_log
    ).__enter__()


def _wait_synced(proxy: BackgroundServer, replicas, timeout_s: float = 60.0) -> None:
    """Until the proxy's index has applied each replica's last batch (a deadline for the
    wait, not a timing assertion)."""
    index = proxy.app[PROXY].router.policy.exact.index
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = index.stats()["replicas"]
        if all(
            st[r.url]["synced"]
            and index.applied_seq(r.url) == _engine(r).engine.kv_events.collector.last_seq
            for r in replicas
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"index never caught up: {index.stats()}")


def _settle(replicas) -> None:
    for srv in replicas:
        deadline = time.monotonic() + 30
        while _engine(srv).stats()["num_running"] and time.monotonic() < deadline:
            time.sleep(0.01)


def test_predicted_equals_reported_on_mixed_workload(replicas, aidreams_path, tmp_path, pool_whole):
    proxy = _proxy(replicas, aidreams_path, tmp_path, kv_feeds(replicas))
    try:
        _wait_synced(proxy, replicas)
        rng = random.Random(7)
        systems = [random_text(rng, 15) for _ in range(5)]
        tok = proxy.app[PROXY].router.policy.exact.tokenizer
        n = 0
        with httpx.Client(base_url=proxy.url, timeout=60) as http:
            for _ in range(80):
                key = rng.choice(["sk-a", "sk-b"])
                body: dict = {"model": MODEL, "max_tokens": 2, "temperature": 0}
                if rng.random() < 0.3:
                    body["cache_salt"] = rng.choice(["s1", "s2"])
                if rng.random() < 0.5:
                    body["stream"] = rng.random() < 0.5
                    if body["stream"]:
                        body["stream_options"] = {"include_usage": True}
                kind = rng.random()
                system = rng.choice(systems)
                if kind < 0.5:
                    path = "/v1/chat/completions"
                    body["messages"] = [
                        {"role": "system", "content": system},
                        {"role": "user", "content": random_text(rng, rng.randrange(1, 6))},
                    ]
                elif kind < 0.8:
                    path = "/v1/completions"
                    body["prompt"] = system + " " + random_text(rng, rng.randrange(1, 6))
                else:
                    path = "/v1/completions"
                    body["prompt"] = tok.encode(system) + [rng.randrange(3, 200) for _ in range(5)]
                headers = {"Authorization": f"Bearer {key}"}
                if body.get("stream"):
                    with http.stream("POST", path, json=body, headers=headers) as r:
                        assert r.status_code == 200, r.read()
                        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]"
                else:
                    r = http.post(path, json=body, headers=headers)
                    assert r.status_code == 200, r.text
                n += 1
                _settle(replicas)
                _wait_synced(proxy, replicas)
        precise = proxy.app[PROXY].router.policy.exact
        results = {}
        for (_, result), c in precise.predictions.items():
            results[result] = results.get(result, 0) + c
        compared = sum(results.values())
        assert compared == n, (results, dict(precise.decisions))
        assert results.get("exact", 0) >= 0.99 * n, results
        assert sum(precise.reported_tokens.values()) > 0  # the workload did hit the caches
        assert sum(_engine(r).stats()["prefix_cache_evictions"] for r in replicas) > 0
        assert set(precise.decisions) <= {"score", "affinity", "placed"}, precise.decisions
        # the per-upstream families (addresses in their labels) are an operator's to read
        auth = {"Authorization": "Bearer sk-op"}
        text = httpx.get(proxy.url + "/metrics", headers=auth).text
        assert 'prefixgate_route_predictions_total{result="exact"' in text or (
            "prefixgate_route_predictions_total{" in text
        )
        for name in ("synced", "lag_seconds", "gaps_total", "resyncs_total", "snapshots_total"):
            assert f"prefixgate_kv_index_{name}{{" in text, name
        assert "prefixgate_route_predicted_cached_tokens_total{" in text
    finally:
        proxy.close()
    _settle(replicas)
    for srv in replicas:
        pool_whole(_engine(srv))


def test_repeat_of_long_prompt_goes_to_its_holder(
    replicas, aidreams_path, tmp_path, pool_whole, caplog
):
    caplog.set_level(logging.INFO, logger="prefixgate.access")
    proxy = _proxy(replicas, aidreams_path, tmp_path, kv_feeds(replicas), access_log=True)
    try:
        _wait_synced(proxy, replicas)
        router = proxy.app[PROXY].router
        rng = random.Random(11)
        with httpx.Client(base_url=proxy.url, timeout=60) as http:
            for _ in range(6):
                prompt = random_text(rng, 25)
                served = []
                for j in range(2):
                    before = [u.served for u in router.upstreams]
                    r = http.post(
                        "/v1/completions",
                        json={
                            "model": MODEL,
                            "prompt": prompt + f" {WORDS[j]}",
                            "max_tokens": 1,
                        },
                        headers={"Authorization": "Bearer sk-a"},
                    )
                    assert r.status_code == 200, r.text
                    served.append(
                        next(i for i, u in enumerate(router.upstreams) if u.served > before[i])
                    )
                    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                    _settle(replicas)
                    _wait_synced(proxy, replicas)
                assert served[0] == served[1]
                assert cached > 0
        assert router.policy.exact.predictions and all(
            result == "exact" for (_, result) in router.policy.exact.predictions
        ), router.policy.exact.predictions

        # the access log shows the prediction beside the reported cached tokens
        def access_lines() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.name == "prefixgate.access" and "/v1/completions" in r.getMessage()
            ]

        deadline = time.monotonic() + 30  # the line is written after the answer's last byte
        while len(access_lines()) < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        lines = access_lines()
        pairs = [re.search(r"cached=(\d+) predicted=(\d+)", line) for line in lines]
        assert len(pairs) == 12 and all(m and m[1] == m[2] for m in pairs), lines
        assert any(m and int(m[1]) > 0 for m in pairs)
    finally:
        proxy.close()
    _settle(replicas)
    for srv in replicas:
        pool_whole(_engine(srv))


def test_upstream_without_feed_falls_back_to_cache_aware(
    replicas, aidreams_path, tmp_path, pool_whole
):
    feeds = kv_feeds(replicas)
    feeds.pop(replicas[1].url)
    proxy = _proxy(replicas, aidreams_path, tmp_path, feeds)
    try:
        with httpx.Client(base_url=proxy.url, timeout=60) as http:
            r = http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": "Bearer sk-b"},
            )
            assert r.status_code == 200, r.text
        precise = proxy.app[PROXY].router.policy.exact
        assert dict(precise.decisions) == {"fallback_no_feed": 1}
        assert router_tree_size(proxy) > 0  # the fallback's tree learns under precise too
    finally:
        proxy.close()
    _settle(replicas)
    for srv in replicas:
        pool_whole(_engine(srv))


def router_tree_size(proxy) -> int:
    return proxy.app[PROXY].router.tree.nodes
