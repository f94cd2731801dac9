"""Gateway test helpers: the fake engine, a gateway served from a background thread."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator

import httpx
import pytest
from prefixgate.engine.errors import PinLimitError
from prefixgate.gateway.app import create_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import FakeEngine, FakeTokenizer, assert_idle_and_whole, wait_idle


@pytest.fixture
def serve_fake() -> Iterator[Callable[..., tuple[BackgroundServer, object]]]:
    """``serve_fake(settings=None, access_log=False, **engine_kw) -> (server, engine)``;
    stopped after the test."""
    started: list[BackgroundServer] = []

    def start(
        settings: GatewaySettings | None = None, access_log: bool = False, **engine_kw: object
    ):
        holder: dict = {}

        def make():
            holder["engine"] = FakeEngine(**engine_kw)
            return create_app(holder["engine"], settings or GatewaySettings(model_name="fake"))

        srv = BackgroundServer(make, access_log=access_log).__enter__()
        started.append((srv, holder["engine"]))
        return srv, holder["engine"]

    yield start
    try:
        # Every scenario ends with the engine idle and its pool whole: no request left running
        # or waiting (a disconnect or error the gateway failed to abort would stay), no block
        # used but those the test's live prefix pins hold.
        for srv, engine in started:
            if getattr(engine, "failed_to_start", False):
                continue
            assert_idle_and_whole(srv, engine)
    finally:
        for srv, _ in started:
            srv.close()


@pytest.fixture
def servers() -> Iterator[Callable[..., BackgroundServer]]:
    """``servers(make, port=0) -> server``: ``make`` (an app factory) served on loopback from
    a background thread; every server the test started is closed after it, newest first."""
    started: list[BackgroundServer] = []

    def start(make: Callable[[], object], port: int = 0) -> BackgroundServer:
        srv = BackgroundServer(make, port=port).__enter__()
        started.append(srv)
        return srv

    yield start
    for srv in reversed(started):
        srv.close()


@pytest.fixture
def tools_in_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake tokenizer's chat template declares the tools it is given (their names after
    the conversation, as a real template renders their declarations): a prompt with tools
    counts more tokens than one without."""
    plain = FakeTokenizer.encode_chat

    def encode_chat(self, messages, add_generation_prompt=True, **kw):
        names = " ".join(t["function"]["name"] for t in kw.get("tools") or [])
        return plain(self, messages, add_generation_prompt) + self.encode(names, False)

    monkeypatch.setattr(FakeTokenizer, "encode_chat", encode_chat)


def chat_body(content: str = "hello", **kw: object) -> dict:
    """A minimal chat request body for the fake model."""
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **kw}


def client(srv: BackgroundServer, **kw: object) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=30, **kw)


@pytest.fixture
def gw() -> types.SimpleNamespace:
    """Helpers: FakeEngine, wait_idle, chat_body, client."""
    return types.SimpleNamespace(
        FakeEngine=FakeEngine,
        wait_idle=wait_idle,
        chat_body=chat_body,
        client=client,
        PinLimitError=PinLimitError,
    )


@pytest.fixture
def redis_server():
    """A real ``redis-server`` on a free loopback port (``support.redis_server``), stopped after."""
    from support.redis_server import start_redis

    server = start_redis()
    try:
        yield server
    finally:
        server.stop()
