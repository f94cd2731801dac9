"""Tenant isolation on the real aidreams-260k model, in both modes.

Local mode: the gateway on an in-process AsyncEngine. Proxy mode: a gateway with
``--upstream`` in front of a real ``prefixgate serve`` process on loopback. Keys A and B have
different salts.

* The issue's example: A sends a 65-token prompt twice (its second hits 64 cached tokens, 4
  blocks of 16), then B sends it: B must get ``cached_tokens`` 0 (was 64 in proxy mode).
* The side channel: 40 trials of B on A's warm secret prompt, against B on a fresh prompt:
  ``cached_tokens`` 0 every time; the TTFT medians of both are printed (``-s``) for the
  report, never asserted (timing assertions are not tests).
* Special-token strings in user content are plain text over HTTP, in both modes.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import time

import httpx
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from prefixgate.engine import AsyncEngine, EngineConfig  # noqa: E402
from prefixgate.engine.tokenizer import Tokenizer  # noqa: E402
from prefixgate.gateway.app import create_app, create_proxy_app  # noqa: E402
from prefixgate.gateway.http.server import BackgroundServer  # noqa: E402
from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from prefixgate.gateway.settings import GatewaySettings
from support.serve_process import SERVE, read_until_ready, terminate

MODEL = "aidreams-260k"
KEYS = [{"key": "ka", "salt": "tenant-a"}, {"key": "kb", "salt": "tenant-b"}]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": KEYS}))
    return str(path)


@pytest.fixture(scope="module")
def upstream(aidreams_path):
    """A real ``prefixgate serve`` process (open: the proxy's salts reach it as cache_salt)."""
    proc = subprocess.Popen(
        [
            *SERVE,
            "--model",
            aidreams_path,
            "--port",
            "0",
            "--num-kv-blocks",
            "512",
            "--block-size",
            "16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url, log, _ = read_until_ready(proc, time.monotonic() + 120)
        assert url and httpx.get(url + "/ready").status_code == 200, "".join(log)
        yield url
    finally:
        terminate(proc)


@pytest.fixture(scope="module")
def local(aidreams_path, keys_file):
    def make():
        engine = AsyncEngine(EngineConfig(model=aidreams_path, num_kv_blocks=512, block_size=16))
        return create_app(engine, GatewaySettings(model_name=MODEL, keys_file=keys_file))

    srv = BackgroundServer(make).__enter__()
    yield srv
    srv.call(srv.app[LOCAL].engine.shutdown)
    srv.close()


@pytest.fixture(scope="module")
def proxy(upstream, keys_file):
    settings = GatewaySettings(keys_file=keys_file)
    srv = BackgroundServer(lambda: create_proxy_app([upstream], settings)).__enter__()
    yield srv
    srv.close()


@pytest.fixture(params=["local", "proxy"])
def gateway(request, pool_whole):
    """``(mode, url)``; afterwards the serving engine is idle and its KV pool whole (read
    from the upstream process's /metrics in proxy mode)."""
    srv = request.getfixturevalue(request.param)
    yield request.param, srv.url
    if request.param == "local":
        engine = srv.app[LOCAL].engine
        deadline = time.monotonic() + 10
        while engine.stats()["num_running"] + engine.stats()["num_waiting"] and (
            time.monotonic() < deadline
        ):
            time.sleep(0.02)
        pool_whole(engine)
    else:
        values = _metrics(request.getfixturevalue("upstream"))
        assert values["prefixgate_kv_blocks_used"] == 0, values
        assert values["prefixgate_kv_blocks_free"] == values["prefixgate_kv_blocks_total"]


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    deadline = time.monotonic() + 10
    while "prefixgate_running_requests 0.0" not in text and time.monotonic() < deadline:
        time.sleep(0.05)
        text = httpx.get(url + "/metrics").text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("prefixgate_") and " " in line and "{" not in line
    }


def _complete(c: httpx.Client, key: str, prompt: list[int], stream: bool = False) -> dict:
    """One completion of ``prompt`` (token ids) for ``key``: ``{cached, ttft_s}`` (TTFT from
    the request to the first streamed text chunk; None without streaming)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    if not stream:
        r = c.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return {"cached": r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"]:
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return {"cached": usage["prompt_tokens_details"]["cached_tokens"], "ttft_s": ttft}


def _prompt(rng: random.Random, n: int = 65) -> list[int]:
    """``n`` random token ids of the model (ids 3.. : no special token), BOS first."""
    return [1] + [rng.randrange(3, 500) for _ in range(n - 1)]


def test_other_tenant_never_hits_the_prompt(gateway):
    """The issue's example: B got cached_tokens 64 on A's 65-token prompt in proxy mode."""
    mode, url = gateway
    prompt = _prompt(random.Random(f"example-{mode}"))
    with httpx.Client(base_url=url, timeout=60) as c:
        assert _complete(c, "ka", prompt)["cached"] == 0
        assert _complete(c, "ka", prompt)["cached"] == 64  # A's own repeat: 4 blocks of 16
        assert _complete(c, "kb", prompt)["cached"] == 0
        assert _complete(c, "kb", prompt)["cached"] == 64  # B's own cache, apart from A's


def test_side_channel_40_trials(gateway):
    """B probing A's warm secret prompt learns nothing: cached_tokens 0 in all 40 trials.
    The TTFT medians (B on A's secret, B on a fresh prompt) are printed for the report."""
    mode, url = gateway
    rng = random.Random(f"side-{mode}")
    probe, fresh = [], []
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(40):
            secret = _prompt(rng)
            _complete(c, "ka", secret)
            _complete(c, "ka", secret)  # warm in A's partition
            on_secret = _complete(c, "kb", secret, stream=True)
            on_fresh = _complete(c, "kb", _prompt(rng), stream=True)
            assert on_secret["cached"] == 0 and on_fresh["cached"] == 0
            probe.append(on_secret["ttft_s"])
            fresh.append(on_fresh["ttft_s"])
    p, f = statistics.median(probe), statistics.median(fresh)
    print(
        f"\nside channel ({mode}): B's TTFT median on A's secret {p * 1e3:.2f} ms, on a fresh "
        f"prompt {f * 1e3:.2f} ms (ratio {p / f:.3f}; 40 trials each)"
    )


def test_special_token_strings_stay_text(gateway, aidreams_path):
    """User content "x <s> y" was tokenized with a second BOS id."""
    mode, url = gateway
    tok = Tokenizer.from_pretrained(aidreams_path)
    msgs = [{"role": "user", "content": "x <s> y </s> z"}]
    expected = tok.encode_chat(msgs)
    legacy = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert expected.count(1) == 1 and legacy.count(1) == 2 and len(expected) != len(legacy)
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": msgs, "max_tokens": 1},
            headers={"Authorization": "Bearer ka"},
        )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected), mode
