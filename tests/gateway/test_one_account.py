"""One account, one truth: for each dialect x mode x streamed or not, the access line, the
per-key metric and the key's charge all agree with the ``usage`` the client got
(``http/request_account.RequestAccount`` is what every one of them reads).

Local mode serves a ``FakeEngine``; proxy mode forwards to such a local gateway (a prefixgate
upstream), so its usage is the upstream's. The prompt is long enough that repeats hit the
fake engine's prefix cache, so cached tokens are not all zero.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.shared_state import LocalState
from support.fake_engine import FakeEngine, assert_idle_and_whole

KEY, NAME = "k-acct", "acct"
PROMPT = "Tell me about prefix caches, and why they matter so. " * 2  # 104 bytes
MAX = 5
LINE = re.compile(r"key=(\S+) prompt=(\S+) completion=(\S+) cached=(\S+)")


def _usage_openai(u: dict[str, Any]) -> tuple[int, int, int | None]:
    details = u.get("prompt_tokens_details") or {}
    return u["prompt_tokens"], u["completion_tokens"], details.get("cached_tokens")


def _usage_responses(u: dict[str, Any]) -> tuple[int, int, int | None]:
    details = u.get("input_tokens_details") or {}
    return u["input_tokens"], u["output_tokens"], details.get("cached_tokens")


def _usage_anthropic(u: dict[str, Any]) -> tuple[int, int, int | None]:
    read = u.get("cache_read_input_tokens")
    prompt = u["input_tokens"] + (u.get("cache_creation_input_tokens") or 0) + (read or 0)
    return prompt, u["output_tokens"], read


def _usage_gemini(m: dict[str, Any]) -> tuple[int, int, int | None]:
    return m["promptTokenCount"], m["candidatesTokenCount"], m.get("cachedContentTokenCount")


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            out.append(json.loads(line[5:]))
    return out


def _client_usage(dialect: str, stream: bool, resp: httpx.Response) -> tuple[int, int, int | None]:
    """(prompt, completion, cached) of the usage the client got, as its dialect states it."""
    if not stream:
        body = resp.json()
        if dialect == "gemini":
            return _usage_gemini(body["usageMetadata"])
        if dialect == "messages":
            return _usage_anthropic(body["usage"])
        if dialect == "responses":
            return _usage_responses(body["usage"])
        return _usage_openai(body["usage"])
    events = _events(resp.text)
    if dialect == "gemini":
        return _usage_gemini(events[-1]["usageMetadata"])
    if dialect == "messages":  # message_start's input side, message_delta's cumulative usage
        usage: dict[str, Any] = {}
        for e in events:
            if e.get("type") == "message_start":
                usage.update(e["message"]["usage"])
            elif e.get("type") == "message_delta":
                usage.update({k: v for k, v in e["usage"].items() if v is not None})
        return _usage_anthropic(usage)
    if dialect == "responses":
        ends = ("response.completed", "response.incomplete")  # max_output_tokens: incomplete
        done = [e for e in events if e.get("type") in ends]
        return _usage_responses(done[-1]["response"]["usage"])
    return _usage_openai([e for e in events if e.get("usage")][-1]["usage"])


def _request(dialect: str, stream: bool) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, body, headers) of one request of ``dialect``, each in its clients' form."""
    ask = [{"role": "user", "content": PROMPT}]
    if dialect == "chat":
        body: dict[str, Any] = {"model": "fake", "messages": ask, "max_tokens": MAX}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"}
    if dialect == "completions":
        body = {"model": "fake", "prompt": PROMPT, "max_tokens": MAX}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return "/v1/completions", body, {"Authorization": f"Bearer {KEY}"}
    if dialect == "responses":
        body = {"model": "fake", "input": PROMPT, "max_output_tokens": MAX, "stream": stream}
        return "/v1/responses", body, {"Authorization": f"Bearer {KEY}"}
    if dialect == "messages":
        body = {"model": "fake", "messages": ask, "max_tokens": MAX, "stream": stream}
        return "/v1/messages", body, {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    body = {
        "contents": [{"role": "user", "parts": [{"text": PROMPT}]}],
        "generationConfig": {"maxOutputTokens": MAX},
    }
    return f"/v1beta/models/fake:{method}", body, {"x-goog-api-key": KEY}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def ours(self) -> list[str]:
        return [line for line in self.lines if f"key={NAME} " in line]


@pytest.fixture(scope="module")
def access_lines() -> Iterator[_Lines]:
    logger = logging.getLogger("prefixgate.access")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def gateways(tmp_path_factory, access_lines) -> Iterator[dict[str, BackgroundServer]]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY, "name": NAME, "tokens_per_minute": 10**9}]}))
    settings = GatewaySettings(model_name="fake", keys_file=str(keys))
    engines = [FakeEngine(), FakeEngine()]  # the local gateway's, the proxy's upstream's
    local = BackgroundServer(lambda: create_app(engines[0], settings), access_log=True)
    upstream = BackgroundServer(
        lambda: create_app(engines[1], GatewaySettings(model_name="fake")), access_log=True
    )
    started = [local.__enter__(), upstream.__enter__()]
    proxy = BackgroundServer(
        lambda: create_proxy_app([upstream.url], GatewaySettings(keys_file=str(keys))),
        access_log=True,
    )
    started.append(proxy.__enter__())
    try:
        yield {"local": local, "proxy": proxy}
        for srv, engine in zip((local, upstream), engines, strict=True):
            assert_idle_and_whole(srv, engine)  # every scenario left both engines whole
    finally:
        for srv in reversed(started):
            srv.close()


def _client_finish(dialect: str, stream: bool, resp: httpx.Response) -> str:
    """The first choice's finish reason the client got, in OpenAI's words."""
    words = {"max_tokens": "length", "MAX_TOKENS": "length", "end_turn": "stop", "STOP": "stop"}
    if dialect == "responses":
        return "length"  # max_output_tokens: the response is incomplete
    if not stream:
        body = resp.json()
        if dialect == "gemini":
            return words[body["candidates"][0]["finishReason"]]
        if dialect == "messages":
            return words[body["stop_reason"]]
        return body["choices"][0]["finish_reason"]
    events = _events(resp.text)
    if dialect == "gemini":
        return words[
            [e for e in events if e.get("candidates")][-1]["candidates"][0]["finishReason"]
        ]
    if dialect == "messages":
        (delta,) = [e for e in events if e.get("type") == "message_delta"]
        return words[delta["delta"]["stop_reason"]]
    return [e for e in events if e.get("choices")][-1]["choices"][0]["finish_reason"]


def _timing_counts(srv: BackgroundServer) -> tuple[float, float]:
    """(TTFT, TPOT) histograms' sample counts on ``srv``'s /metrics."""
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    counts = {}
    for line in text.splitlines():
        for name in ("time_to_first_token", "time_per_output_token"):
            if line.startswith(f"prefixgate_{name}_seconds_count"):
                counts[name] = float(line.rsplit(" ", 1)[1])
    return counts["time_to_first_token"], counts["time_per_output_token"]


def _key_tokens(srv: BackgroundServer) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    out = {"prompt": 0.0, "completion": 0.0}
    for line in text.splitlines():
        if line.startswith("prefixgate_key_tokens_total{") and f'key="{NAME}"' in line:
            out[line.split('kind="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


CASES = [
    (mode, dialect, stream)
    for mode, dialects in (
        ("local", ("chat", "completions", "responses", "messages", "gemini")),
        ("proxy", ("chat", "completions", "messages", "gemini")),
    )
    for dialect in dialects
    for stream in (False, True)
]


@pytest.mark.parametrize(("mode", "dialect", "stream"), CASES)
def test_access_line_metric_and_charge_agree_with_the_usage_answered(
    gateways, access_lines, monkeypatch, mode, dialect, stream
):
    charges: list[tuple[str | None, int, int]] = []
    settle = LocalState.settle

    def recording(
        self: LocalState, principal: Any, lease: Any, prompt_tokens: int, completion_tokens: int
    ) -> None:
        name = principal.spec.name if principal.spec else None
        charges.append((name, prompt_tokens, completion_tokens))
        settle(self, principal, lease, prompt_tokens, completion_tokens)

    monkeypatch.setattr(LocalState, "settle", recording)
    srv = gateways[mode]
    path, body, headers = _request(dialect, stream)
    before, lines = _key_tokens(srv), len(access_lines.ours())
    timings = _timing_counts(srv)
    resp = httpx.post(srv.url + path, json=body, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    prompt, completion, cached = _client_usage(dialect, stream, resp)
    assert prompt > 0 and completion > 0
    deadline = time.monotonic() + 10  # the access line comes once the handler is done
    while len(access_lines.ours()) == lines and time.monotonic() < deadline:
        time.sleep(0.01)
    (line,) = access_lines.ours()[lines:]
    match = LINE.search(line)
    assert match is not None, line
    assert (int(match[2]), int(match[3])) == (prompt, completion), line
    if cached is not None:
        assert match[4] == str(cached), line
    after = _key_tokens(srv)
    assert after["prompt"] - before["prompt"] == prompt
    assert after["completion"] - before["completion"] == completion
    assert [c for c in charges if c[0] == NAME] == [(NAME, prompt, completion)]
    # the finish reason and the first token's time (was: none in proxy mode's Messages and
    # Gemini relays; no TTFT/TPOT sample from any proxied stream)
    assert f" finish={_client_finish(dialect, stream, resp)} " in line, line
    timed = stream or mode == "local"  # a proxied JSON answer comes whole: no first token
    assert (re.search(r" ttft=\d+\.\d{3}s ", line) is not None) == timed, line
    ttft, tpot = _timing_counts(srv)
    assert ttft - timings[0] == int(timed)
    if stream:
        assert tpot - timings[1] == 1  # one choice, more than one token


def test_usage_not_reported_stays_not_known(tmp_path, access_lines, monkeypatch):
    # an upstream whose answer has no usage: the access line and the metric say nothing
    # (never 0); the key is charged what admission took (the prompt's estimate)
    from support.stub_upstream import StubServer

    charges: list[tuple[int, int]] = []
    settle = LocalState.settle

    def recording(
        self: LocalState, principal: Any, lease: Any, prompt_tokens: int, completion_tokens: int
    ) -> None:
        charges.append((prompt_tokens, completion_tokens))
        settle(self, principal, lease, prompt_tokens, completion_tokens)

    monkeypatch.setattr(LocalState, "settle", recording)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY, "name": NAME}]}))
    stub = StubServer(name="fake").start()
    proxy = BackgroundServer(
        lambda: create_proxy_app([stub.base_url], GatewaySettings(keys_file=str(keys))),
        access_log=True,
    ).__enter__()
    try:
        path, body, headers = _request("chat", False)
        lines = len(access_lines.ours())
        resp = httpx.post(proxy.url + path, json=body, headers=headers, timeout=30)
        assert resp.status_code == 200 and resp.json()["usage"] is None
        deadline = time.monotonic() + 10
        while len(access_lines.ours()) == lines and time.monotonic() < deadline:
            time.sleep(0.01)
        (line,) = access_lines.ours()[lines:]
        assert "prompt=- completion=- cached=-" in line, line
        assert _key_tokens(proxy) == {"prompt": 0.0, "completion": 0.0}
        ((prompt, completion),) = charges
        assert prompt > 0 and completion == 0  # the admission estimate, nothing counted
    finally:
        proxy.close()
        stub.stop()


@pytest.mark.parametrize(
    ("raised", "status"),
    [(None, 200), ("api", 429), ("http", 404), ("cancel", 499), ("other", 500)],
)
def test_the_account_notes_the_status_answered(raised, status):
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request
    from prefixgate.gateway.dashboard import usage_middleware
    from prefixgate.gateway.http.errors import APIError
    from prefixgate.gateway.http.request_account import account

    app = create_app(None, GatewaySettings())
    request = make_mocked_request("POST", "/v1/chat/completions", app=app)
    account(request).key_name = "-"

    async def handler(_: web.Request) -> web.StreamResponse:
        if raised == "api":
            raise APIError(429, "slow down")
        if raised == "http":
            raise web.HTTPNotFound()
        if raised == "cancel":
            raise asyncio.CancelledError
        if raised == "other":
            raise RuntimeError("boom")
        return web.Response(status=200)

    async def run() -> None:
        with pytest.raises(BaseException) if raised else contextlib.nullcontext():
            await usage_middleware(request, handler)

    asyncio.run(run())
    assert account(request).status == status
