"""Proxy mode needs no torch: the gateway's imports and ``prefixgate serve --upstream``.

What the process test simulates: an environment where only ``prefixgate[proxy]`` is installed.
The real ``prefixgate`` console script runs in a subprocess whose ``sitecustomize.py`` (first
on ``PYTHONPATH``) sets ``sys.modules[name] = None`` for every engine-only package (torch,
safetensors, tokenizers, jinja2, numpy, triton, transformers), so ``import torch`` raises
``ModuleNotFoundError`` exactly as where torch is not installed; everything else (aiohttp,
pydantic, prometheus-client, xxhash, httpx, ...) comes from this test's own environment. A
fresh venv without system packages would need a PyPI install per run: this is the same import
graph without the download. The served request goes through a stub upstream on loopback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from support.stub_upstream import StubServer

BLOCKED = ("torch", "safetensors", "tokenizers", "jinja2", "numpy", "triton", "transformers")

SITECUSTOMIZE = textwrap.dedent(
    f"""
    import sys
    for name in {BLOCKED!r}:
        sys.modules[name] = None  # import raises ModuleNotFoundError, as when not installed
    """
)


def _blocked_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return env


def test_gateway_imports_without_torch(tmp_path):
    """``import prefixgate.gateway.app`` (and the CLI's parser) with the engine-only packages
    unimportable; the engine's torch-free types import too, and torch really is blocked."""
    code = (
        "import prefixgate.gateway.app, prefixgate.gateway.cli as cli\n"
        "from prefixgate.engine import SamplingParams, EngineDeadError, PinLimitError\n"
        "from prefixgate.engine.protocol import EngineClient\n"
        "cli.build_parser('serve')\n"
        "try:\n    import torch\nexcept ModuleNotFoundError:\n    print('no torch')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_blocked_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no torch"


def test_serve_upstream_starts_and_proxies_without_torch(tmp_path):
    """``prefixgate serve --upstream URL --port 0`` in a process without torch: /ready is 200,
    a streamed chat completion comes through from the upstream chunk by chunk, and SIGTERM
    stops it with exit code 0."""
    stub = StubServer(ttft_s=0.0, token_delay_s=0.0).start()
    script = Path(sys.executable).with_name("prefixgate")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "prefixgate.gateway.cli"]
    cmd += ["serve", "--upstream", stub.base_url, "--port", "0", "--log-level", "INFO"]
    proc = subprocess.Popen(
        cmd,
        env=_blocked_env(tmp_path),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not found.wait(120):
            pytest.fail("the proxy did not start:\n" + "".join(lines))
        url = re.search(r"listening on (http://\S+)", "".join(lines)).group(1)
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/ready").status_code == 200
            body = {
                "model": "stub-model",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": True,
            }
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in map(json.loads, events[:-1])
            if c["choices"]
        )
        assert text == "t0 t1 t2 "
        assert stub.seen and stub.seen[-1]["messages"] == body["messages"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        stub.stop()
    reader.join(5)
    assert not any("Traceback" in line for line in lines), "".join(lines)
