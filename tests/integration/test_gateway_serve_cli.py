"""`prefixgate serve` as a real process: built-in preset, URL logged, served, SIGTERM → exit 0."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import httpx
import openai
import pytest
from support.serve_process import SERVE

pytest.importorskip("prefixgate.engine.async_engine")


def test_serve_tiny_random_then_sigterm():
    proc = subprocess.Popen(
        [
            *SERVE,
            "--port",
            "0",
            "--max-model-len",
            "64",
            "--num-kv-blocks",
            "64",
            "--api-key",
            "sk-t",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = []
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            log.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "".join(log)
        while time.monotonic() < deadline:
            log.append(proc.stdout.readline())
            if "ready" in log[-1]:
                break
        assert any("tiny-random" in line and "dummy" in line for line in log), "".join(log)
        assert httpx.get(url + "/ready").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-t", max_retries=0)
        r = client.chat.completions.create(
            model="tiny-random", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert r.usage.completion_tokens >= 1
        # The pool is whole once the request is done: no block used, none running or waiting.
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-t"}).text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("prefixgate_") and " " in line
        }
        assert values["prefixgate_kv_blocks_used"] == 0, values
        assert values["prefixgate_running_requests"] == 0, values
        assert values["prefixgate_kv_blocks_free"] == values["prefixgate_kv_blocks_total"], values
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_bad_option_exit_2(caplog):
    from prefixgate.gateway.cli import main

    assert main(["serve", "--block-size", "3"]) == 2
    assert "--block-size" in caplog.text
    assert main(["serve", "--upstream", "not-a-url"]) == 2


def test_serve_port_in_use_is_a_clear_error():
    """A taken port ends the process with exit 1 and a one-line reason, not a traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                *SERVE,
                "--port",
                str(port),
                "--upstream",
                "http://127.0.0.1:9",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1, proc.stderr
    assert "cannot listen on" in proc.stderr and "choose another --port" in proc.stderr
    assert "Traceback" not in proc.stderr
