"""/dashboard: the sampled JSON (/dashboard/data), its auth, both modes, the quantile maths,
and the page itself in headless Chromium under load (charts drawn with live numbers, no JS
error)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.dashboard import histogram_quantile, static_file
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.http import assert_openai_error
from support.stub_upstream import StubServer

INF = math.inf
FAST = {"dashboard_sample_s": 0.1, "dashboard_window_s": 30.0}


def _keys_file(tmp_path: Path, entries: list[dict]) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": entries}))
    return str(path)


def _wait_samples(http: httpx.Client, n: int, pred=lambda d: True, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        data = http.get("/dashboard/data").json()
        if len(data["samples"]) >= n and pred(data):
            return data
        assert time.monotonic() < deadline, data
        time.sleep(0.05)


def _sampled(data: dict, key: str) -> int:
    """Requests of ``key`` summed over the samples' per-interval deltas."""
    return sum(s["keys"].get(key, {}).get("requests", 0) for s in data["samples"])


def test_histogram_quantile_interpolates_like_prometheus():
    bounds = [0.1, 0.2, 0.4, INF]
    # 10 observations in (0.1, 0.2]: the median is halfway through that bucket.
    assert histogram_quantile(0.5, bounds, [0, 10, 10, 10]) == pytest.approx(0.15)
    # Lowest bucket starts at 0.
    assert histogram_quantile(0.5, bounds, [4, 4, 4, 4]) == pytest.approx(0.05)
    # Falls in +Inf: the largest finite bound, as histogram_quantile answers.
    assert histogram_quantile(0.99, bounds, [0, 0, 1, 100]) == 0.4
    assert histogram_quantile(0.5, bounds, [0, 0, 0, 0]) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, bounds, [0, 0, 0, 1])
    with pytest.raises(ValueError):
        histogram_quantile(0.5, bounds, [0, 1])


def test_settings_reject_bad_dashboard_intervals():
    with pytest.raises(ValueError, match="dashboard_sample_s"):
        GatewaySettings(dashboard_sample_s=0)
    with pytest.raises(ValueError, match="dashboard_window_s"):
        GatewaySettings(dashboard_sample_s=5, dashboard_window_s=1)


def test_static_files_come_from_the_package():
    html = static_file("dashboard.html").decode()
    assert 'id="errors"' in html and "/dashboard/dashboard.js" in html
    assert "http://" not in html and "https://" not in html  # no outside network
    js = static_file("dashboard.js").decode()
    assert "/dashboard/data" in js and "http" not in js.replace("/dashboard/data", "")


def test_data_local_mode_per_key_names_never_keys(serve_fake, gw, tmp_path):
    keys = _keys_file(
        tmp_path,
        [
            {"key": "sk-secret-a", "name": "team-a"},
            {"key": "sk-secret-b", "name": "team-b"},
            {"key": "sk-secret-ops", "name": "ops", "role": "operator"},
        ],
    )
    srv, _ = serve_fake(GatewaySettings(model_name="fake", keys_file=keys, **FAST))
    with gw.client(srv) as anon:
        page = anon.get("/dashboard")  # the page is public: it holds no numbers
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert anon.get("/dashboard/dashboard.js").status_code == 200
        assert_openai_error(anon.get("/dashboard/data"), 401, "invalid_api_key")
        bad = anon.get("/dashboard/data", headers={"Authorization": "Bearer nope"})
        assert_openai_error(bad, 401, "invalid_api_key")
    with (
        gw.client(srv, headers={"Authorization": "Bearer sk-secret-a"}) as a,
        gw.client(srv, headers={"Authorization": "Bearer sk-secret-b"}) as b,
        gw.client(srv, headers={"Authorization": "Bearer sk-secret-ops"}) as ops,
    ):
        for _ in range(3):
            r = a.post("/v1/chat/completions", json=gw.chat_body("hi", max_tokens=4))
            assert r.status_code == 200
        r = b.post("/v1/chat/completions", json=gw.chat_body("hey", max_tokens=3, stream=True))
        assert r.status_code == 200
        data = _wait_samples(ops, 3, lambda d: _sampled(d, "team-b") == 1)
        raw = ops.get("/dashboard/data").text
        own = a.get("/dashboard/data").json()  # a tenant's key: its own usage only
    assert "sk-secret" not in raw
    assert set(own["keys"]) == {"team-a"} and own["keys"]["team-a"]["requests"] == 3
    assert all(set(x["keys"]) <= {"team-a"} for x in own["samples"])
    assert data["mode"] == "local" and data["model"] == "fake"
    assert data["keys"]["team-a"] == {
        "requests": 3,
        "prompt_tokens": 3 * (1 + len("hi")),
        "completion_tokens": 12,
    }
    assert data["keys"]["team-b"]["requests"] == 1
    assert data["keys"]["team-b"]["completion_tokens"] == 3
    # The window's percentiles and the per-interval key deltas add up.
    with_ttft = [s for s in data["samples"] if s["ttft_p50"] is not None]
    assert with_ttft and all(0 < s["ttft_p50"] <= s["ttft_p99"] for s in with_ttft)
    assert _sampled(data, "team-a") == 3
    last = data["samples"][-1]
    assert last["kv_usage"] is not None and 0 <= last["kv_usage"] <= 1
    assert last["queued"] == 0 and last["running"] == 0
    assert set(last) >= {"t", "requests_per_s", "tokens_per_s", "prefix_hit_rate", "tpot_p99"}


def test_data_ring_buffer_is_bounded(serve_fake, gw):
    settings = GatewaySettings(model_name="fake", dashboard_sample_s=0.05, dashboard_window_s=0.2)
    srv, _ = serve_fake(settings)
    with gw.client(srv) as http:
        time.sleep(0.6)
        data = http.get("/dashboard/data").json()
    assert 1 <= len(data["samples"]) <= 4
    assert data["keys"] == {}


def test_data_proxy_mode_counts_requests_per_key(tmp_path):
    stub = StubServer(name="stub-model")
    with BackgroundServer(stub.app) as up:
        keys = _keys_file(tmp_path, [{"key": "sk-p", "name": "proxy-team"}])
        settings = GatewaySettings(keys_file=keys, **FAST)
        with BackgroundServer(lambda: create_proxy_app([up.url], settings)) as gw:
            auth = {"Authorization": "Bearer sk-p"}
            with httpx.Client(base_url=gw.url, headers=auth, timeout=30) as http:
                body = {"model": "stub-model", "messages": [{"role": "user", "content": "x"}]}
                for _ in range(2):
                    assert http.post("/v1/chat/completions", json=body).status_code == 200
                # A stream with usage: the upstream's counts are charged to the key's name.
                streamed = {**body, "stream": True, "max_tokens": 3}
                streamed["stream_options"] = {"include_usage": True}
                assert http.post("/v1/chat/completions", json=streamed).status_code == 200
                assert http.get("/dashboard").status_code == 200
                data = _wait_samples(http, 2, lambda d: _sampled(d, "proxy-team") == 3)
    assert data["mode"] == "upstream"
    team = data["keys"]["proxy-team"]
    assert team["requests"] == 3
    # The stub's usage: 1 prompt token ("x"), 3 completion tokens; the answers without usage
    # add none.
    assert team == {"requests": 3, "prompt_tokens": 1, "completion_tokens": 3}
    last = data["samples"][-1]
    assert last["kv_usage"] is None and last["prefix_hit_rate"] is None  # no engine here


# --- the page in headless Chromium -----------------------------------------------------------


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (CI installs it: .ci/run)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return exe


def _browse(exe: str, url: str, tmp: Path, screenshot: Path | None) -> tuple[str, str]:
    """Load ``url`` headless; returns (dumped DOM, chromium's stderr console log)."""
    base = [
        exe,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={tmp / 'profile'}",
        "--window-size=1280,900",
        "--virtual-time-budget=8000",
        "--enable-logging=stderr",
        "--v=0",
    ]
    if screenshot is not None:
        shot = subprocess.run(
            [*base, f"--screenshot={screenshot}", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert screenshot.exists(), shot.stderr[-2000:]
    run = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, run.stderr


def _console_errors(log: str) -> list[str]:
    return [
        line
        for line in log.splitlines()
        if "CONSOLE" in line and ("Uncaught" in line or "Error" in line) or "Uncaught" in line
    ]


def test_page_draws_live_charts_in_headless_chromium(serve_fake, gw, tmp_path):
    exe = _chromium()
    keys = _keys_file(
        tmp_path,
        [
            {"key": "sk-dash-1", "name": "alpha", "role": "operator"},  # sees every key
            {"key": "sk-dash-2", "name": "beta"},
        ],
    )
    # samples of 0.5 s: the page shows the newest sample's requests/s, and a 0.25 s window
    # with no request ended in it (the host busy starting Chromium) reads 0
    settings = GatewaySettings(
        model_name="fake", keys_file=keys, dashboard_sample_s=0.5, dashboard_window_s=10.0
    )
    srv, _ = serve_fake(settings, token_delay_s=0.004, max_num_seqs=2)
    stop = threading.Event()

    def load(key: str, n_tokens: int) -> None:
        # bounded by time, not a request count: the load must outlast the browser (400
        # requests once ended before the page's last sample, which then read 0 requests/s)
        deadline = time.monotonic() + 120
        with gw.client(srv, headers={"Authorization": f"Bearer {key}"}) as http:
            i = 0
            while not stop.is_set() and time.monotonic() < deadline:
                # A shared system prompt: its blocks hit the prefix cache from the 2nd request.
                body = {
                    "model": "fake",
                    "messages": [
                        {"role": "system", "content": "You are a helpful assistant. " * 3},
                        {"role": "user", "content": f"question {i}"},
                    ],
                    "max_tokens": n_tokens,
                    "stream": i % 2 == 0,
                }
                assert http.post("/v1/chat/completions", json=body).status_code == 200
                i += 1

    workers = [
        threading.Thread(target=load, args=(k, n), daemon=True)
        for k, n in (("sk-dash-1", 12), ("sk-dash-1", 8), ("sk-dash-2", 16))
    ]
    for w in workers:
        w.start()
    try:
        with gw.client(srv, headers={"Authorization": "Bearer sk-dash-1"}) as http:
            _wait_samples(
                http, 12, timeout=20, pred=lambda d: _sampled(d, "alpha") and _sampled(d, "beta")
            )
        url = f"{srv.url}/dashboard?key=sk-dash-1"  # the operator: both keys' rows
        shot = Path(os.environ.get("PREFIXGATE_DASHBOARD_PNG") or tmp_path / "dashboard.png")
        dom, log = _browse(exe, url, tmp_path, shot)
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert 'data-ready="1"' in dom, dom[-3000:]
    assert re.search(r'<pre id="errors"></pre>', dom), dom
    assert not _console_errors(log), log[-3000:]
    # Live numbers written by the page: latencies, requests/s, KV usage, both keys' rows.
    ttft = re.search(r'id="v-ttft_p50">([^<]*)<', dom).group(1)
    assert ttft.endswith(" ms") and float(ttft.split()[0]) > 0, ttft
    rps = re.search(r'id="v-requests_per_s">([^<]*)<', dom).group(1)
    assert float(rps) > 0, rps
    assert re.search(r'id="v-kv_usage">[0-9.]+ %<', dom), dom
    rows = re.findall(r'<tr class="key-row"><td>([^<]*)</td><td>(\d+)</td>', dom)
    assert {name for name, _ in rows} == {"alpha", "beta"} and all(int(n) > 0 for _, n in rows)
    assert "sk-dash" not in dom  # names, never keys (the ?key= is dropped from the URL too)
    # Every chart drew the samples it got.
    for cid in ("c-ttft", "c-tpot", "c-rps", "c-tps", "c-queue", "c-kv", "c-hit", "c-key-req"):
        points = re.search(rf'id="{cid}"[^>]*data-points="(\d+)"', dom)
        assert points and int(points.group(1)) >= 12, (cid, dom[-2000:])
    hit = re.search(r'id="v-prefix_hit_rate">([0-9.]+) %<', dom)
    assert hit and 0 < float(hit.group(1)) <= 100, dom
    assert shot.stat().st_size > 10_000


def test_page_without_key_asks_for_one_and_logs_no_error(serve_fake, tmp_path):
    exe = _chromium()
    settings = GatewaySettings(model_name="fake", api_keys=["sk-x"], **FAST)
    srv, _ = serve_fake(settings)
    dom, log = _browse(exe, f"{srv.url}/dashboard", tmp_path, None)
    assert 'data-ready="0"' in dom
    assert re.search(r'<form id="keyform">', dom), dom  # shown (no hidden attribute)
    assert "an API key is needed" in dom
    assert re.search(r'<pre id="errors"></pre>', dom)
    assert not _console_errors(log), log[-3000:]
