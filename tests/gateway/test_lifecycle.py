"""Graceful shutdown (gateway/http/lifecycle.py): in-flight requests get the grace period, then
every stream ends with an in-band error event (no [DONE]) and every other request with a
503 error object; nothing is left running in the engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest
from prefixgate.gateway.settings import GatewaySettings
from support.serve_process import SERVE


def _stream_events(url: str, body: dict, out: dict, key: str) -> None:
    events = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            out[key + "_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:
        out[key + "_exc"] = exc
    out[key] = events


def _stats(engine):
    async def get():
        return engine.stats()

    return get


def _post(url: str, body: dict, out: dict, key: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    out[key] = (r.status_code, r.json())


def test_drain_lets_short_requests_finish_and_ends_the_rest_explicitly(serve_fake, gw):
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keepalive_s=0.2), token_delay_s=0.05, max_num_seqs=8
    )
    out: dict = {}
    long_body = gw.chat_body("long", max_tokens=100)  # ~5 s of tokens
    short_body = gw.chat_body("short", max_tokens=4)  # ~0.2 s
    threads = [
        threading.Thread(
            target=_stream_events, args=(srv.url, {**long_body, "stream": True}, out, "stream")
        ),
        threading.Thread(target=_post, args=(srv.url, long_body, out, "long")),
        threading.Thread(target=_post, args=(srv.url, short_body, out, "short")),
    ]
    oa_error: list = []

    def openai_stream() -> None:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        try:
            for _ in client.chat.completions.create(
                model="fake", messages=long_body["messages"], max_tokens=100, stream=True
            ):
                pass
        except openai.APIError as exc:
            oa_error.append(exc)

    threads.append(threading.Thread(target=openai_stream))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the three long requests generating (a loaded machine)
        stats = srv.call(_stats(engine))
        if stats["num_running"] >= 3 and "short" in out:
            break
        time.sleep(0.05)
    t0 = time.monotonic()
    summary = srv.call(lambda: srv.server.drain(1.0), timeout=10)
    took = time.monotonic() - t0
    srv.server = None  # stopped by drain
    for t in threads:
        t.join(10)
    assert took < 6.0, took  # a hang check only; the bench reports the exit time
    assert summary["ended"] == 3, summary
    assert out["short"][0] == 200 and out["short"][1]["choices"][0]["finish_reason"] == "length"
    status, body = out["long"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down"
    events = out["stream"]
    assert out["stream_status"] == 200 and events, out
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] == "server_shutting_down"
    # the official client raises instead of returning the truncated text as complete
    assert len(oa_error) == 1 and "shut down" in str(oa_error[0])
    assert engine.stats()["num_running"] == 0


@pytest.mark.slow
def test_sigterm_on_prefixgate_serve_ends_streams_with_an_error_event(tmp_path):
    """The real CLI: SIGTERM with long streams in flight, grace 1 s: every client sees the
    error event, the process exits 0 within grace + 1 s."""
    port_file = tmp_path / "log"
    proc = subprocess.Popen(
        [
            *SERVE,
            "--port",
            "0",
            "--shutdown-grace-s",
            "1",
            "--max-model-len",
            "512",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = None
        deadline = time.monotonic() + 120
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "listening on" in line:
                url = line.split("listening on ")[1].split()[0]
            if "ready" in line and url:
                break
        assert url, "".join(lines)
        out: dict = {}
        body = {
            "model": "tiny-random",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        threads = [
            threading.Thread(target=_stream_events, args=(url, body, out, f"s{i}"))
            for i in range(3)
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
        port_file.write_text("".join(lines))
        assert code == 0
        assert took < 1.0 + 5.0, took  # a hang check; bench_faults reports the exit time
        for i in range(3):
            events = out[f"s{i}"]
            finished = any('"finish_reason":"length"' in e for e in events)
            assert "[DONE]" in events if finished else json.loads(events[-1])["error"], events[-2:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
