"""Each script in examples/ runs as written against a real gateway on loopback.

The gateway serves ../shared/models/aidreams-260k (a real trained tiny Llama) from a thread on a
free port; every example runs as a subprocess with ``PREFIXGATE_BASE_URL`` pointing at it.
``proxy.py`` starts its own gateway in upstream mode in front of that one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def gateway_url(aidreams_path):
    import torch
    from prefixgate.engine import AsyncEngine, EngineConfig
    from prefixgate.gateway.app import create_app
    from prefixgate.gateway.http.server import BackgroundServer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model on a shared 2-core machine (see docs/architecture.md)
    engines = []

    def make_app():
        engine = AsyncEngine(EngineConfig(model=aidreams_path, num_kv_blocks=256))
        engines.append(engine)
        return create_app(engine)

    with BackgroundServer(make_app) as server:
        yield server.url + "/v1"
        if engines:
            server.call(engines[0].shutdown)
    torch.set_num_threads(threads)


def _run(name: str, base_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``examples/{name}`` run against ``base_url`` with ``env`` added, its output captured."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env={**os.environ, "PREFIXGATE_BASE_URL": base_url, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_example(name: str, base_url: str, **env: str) -> str:
    """The example's stdout; it must succeed."""
    proc = _run(name, base_url, **env)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def failure_line(name: str, base_url: str, **env: str) -> str:
    """The example's one stderr line; it must exit 1 saying what went wrong in that line."""
    proc = _run(name, base_url, **env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_quickstart(gateway_url):
    out = run_example("quickstart.py", gateway_url)
    assert "model: aidreams-260k" in out and "reply:" in out and "stream:" in out
    cached = [line for line in out.splitlines() if line.startswith("second call:")]
    assert cached and not cached[0].startswith("second call: 0 ")
    assert out.count("batch ") == 4


def test_openai_client(gateway_url):
    out = run_example("openai_client.py", gateway_url)
    assert "chat:" in out and "completion:" in out and "stream usage:" in out
    assert "same greedy text: True" in out
    again = next(line for line in out.splitlines() if line.startswith("again:"))
    assert not again.startswith("again: 0 ")


def test_prefix_api(gateway_url):
    out = run_example("prefix_api.py", gateway_url)
    assert "same text as sending the full messages: True" in out
    assert "deleted" in out and out.count("session ") == 2
    cached = next(line for line in out.splitlines() if "prompt tokens cached" in line)
    assert not cached.strip().startswith("0 ")


def test_anthropic_client(gateway_url):
    out = run_example("anthropic_client.py", gateway_url)
    assert "model: aidreams-260k" in out and "stream: " in out
    prompt = int(next(line for line in out.splitlines() if line.startswith("prompt:")).split()[1])
    assert prompt + 32 <= 128  # the prompt and max_tokens fit aidreams-260k's context
    second = next(line for line in out.splitlines() if line.startswith("second call:"))
    assert " 0 read" not in second, out  # the marked system prompt came from the cache


def test_proxy(gateway_url):
    out = run_example("proxy.py", gateway_url, PREFIXGATE_UPSTREAM_URL=gateway_url)
    assert "identical: True" in out


@pytest.mark.parametrize(
    "name",
    ["quickstart.py", "openai_client.py", "prefix_api.py", "proxy.py", "anthropic_client.py"],
)
def test_example_without_a_server_says_so_in_one_line(name):
    url = "http://127.0.0.1:9/v1"  # nothing listens on the discard port
    line = failure_line(name, url, PREFIXGATE_UPSTREAM_URL=url)
    assert "cannot reach a server at" in line


@pytest.fixture(scope="module")
def keyed_url():
    """A gateway (fake engine) that takes only the key ``sk-right``."""
    from prefixgate.gateway.app import create_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings
    from support.fake_engine import FakeEngine

    settings = GatewaySettings(model_name="fake", api_keys=["sk-right"])
    with BackgroundServer(lambda: create_app(FakeEngine(), settings)) as server:
        yield server.url + "/v1"


@pytest.mark.parametrize("name", ["quickstart.py", "openai_client.py", "prefix_api.py", "proxy.py"])
def test_example_with_a_refused_key_says_so_in_one_line(name, keyed_url):
    line = failure_line(
        name, keyed_url, PREFIXGATE_UPSTREAM_URL=keyed_url, PREFIXGATE_API_KEY="sk-wrong"
    )
    assert "refused the API key (401" in line and "PREFIXGATE_API_KEY" in line
