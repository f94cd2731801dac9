"""One table of stream endings per dialect: how a stream of each route ends when it finishes
and when the shutdown (``RunningServer.drain``) cuts it — each in its own dialect, never a
success: chat and completions ``data: {"error": ...}`` without ``[DONE]``; Responses an
``error`` event, then ``response.failed`` (never ``response.completed``); Messages
Anthropic's ``event: error`` (never ``message_stop``). Checked on the raw events and with the
official clients (openai-python raises for chat and completions and hands Responses'
``response.failed`` as the last event; the ``anthropic`` package raises)."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from prefixgate.gateway.settings import GatewaySettings
from support.fake_engine import assert_idle_and_whole

MSGS = [{"role": "user", "content": "long"}]
BODIES = {
    "/v1/chat/completions": {"model": "fake", "messages": MSGS, "stream": True},
    "/v1/completions": {"model": "fake", "prompt": "long", "stream": True},
    "/v1/responses": {"model": "fake", "input": "long", "stream": True},
    "/v1/messages": {"model": "fake", "messages": MSGS, "stream": True},
}
LIMIT = {"/v1/responses": "max_output_tokens"}  # the others: max_tokens

# route -> (the last events of a stream finished at its token limit — the fake engine never
# ends on its own —, of a stream cut by the shutdown), as
# (SSE event name or None, what its data holds); "[DONE]" is the data-only end of OpenAI's
ENDINGS = {
    "/v1/chat/completions": ([(None, "[DONE]")], [(None, "error:server_shutting_down")]),
    "/v1/completions": ([(None, "[DONE]")], [(None, "error:server_shutting_down")]),
    "/v1/responses": (
        [("response.incomplete", "response.incomplete")],  # (ended at max_output_tokens)
        [
            ("error", "error:server_shutting_down"),
            ("response.failed", "failed:server_shutting_down"),
        ],
    ),
    "/v1/messages": ([("message_stop", "message_stop")], [("error", "error:overloaded_error")]),
}


def _summary(event: str | None, data: str) -> tuple[str | None, str]:
    """What an event says, for the table: ``[DONE]``, ``error:<code or type>``,
    ``failed:<code>``, or its ``type``."""
    if data == "[DONE]":
        return event, data
    obj = json.loads(data)
    if event is None and "error" in obj:
        return event, "error:" + obj["error"]["code"]
    if obj.get("type") == "error":  # Responses' error event, Anthropic's error event
        err = obj.get("error") or obj
        return event, "error:" + (err.get("code") or err.get("type"))
    if obj.get("type") == "response.failed":
        assert obj["response"]["status"] == "failed", obj
        return event, "failed:" + obj["response"]["error"]["code"]
    return event, obj.get("type", "chunk")


def _events(url: str, path: str, max_tokens: int, out: dict) -> None:
    body = {**BODIES[path], LIMIT.get(path, "max_tokens"): max_tokens}
    events, name = [], None
    try:
        with httpx.stream("POST", url + path, json=body, timeout=30) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append(_summary(name, line[6:]))
                    name = None
    except httpx.HTTPError as exc:
        out[path + "_exc"] = exc
    out[path] = events


def _clients(url: str, out: dict) -> None:
    """Each official client on a long stream: what it raised, or its last event."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    runs = {
        "chat": lambda: list(
            oa.chat.completions.create(model="fake", messages=MSGS, max_tokens=100, stream=True)
        ),
        "completions": lambda: list(
            oa.completions.create(model="fake", prompt="long", max_tokens=100, stream=True)
        ),
        "responses": lambda: list(
            oa.responses.create(model="fake", input="long", max_output_tokens=100, stream=True)
        ),
        "messages": lambda: list(
            an.messages.create(model="fake", messages=MSGS, max_tokens=100, stream=True)
        ),
    }

    def run(name, fn):
        try:
            out[name] = ("events", fn()[-1])
        except (openai.APIError, anthropic.APIError) as exc:
            out[name] = ("raised", exc)

    threads = [threading.Thread(target=run, args=item) for item in runs.items()]
    for t in threads:
        t.start()
    out["_threads"] = threads


def _stats(engine):
    async def get():
        return engine.stats()

    return get


def test_every_dialect_ends_its_stream_in_its_own_shape(serve_fake):
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keepalive_s=0.2), token_delay_s=0.05, max_num_seqs=16
    )
    finished: dict = {}
    for path in BODIES:
        _events(srv.url, path, 3, finished)
        want = ENDINGS[path][0]
        assert finished[path][-len(want) :] == want, (path, finished[path])
    raw: dict = {}
    threads = [threading.Thread(target=_events, args=(srv.url, p, 100, raw)) for p in BODIES]
    for t in threads:
        t.start()
    clients: dict = {}
    _clients(srv.url, clients)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the eight long streams generating
        if srv.call(_stats(engine))["num_running"] >= 8:
            break
        time.sleep(0.05)
    summary = srv.call(lambda: srv.server.drain(0.1), timeout=10)
    srv.server = None  # stopped by drain
    for t in threads + clients.pop("_threads"):
        t.join(10)
    assert summary["ended"] == 8, summary
    for path in BODIES:
        want = ENDINGS[path][1]
        events = raw[path]
        assert events[-len(want) :] == want, (path, events[-4:])
        ends = {e[1] for e in events}
        success = {"[DONE]", "response.completed", "response.incomplete", "message_stop"}
        assert not ends & success, (path, ends)
    # the official clients: an error raised, or Responses' response.failed as the last event
    for name in ("chat", "completions", "messages"):
        kind, exc = clients[name]
        assert kind == "raised" and "shut down" in str(exc), (name, clients[name])
    kind, last = clients["responses"]
    assert kind == "events" and last.type == "response.failed", clients["responses"]
    assert last.response.status == "failed"
    assert last.response.error.code == "server_shutting_down"
    assert engine.stats()["num_running"] == 0


def test_proxy_streams_cut_by_its_shutdown_end_in_their_dialect(serve_fake):
    """Proxy mode relays chat, completions and Messages streams (Responses is local mode
    only): its own drain ends each relayed stream in its dialect, as local mode does."""
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer

    local, engine = serve_fake(
        GatewaySettings(model_name="fake", keepalive_s=0.2), token_delay_s=0.05, max_num_seqs=16
    )
    proxy = BackgroundServer(
        lambda: create_proxy_app([local.url], GatewaySettings(keepalive_s=0.2))
    ).__enter__()
    paths = ["/v1/chat/completions", "/v1/completions", "/v1/messages"]
    raw: dict = {}
    try:
        threads = [threading.Thread(target=_events, args=(proxy.url, p, 100, raw)) for p in paths]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if local.call(_stats(engine))["num_running"] >= 3:
                break
            time.sleep(0.05)
        summary = proxy.call(lambda: proxy.server.drain(0.1), timeout=10)
        proxy.server = None
        for t in threads:
            t.join(10)
    finally:
        proxy.close()
    assert summary["ended"] == 3, summary
    for path in paths:
        want = ENDINGS[path][1]
        assert raw[path][-len(want) :] == want, (path, raw[path][-3:])
    deadline = time.monotonic() + 5  # the upstream's requests aborted when the proxy let go
    while engine.stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats()["num_running"] == 0


def test_an_engine_failure_mid_stream_ends_every_dialect_with_its_error(serve_fake):
    """The engine fails after two tokens: the error event is each stream's last event (no
    ``[DONE]``, ``message_stop`` or Gemini's closing chunk after it)."""
    srv, engine = serve_fake()
    engine.fail_after(2)
    gemini = "/v1beta/models/fake:streamGenerateContent?alt=sse"
    bodies = {
        **{p: {**b, LIMIT.get(p, "max_tokens"): 8} for p, b in BODIES.items()},
        gemini: {
            "contents": [{"parts": [{"text": "long"}]}],
            "generationConfig": {"maxOutputTokens": 8},
        },
    }
    for path, body in bodies.items():
        with httpx.stream("POST", srv.url + path, json=body, timeout=10) as r:
            assert r.status_code == 200
            data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert "[DONE]" not in data, path
        last = json.loads(data[-1])
        if path == "/v1/responses":  # its error event, then response.failed
            assert last["type"] == "response.failed", (path, data[-3:])
            continue
        assert last.get("type") == "error" or "error" in last, (path, data[-3:])
        kinds = {json.loads(d).get("type") for d in data}
        assert not kinds & {"message_stop", "message_delta", "response.completed"}, path


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_gemini_stream_cut_by_the_shutdown_ends_with_its_error(serve_fake, mode):
    """A Gemini stream cut by the shutdown of the server it reaches (the local gateway, or the
    proxy in front of one) ends with Gemini's error event, never a finishReason; through the
    proxy, the upstream's request is aborted when the proxy lets go."""
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer

    local, engine = serve_fake(
        GatewaySettings(model_name="fake", keepalive_s=0.2), token_delay_s=0.05, max_num_seqs=16
    )
    front = local
    if mode == "proxy":
        front = BackgroundServer(
            lambda: create_proxy_app([local.url], GatewaySettings(keepalive_s=0.2))
        ).__enter__()
    path = "/v1beta/models/fake:streamGenerateContent?alt=sse"
    body = {
        "contents": [{"parts": [{"text": "long"}]}],
        "generationConfig": {"maxOutputTokens": 100},
    }
    out: dict = {}

    def run() -> None:
        with httpx.stream("POST", front.url + path, json=body, timeout=30) as r:
            out["lines"] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    try:
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not local.call(_stats(engine))["num_running"]:
            time.sleep(0.05)
        summary = front.call(lambda: front.server.drain(0.1), timeout=10)
        front.server = None
        t.join(10)
    finally:
        if front is not local:
            front.close()
    assert summary["ended"] == 1, summary
    last = json.loads(out["lines"][-1][6:])
    assert last["error"]["code"] == 503 and last["error"]["status"] == "UNAVAILABLE", last
    assert not any("finishReason" in ln for ln in out["lines"])
    if mode == "proxy":
        deadline = time.monotonic() + 5  # the upstream's request aborted when the proxy let go
        while engine.stats()["num_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats()["num_running"] == 0


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_an_aborted_answer_ends_every_translating_dialect_with_its_error(serve_fake, mode):
    """The engine aborts the request itself after two outputs (``finish_reason: "abort"``,
    vLLM's): chat and completions pass the finish reason on, as vLLM does; Responses,
    Messages and Gemini have no word for it and end with their error (``request_aborted``:
    a stream's error event, a whole answer's error object, 500 from the local engine, 502
    from the proxy's upstream) — never ``completed``, ``end_turn`` or a ``finishReason`` — in
    local mode and through a proxy alike (Messages reach a prefixgate upstream as they are,
    so the proxy relays its error; a chat upstream's abort: test_proxy_messages)."""
    from prefixgate.gateway.app import create_proxy_app

    srv, engine = serve_fake()
    engine.abort_after(2)
    front = srv
    if mode == "proxy":
        from prefixgate.gateway.http.server import BackgroundServer

        front = BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())).__enter__()
    gemini = "/v1beta/models/fake:streamGenerateContent?alt=sse"
    bodies = {
        **{p: {**b, LIMIT.get(p, "max_tokens"): 8} for p, b in BODIES.items()},
        gemini: {
            "contents": [{"parts": [{"text": "long"}]}],
            "generationConfig": {"maxOutputTokens": 8},
        },
    }
    status = 502 if mode == "proxy" else 500
    try:
        for path, body in bodies.items():
            with httpx.stream("POST", front.url + path, json=body, timeout=10) as r:
                assert r.status_code == 200
                data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            if path in ("/v1/chat/completions", "/v1/completions"):
                assert data[-1] == "[DONE]", path
                finishes = [c.get("finish_reason") for d in data[:-1] for c in
                            json.loads(d).get("choices") or []]  # fmt: skip
                assert "abort" in finishes, (path, data)
                continue
            assert "[DONE]" not in data, path
            last = json.loads(data[-1])
            kinds = {json.loads(d).get("type") for d in data}
            assert not kinds & {"message_stop", "message_delta", "response.completed"}, path
            assert "finishReason" not in json.dumps(data), path
            if path == "/v1/responses":
                assert last["type"] == "response.failed", (path, data[-3:])
                assert last["response"]["error"]["code"] == "request_aborted"
            elif path == "/v1/messages":  # a prefixgate upstream gets Messages as they are:
                assert last["type"] == "error", last  # its error event, a 5xx's in our words
                if mode == "local":
                    assert "aborted" in last["error"]["message"], last
            else:
                assert last["error"]["code"] == status and "aborted" in last["error"]["message"]
            whole = {k: v for k, v in body.items() if k != "stream"}
            whole_path = path.replace("streamGenerateContent?alt=sse", "generateContent")
            r = httpx.post(front.url + whole_path, json=whole, timeout=10)
            if path == "/v1/messages" and mode == "proxy":  # the upstream's 500, reworded
                assert r.status_code == 500 and r.json()["type"] == "error", r.text
                continue
            assert r.status_code == status, (path, r.text)
            assert "aborted" in r.text, (path, r.text)
        assert_idle_and_whole(srv, engine)  # every aborted request's blocks back in the pool
    finally:
        if front is not srv:
            front.close()
