"""The server answers while the model loads (``serve/runner.py``): the port is bound before the
load, the load runs in its own thread, so ``/health`` is 200 and ``/ready`` 503 all the while a
(deliberately slowed, interpreter-busy) load has not ended; then ``/ready`` turns 200, once
the C++ CPU ops the engine will use are built."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import prefixgate.engine
import torch
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.models.cpu_linear import OneDNNLinear, use_onednn_linear
from prefixgate.gateway import app as gateway_app
from prefixgate.gateway.serve.runner import serve
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.kernels import cpu_ext
from support.fake_engine import FakeEngine
from support.http import wait_ready
from support.net import free_port


class ServeThread:
    """``serve`` (the runner, fake-engine settings) on a free loopback port, in its own thread
    and event loop: ``start()``, then ``stop()`` cancels it and joins the thread."""

    def __init__(self) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self._loop = asyncio.new_event_loop()
        self._task: list[asyncio.Task] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        port = int(self.url.rsplit(":", 1)[1])
        coro = serve(GatewaySettings(model_name="fake"), EngineConfig(), [], "127.0.0.1", port)
        self._task.append(self._loop.create_task(coro))
        try:
            self._loop.run_until_complete(self._task[0])
        except asyncio.CancelledError:
            pass

    def start(self) -> ServeThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._task:
            self._loop.call_soon_threadsafe(self._task[0].cancel)
        self._thread.join(30)


def test_health_answers_while_a_slow_load_runs(monkeypatch):
    release = threading.Event()
    loading = threading.Event()
    answered_during_load: list[int] = []

    class SlowEngine(FakeEngine):
        def __init__(self, config: EngineConfig) -> None:
            loading.set()
            while not release.is_set():  # busy in Python, as an import or a weight copy is
                sum(range(10_000))
            super().__init__()

    monkeypatch.setattr(prefixgate.engine, "AsyncEngine", SlowEngine)
    server = ServeThread().start()
    url = server.url
    try:
        assert loading.wait(60)
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(20):  # 20 probes, all during the load (it waits for `release`)
                while True:
                    try:
                        r = http.get("/health")
                        break
                    except httpx.ConnectError:
                        time.sleep(0.05)  # bound just after the load started
                answered_during_load.append(r.status_code)
                assert http.get("/ready").status_code == 503
            assert not release.is_set()
            release.set()
            deadline = time.monotonic() + 30
            while http.get("/ready").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert http.get("/ready").status_code == 200
        assert answered_during_load == [200] * 20
    finally:
        release.set()
        server.stop()


def test_the_load_thread_outlives_the_load_until_the_server_stops(monkeypatch):
    """The thread that loaded the model ran torch's first parallel regions (it owns the
    OpenMP thread pool); it stays parked while the server runs — once it had exited, every
    engine step's parallel region ran many times slower — and ends when the server stops."""
    monkeypatch.setattr(prefixgate.engine, "AsyncEngine", lambda config: FakeEngine())

    def loaders() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "prefixgate-load"]

    before = set(loaders())
    server = ServeThread().start()
    url = server.url
    wait_ready(url, 60, poll_s=0.05, request_timeout_s=10)
    mine = [t for t in loaders() if t not in before]
    assert len(mine) == 1 and mine[0].is_alive()
    with httpx.Client(base_url=url, timeout=30) as http:
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert mine[0].is_alive()
    server.stop()
    mine[0].join(30)
    assert not mine[0].is_alive()


def test_ready_comes_after_the_cpu_ops_are_built(monkeypatch):
    """On a fresh machine the first request after ``/ready`` paid the build of
    ``kernels/csrc/cpu_ops.cpp`` (17-26 s): an fp32 layer with 64-wide packed panels asked
    ``cpu_ext.available()`` (which builds the ops) at its first forward of a few rows. The load
    now decides that (``cpu_linear.decide_gemm_rows``), so the build comes before the server is
    ready and no request asks for it. Nothing is compiled here: ``available`` records when it
    is asked and says no (the torch paths), the real engine serves the tiny preset."""
    events: list[str] = []

    def available() -> bool:
        events.append("ops")
        return False

    real_attach = gateway_app.attach_engine

    def attach_engine(app, engine) -> None:
        real_attach(app, engine)  # the app is ready from here on (``/ready`` 200)
        events.append("ready")

    monkeypatch.setattr(cpu_ext, "available", available)
    monkeypatch.setattr(gateway_app, "attach_engine", attach_engine)
    server = ServeThread().start()
    try:
        wait_ready(server.url, 300, poll_s=0.05, request_timeout_s=10)
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    panels = OneDNNLinear(torch.zeros(64, 64), None)._panels  # this CPU's packed layout
    uses_ops = use_onednn_linear("cpu", torch.float32, None) and (
        panels is not None and panels.shape[2] == 64
    )
    assert "ready" in events, events
    assert "ops" not in events[events.index("ready") :], events  # never asked after ready
    assert ("ops" in events) == uses_ops, events  # asked during the load where they are used
